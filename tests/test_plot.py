"""The dashboard: a run's metrics become one PNG.

    python -m pytest -q tests/test_plot.py
"""
import json
import os
import subprocess
import sys
import uuid

import pytest
from conftest import ROOT, train_records

from minigrpo.storage import Storage
from minigrpo.tools.plot import dashboard, plot_run


def write_run(run_dir):
    os.makedirs(os.path.join(run_dir, "metrics"))
    with open(os.path.join(run_dir, "metrics", "train-a-00000.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "eval/accuracy": 0.3, "time": 100.0}) + "\n")
        for step in range(1, 21):
            f.write(json.dumps({"step": step, "time": 100.0 + step, "reward/mean": 0.3 + step / 100, "ratio/mean": 1.0,
                                "ratio/min": 0.9, "ratio/max": 1.1, "clip_ratio/low": 0.01, "clip_ratio/high": 0.0,
                                "sample/staleness_mean": 1.0, "sample/staleness_max": 2,
                                "sample/dropped_stale_total": 5000 + 40 * step, "sample/bad_total": 3,  # resumed
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


def test_totals_have_an_axis_of_their_own_and_no_legend_covers_a_plot(tmp_path):
    """Run-long counters on the staleness axis squashed staleness flat after a resume; legends covered lines."""
    run_dir = str(tmp_path / "run")
    write_run(run_dir)
    fig = dashboard(Storage(run_dir), [])
    fig.canvas.draw()  # legends get their place
    labels = lambda ax: {line.get_label() for line in ax.get_lines()}  # noqa: E731
    stale = next(ax for ax in fig.axes if "staleness mean" in labels(ax))
    assert stale.get_ylim()[1] < 5, stale.get_ylim()  # staleness 1..2 fills its axis: no total of 5,000+ on it
    twin = next(ax for ax in fig.axes if "dropped_stale (total)" in labels(ax))
    assert twin is not stale and twin.bbox.bounds == stale.bbox.bounds  # the same panel, its other y axis
    totals = {lab for ax in fig.axes for lab in labels(ax) if lab.endswith("(total)")}
    assert totals == {"dropped_stale (total)", "bad (total)"} and totals <= labels(twin), totals  # every *_total key
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    assert len(legends) == 6  # one a panel, for both its axes
    assert {"staleness max", "dropped_stale (total)"} <= {t.get_text() for lg in legends for t in lg.get_texts()}
    for legend in legends:
        box = legend.get_window_extent()
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0, "a legend is cut off"
        for ax in fig.axes:  # every panel's plotting area, twins included
            assert not box.overlaps(ax.get_window_extent()), f"a legend covers {ax.get_title()!r}"


def test_the_dashboard_goes_into_the_run_directory_unless_told_otherwise(tmp_path):
    run_dir = str(tmp_path / "run")
    write_run(run_dir)
    cli = lambda *args: subprocess.run([sys.executable, "-m", "minigrpo.tools.plot", run_dir, *args],  # noqa: E731
                                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                                       env=dict(os.environ, PYTHONPATH=ROOT))
    out = cli()
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == f"wrote {run_dir}/dashboard.png", out.stderr[-2000:]
    assert open(f"{run_dir}/dashboard.png", "rb").read(4) == b"\x89PNG" and os.listdir(tmp_path) == ["run"]
    out = cli("--out", "pictures/there.png")  # relative to where it is run
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == f"wrote {tmp_path}/pictures/there.png", out.stderr
    assert os.path.getsize(tmp_path / "pictures" / "there.png") > 20_000
    assert sorted(os.listdir(tmp_path)) == ["pictures", "run"]  # and no dashboard.png beside them
    assert plot_run(run_dir, str(tmp_path / "there.png")) == str(tmp_path / "there.png")
    assert open(tmp_path / "there.png", "rb").read(4) == b"\x89PNG"


def test_a_run_in_a_bucket_gets_its_dashboard_there_and_an_empty_run_is_one_line(tmp_path):
    write_run(str(tmp_path / "run"))
    bucket = Storage(url := f"memory://{uuid.uuid4().hex}")
    for name in os.listdir(tmp_path / "run" / "metrics"):
        bucket.put(f"metrics/{name}", (tmp_path / "run" / "metrics" / name).read_bytes())
    assert plot_run(url) == bucket.url("dashboard.png") and bucket.get("dashboard.png")[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="no training steps under .*nothing to plot"):
        plot_run(str(tmp_path / "typo"))
    assert not os.path.exists(tmp_path / "typo")  # a mistyped RUN gets no folder made
