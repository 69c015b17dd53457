"""bench/gpu_smoke.sh, the one prepared GPU check, as its CPU dry run (tiny shapes), so that it cannot rot between
the sessions that are lent a GPU.

    python -m pytest -q tests/test_gpu_smoke.py
"""
import os
import re
import subprocess

from conftest import ROOT


def test_the_gpu_script_trains_checkpoints_resumes_and_reports_on_a_cpu(tmp_path):
    out = subprocess.run(["bash", "bench/gpu_smoke.sh", "--tiny"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, SMOKE_DIR=str(tmp_path)))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "MINIGRPO_FAULT" in (tmp_path / "train.log").read_text() and "resumed from" in out.stdout
    table = [line.split() for line in out.stdout.splitlines() if re.match(r"^\s+\d+\s+\d", line)]
    assert [int(row[0]) for row in table] == [1, 2, 3, 4], out.stdout
    assert abs(float(table[0][7]) - 1) < 1e-3, "step 1 is on policy in bf16 too"
    assert all(float(row[4]) > 0 for row in table), "trained tokens/s"
    assert re.search(r"generator: \d+ batches, \d+ tok/s", out.stdout)
