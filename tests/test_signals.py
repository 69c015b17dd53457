"""Ctrl-C on the README's demo command, `(python generate.py & python train.py)`, stops the generator too: a background
job of a non-interactive shell starts with SIGINT ignored, so every script restores the default handler as it starts
(parse_config). The trainer's shell may have been such a job too: CI once ran the suite so, and the trainer ran on.
Both say so in one line, without a traceback.

    python -m pytest -q tests/test_signals.py        # about half a minute on a 2-core CPU
"""
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def alive(pid: int) -> bool:
    """Whether a process that is not our child still runs (a zombie waiting for its parent does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def read(path) -> str:
    return path.read_text() if path.exists() else ""


def test_ctrl_c_on_the_demo_command_stops_the_background_generator_with_one_line(tmp_path):
    run_dir, gen_log, gen_pid = tmp_path / "run", tmp_path / "generate.log", tmp_path / "generate.pid"
    py, q = shlex.quote(sys.executable), shlex.quote
    command = (f"({py} generate.py --run_dir {q(str(run_dir))} > {q(str(gen_log))} 2>&1 & echo $! > {q(str(gen_pid))}; "
               f"{py} train.py --run_dir {q(str(run_dir))} > {q(str(tmp_path / 'train.log'))} 2>&1)")
    shell = subprocess.Popen(["bash", "-c", command], cwd=ROOT, start_new_session=True,  # its own process group
                             env=dict(os.environ, PYTHONUNBUFFERED="1"),  # started as a script's background job is:
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # with SIGINT ignored
    try:
        deadline = time.time() + 180
        while "completions per batch" not in read(gen_log):  # the generator's start line: it is in its loop
            assert time.time() < deadline and shell.poll() is None, read(gen_log) + read(tmp_path / "train.log")
            time.sleep(0.2)
        pid = int(gen_pid.read_text())
        os.killpg(shell.pid, signal.SIGINT)  # what Ctrl-C does: SIGINT to every process of the foreground group
        deadline = time.time() + 10
        while alive(pid):
            assert time.time() < deadline, f"the generator still runs 10 s after SIGINT:\n{read(gen_log)[-2000:]}"
            time.sleep(0.1)
        out = read(gen_log)
        assert "Traceback" not in out, out[-3000:]
        assert out.rstrip().endswith("generate.py: interrupted; every group it finished is intact"), out[-3000:]
        shell.wait(timeout=30)  # the trainer got the same SIGINT
        out = read(tmp_path / "train.log")
        assert "Traceback" not in out, out[-3000:]
        assert out.rstrip().endswith("train.py: interrupted; run the same command to resume from the last checkpoint")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()
