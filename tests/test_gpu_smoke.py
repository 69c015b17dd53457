"""bench/gpu_smoke.sh, the one prepared GPU check, as its CPU dry run (tiny shapes), so that it cannot rot between
the sessions that are lent a GPU; and its failure handling, which must show a phase's log instead of exiting silently.

    python -m pytest -q tests/test_gpu_smoke.py
"""
import os
import re
import subprocess
import sys

from conftest import ROOT


def smoke(*args, timeout=600, **env):
    return subprocess.run(["bash", "bench/gpu_smoke.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=os.environ | {"SMOKE_PYTHON": sys.executable} | env)


def test_the_gpu_script_trains_checkpoints_resumes_and_reports_on_a_cpu(tmp_path):
    out = smoke("--tiny", SMOKE_DIR=str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "MINIGRPO_FAULT" in (tmp_path / "train.log").read_text() and "resumed from" in out.stdout
    table = [line.split() for line in out.stdout.splitlines() if re.match(r"^\s+\d+\s+\d", line)]
    assert [int(row[0]) for row in table] == [1, 2, 3, 4], out.stdout
    assert abs(float(table[0][8]) - 1) < 1e-3, "step 1 is on policy in bf16 too"
    assert all(float(row[5]) > 0 for row in table), "trained tokens/s"
    assert re.search(r"generator: \d+ batches, \d+ tok/s", out.stdout)
    assert re.search(r"checkpointed step, one packed row of 1024 tokens .* tok/s", out.stdout), out.stdout
    assert "train_step, 2 micro-batches: host waits not measured on a CPU" in out.stdout, out.stdout
    assert re.search(r"SDPA operator aten::\S*attention", out.stdout), "which attention operator ran"
    assert re.search(r"peak GB, trainer life e\d+ .*training alone \d", out.stdout), "the resumed life's peak"


def test_a_failing_phase_prints_its_log_and_why(tmp_path):
    python = tmp_path / "python"  # the first Python phase: says something, then fails, or hangs past the deadline
    python.write_text("#!/bin/sh\necho 'what the phase said'\n[ -n \"$HANG\" ] && exec sleep 60\nexit 3\n")
    python.chmod(0o755)
    out = smoke("--tiny", timeout=60, SMOKE_DIR=str(tmp_path / "w"), SMOKE_PYTHON=str(python))
    assert out.returncode == 1 and "what the phase said" in out.stdout, out.stdout + out.stderr
    assert "phase 'versions' failed: exit code 3" in out.stdout
    out = smoke("--tiny", timeout=60, SMOKE_DIR=str(tmp_path / "w"), SMOKE_PYTHON=str(python), SMOKE_TOTAL_S="2",
                HANG="1")
    assert out.returncode == 1 and "what the phase said" in out.stdout, out.stdout + out.stderr
    assert re.search(r"phase 'versions' failed: exit code 124, past its deadline of [12]s", out.stdout)


def test_the_gpu_run_asks_for_the_prepared_wheels(tmp_path):
    out = smoke(timeout=60, SMOKE_DIR=str(tmp_path), SMOKE_WHEELS=str(tmp_path / "none"))
    assert out.returncode == 1 and "bench/gpu_smoke.sh --prepare" in out.stdout, out.stdout + out.stderr
