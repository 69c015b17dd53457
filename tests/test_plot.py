"""The dashboard: a run's metrics become one PNG.

    python -m pytest -q tests/test_plot.py
"""
import json
import os

from conftest import train_records

from minigrpo.tools.plot import plot_run


def write_run(run_dir):
    os.makedirs(os.path.join(run_dir, "metrics"))
    with open(os.path.join(run_dir, "metrics", "train-a-00000.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "eval/accuracy": 0.3, "time": 100.0}) + "\n")
        for step in range(1, 21):
            f.write(json.dumps({"step": step, "time": 100.0 + step, "reward/mean": 0.3 + step / 100, "ratio/mean": 1.0,
                                "ratio/min": 0.9, "ratio/max": 1.1, "clip_ratio/low": 0.01, "clip_ratio/high": 0.0,
                                "sample/staleness_mean": 1.0, "sample/staleness_max": 2, "sample/dropped_stale_total": 0,
                                "perf/fwd_bwd_s": 0.1, "perf/rollout_wait_s": 0.02, "perf/weight_sync_s": 0.01,
                                "perf/step_s": 0.14, "sample/rollout_queue_size": 5, "entropy": 0.5,
                                "completions/mean_length": 3.0} | ({"eval/accuracy": 0.5} if step == 20 else {})) + "\n")
        f.write(json.dumps({"step": 20, "time": 130.0, "reward/mean": 0.9}) + "\n")  # a re-run step supersedes
        f.write('{"step": 21, "time": 1\n\x00\x01garbage\n[1, 2]\n')  # a torn or hostile segment's lines
    with open(os.path.join(run_dir, "metrics", "generate-g0-a-00000.jsonl"), "w") as f:
        for i in range(10):
            f.write(json.dumps({"generator": "g0", "time": 101.0 + 2 * i, "rollout/backpressure_s": 0.5}) + "\n")


def test_dashboard_is_written_resumed_steps_supersede_and_bad_lines_are_counted(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    write_run(run_dir)
    assert train_records(run_dir)[-1]["reward/mean"] == 0.9 and len(train_records(run_dir)) == 20
    out = plot_run(run_dir, str(tmp_path / "dash.png"))
    assert "skipped 3 lines that are not JSON records, first train-a-00000.jsonl: '{\"step\": 21" in capsys.readouterr().out
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(out) > 20_000
