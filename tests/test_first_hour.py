"""A new user's first hour: what the scripts say when a flag is wrong, a process waits, or the demo runs.

    python -m pytest -q tests/test_first_hour.py        # about a minute on a 2-core CPU
"""
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from conftest import train_records

from minigrpo.rollouts import RolloutBuffer
from minigrpo.storage import Storage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def script(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def scripts(calls: list[tuple]) -> list[subprocess.CompletedProcess]:
    """script(*args) for each, four at a time: a script that gets past its flags pays 3-5 s of imports first."""
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda args: script(*args), calls))


def test_an_unknown_flag_is_one_line_and_exit_2(tmp_path):
    names = ("train.py", "generate.py")
    for name, out in zip(names, scripts([(name, "--run_dir", str(tmp_path / "run"), "--Task", "math") for name in names])):
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert out.stderr.strip() == f"{name}: unrecognized arguments: --Task math (--help lists the flags)"
    assert not os.path.exists(tmp_path / "run")


# runs a script as `python script.py ...` would, then says which of torch and transformers it had imported
PROBE = "import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n" \
        "finally:\n    print('loaded:', sorted({'torch', 'transformers'} & sys.modules.keys()))"


def test_a_wrong_model_is_one_line_before_torch_loads_and_the_corrected_command_runs(tmp_path):
    """A missing folder, and a hub id that is neither cached nor answers (CI has no hub: HF_HUB_OFFLINE=1 there)."""
    run_dir = str(tmp_path / "run")
    calls = [(name, "--run_dir", run_dir, "--model", model) for name in ("train.py", "generate.py")
             for model in (str(tmp_path / "no_such_model"), "no-such-owner/no-such-model")]
    for (name, *_, model), out in zip(calls, scripts([("-c", PROBE, *call) for call in calls])):
        assert out.returncode == 1 and out.stdout.strip().endswith("loaded: []"), (name, out.stdout[-500:], out.stderr[-2000:])
        assert len(lines := out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]
        assert lines[0].startswith(f"--model {model}: no such folder, nor a hub id that is cached or answers ("), lines
    assert not os.path.exists(run_dir)
    gen = subprocess.Popen([sys.executable, "generate.py", "--run_dir", run_dir], cwd=ROOT, env=ENV,
                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        out = script("train.py", "--run_dir", run_dir, "--max_steps", "2", "--eval_every", "1000", "--eval_size", "8",
                     "--groups_per_step", "4")
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert gen.wait(timeout=120) == 0
    finally:
        gen.kill()


def test_a_trainer_alone_says_what_it_waits_for_before_it_gives_up(tmp_path):
    out = script("train.py", "--run_dir", str(tmp_path / "run"), "--max_steps", "1", "--eval_size", "8",
                 "--wait_timeout_s", "4")
    waited = [line for line in out.stdout.splitlines() if line.startswith("waited ")]
    assert len(waited) == 1 and "for a fresh group in" in waited[0] and "is generate.py running?" in waited[0], out.stdout
    assert out.returncode == 1 and "no fresh group to learn from" in out.stderr and "Traceback" not in out.stderr


def test_a_generator_alone_says_at_once_that_it_waits_for_the_trainer(tmp_path):
    gen = subprocess.Popen([sys.executable, "generate.py", "--run_dir", str(tmp_path / "run")], cwd=ROOT, env=ENV,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = gen.stdout.readline()  # blocks until its first line
        assert line.startswith("waiting up to 600s for ") and line.rstrip().endswith("run.json: train.py creates it")
    finally:
        gen.kill()
        gen.wait()


def test_the_demo_prints_a_generator_line_every_5_seconds(tmp_path):
    """The quiet terminal: every batch is in RUN/metrics/, but the console shows a generator's line every 5 s (it
    printed one a batch, 12 for each step line, and then one for each adapter version, one or more a step)."""
    run_dir = str(tmp_path / "run")
    log = tmp_path / "generate.log"
    with open(log, "w") as f:
        gen = subprocess.Popen([sys.executable, "generate.py", "--run_dir", run_dir, "--generator_id", "g0"], cwd=ROOT,
                               env=ENV, stdout=f, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        out = script("train.py", "--run_dir", run_dir, "--max_steps", "12", "--eval_every", "1000", "--eval_size", "8")
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert gen.wait(timeout=120) == 0
        ran_s = time.monotonic() - t0
    finally:
        gen.kill()
    lines = [line for line in log.read_text().splitlines() if line.startswith("gen g0 batch")]
    storage = Storage(run_dir)
    batches = sum(1 for f in storage.list("metrics") if f.startswith("generate-g0")
                  for _ in storage.get(f"metrics/{f}").decode().splitlines())
    assert 1 <= len(lines) <= 1 + ran_s / 5 and batches > len(lines), (lines, batches, ran_s)
    assert len(train_records(run_dir)) == 12


def test_the_trainer_lists_a_bucket_only_when_what_it_knows_of_does_not_suffice(tmp_path):
    """A listing is the costly request on a bucket: 1,000 names a page. With 12 groups waiting, taking them 4 at a
    time lists rollouts/ once, not three times."""
    from test_rundir import make_group

    from minigrpo.rollouts import Ledger
    storage, lists = Storage(str(tmp_path / "run")), []
    buffer = RolloutBuffer(storage, "r1")
    for seq in range(3):
        buffer.write([make_group() for _ in range(4)], "w", seq)
    listed = storage.list
    storage.list = lambda prefix: lists.append(prefix) or listed(prefix)
    ledger = Ledger()
    taken = [g.group_id for _ in range(3) for g in buffer.take(4, ledger)]
    assert taken == [f"w-{i // 4:06d}.{i % 4}" for i in range(12)] and lists == ["rollouts"]
    assert buffer.take(4, ledger) == [] and lists == ["rollouts", "rollouts"]  # nothing known waits: it looks again


def test_bad_task_inputs_are_one_line_each_and_leave_no_trace(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n\n{"problem": "2+2",\n')
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    (tmp_path / "other.jsonl").write_text('{"question": "1+1", "solution": "2"}\n')
    cases = {("--task", "Math"): "--task 'Math' is unknown: pass --task reverse_add, math or calculator",
             ("--task", "math", "--task_data", str(tmp_path / "bad.jsonl")):
                 f'{tmp_path / "bad.jsonl"} line 3 is not a JSON object; --task_data takes one a line: '
                 '{"problem": .., "answer": ..}',
             ("--task", "math", "--task_data", str(tmp_path / "list.jsonl")): f"{tmp_path / 'list.jsonl'} line 1 is not",
             ("--task", "math", "--task_data", str(tmp_path / "none.jsonl")): f"--task_data {tmp_path / 'none.jsonl'}: "
                                                                               "no such file",
             ("--task", "math"): "--task math needs --task_data: a .jsonl or .parquet file",
             ("--task", "math", "--task_data", str(tmp_path / "other.jsonl")): f"{tmp_path / 'other.jsonl'} row 0 lacks",
             ("--task_data", str(tmp_path / "bad.jsonl")): "--task_data is read only by --task math and calculator, and --task is "
                                                          "reverse_add: add --task math"}
    both = [("--task", "Math"), ("--task_data", str(tmp_path / "bad.jsonl"))]  # generate.py checks with the same code
    calls = [(name, "--run_dir", str(tmp_path / "run"), *args) for args in cases
             for name in ("train.py", "generate.py") if name == "train.py" or args in both]
    for (name, _, _, *args), out in zip(calls, scripts(calls)):
        said = cases[tuple(args)]
        assert out.returncode == 1 and out.stderr.strip().startswith(said), (name, args, out.stderr[-2000:])
        assert len(out.stderr.strip().splitlines()) == 1 and not os.path.exists(tmp_path / "run"), out.stderr


def test_a_port_in_use_is_one_line_and_no_banner(tmp_path):
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for args in (["proxy.py", "--upstream", "http://127.0.0.1:9", "--no_auth"], ["-m", "minigrpo.replica.serve"]):
            out = script(*args, "--port", str(port))
            assert out.returncode == 1 and out.stdout == "", out.stdout
            assert out.stderr.strip().endswith(f"cannot listen on 127.0.0.1:{port} (Address already in use): pick "
                                               "another --port") and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_tracker_that_cannot_start_is_one_line(tmp_path):
    env = {k: v for k, v in ENV.items() if not k.startswith("WANDB_")} | {"HOME": str(tmp_path), "WANDB_MODE": "online"}
    out = subprocess.run([sys.executable, "train.py", "--run_dir", str(tmp_path / "run"), "--report_to", "wandb",
                          "--max_steps", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip() == "--report_to wandb: UsageError: No API key configured. Use `wandb login` to log in."


def test_help_shows_the_scripts_description_and_example_commands():
    examples = {"train.py": "python generate.py & python train.py", "generate.py": "python generate.py"}
    for (name, example), out in zip(examples.items(), scripts([(name, "--help") for name in examples])):
        assert out.returncode == 0 and out.stdout.startswith(f"usage: {name}"), out.stderr[-2000:]
        assert f"{name}: the" in out.stdout and example in out.stdout and "(default: 8)" in out.stdout, out.stdout[:3000]


def test_help_and_a_bad_value_answer_before_torch_loads():
    """The flags are read before torch and transformers load (3-5 s on this CPU): --help and a typo answer at once."""
    calls = [(name, *flags) for name in ("train.py", "generate.py", "proxy.py") for flags in (["--help"], ["--port", "x"])]
    for (name, *flags), out in zip(calls, scripts([("-c", PROBE, *call) for call in calls])):
        assert out.returncode == (0 if flags == ["--help"] else 2), out.stderr[-2000:]
        assert out.stdout.strip().endswith("loaded: []"), (name, flags, out.stdout[-500:])
        why = "argument --port: invalid int value: 'x'" if name == "proxy.py" else "unrecognized arguments: --port x"
        assert flags == ["--help"] or out.stderr.strip() == f"{name}: {why} (--help lists the flags)"


def test_a_flag_may_be_spelled_with_dashes_as_vllm_spells_its_own():
    from minigrpo.run import RunSettings, parse_config
    run, = parse_config(RunSettings, argv=["--task-data", "x.jsonl", "--max_new_tokens", "4", "--reasoning", "yes"])
    assert (run.task_data, run.max_new_tokens, run.reasoning) == ("x.jsonl", 4, True)
