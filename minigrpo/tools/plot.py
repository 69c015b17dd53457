"""A picture of a run: the dashboard to read when a run learns slowly or one side waits on the other.

    python -m minigrpo.tools.plot runs/demo                  # writes runs/demo/dashboard.png (RUN may be a URL too)"""
import argparse
import io
import os

import numpy as np
from matplotlib.figure import Figure  # not pyplot: no GUI backend, no global figure to close

from minigrpo.run import read_records
from minigrpo.storage import Storage


def latest_per_step(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if type(r.get("step")) is int}  # in order: the last one of a step stands


def right_axis(panel, title: str, curves: list[tuple]):  # title a panel; curves (x, y, label, colour) of another scale
    twin = panel.twinx()
    for x, y, label, colour in curves:
        twin.plot(x, y, color=colour, lw=0.8, label=label)
    panel.set_title(title)
    return twin


def dashboard(storage: Storage, bad: list) -> Figure:
    by_step = latest_per_step(read_records(storage, "train", bad))  # a step redone after a resume: the newest life's
    train = [by_step[s] for s in sorted(by_step)]
    steps = [r for r in train if r["step"] > 0]
    if not steps:
        raise SystemExit(f"no training steps under {storage.url('metrics')} yet: nothing to plot")
    x = [r["step"] for r in steps]
    col = lambda key, missing=float("nan"): [r.get(key, missing) for r in steps]
    fig = Figure(figsize=(16, 10))
    fig.suptitle(f"minigrpo run {storage.url()}")
    (reward, ratio, stale), (timing, queue, entropy) = fig.subplots(2, 3)

    reward.plot(x, col("reward/mean"), lw=0.8, alpha=0.6, label="reward/mean (train batch)")
    evals = [r for r in train if "eval/accuracy" in r]
    reward.plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], "o-", c="C3", label="eval/accuracy")
    reward.set_title("reward and held-out accuracy")

    ratio.plot(x, col("ratio/mean"), label="ratio/mean")
    ratio.fill_between(x, col("ratio/min"), col("ratio/max"), alpha=0.2, label="ratio min..max")
    ratio.set_yscale("log")  # a ratio is multiplicative: 2x and 0.5x sit at the same distance from 1
    keys = ("clip_ratio/low", "clip_ratio/high", "health/ess_frac", "health/mismatch_kl")
    right_axis(ratio, "ratio pi/mu (left); clipping and health (right)",  # symlog: fractions near 0 beside ESS near 1
               [(x, col(k), k, f"C{i}") for i, k in enumerate(keys, 2)]).set_yscale("symlog", linthresh=0.01)

    stale.plot(x, col("sample/staleness_mean"), label="staleness mean")
    stale.plot(x, col("sample/staleness_max"), label="staleness max")
    totals = sorted({k for r in steps for k in r if k.endswith("_total")})  # dropped_stale_total...: they only grow,
    right_axis(stale, "staleness in versions (left); run totals (right)",  # so never on staleness's scale
               [(x, col(k), f"{k.split('/')[-1][:-6]} (total)", f"C{i}") for i, k in enumerate(totals, 3)])

    parts = {"perf/fwd_bwd_s": "forward+backward", "perf/audit_s": "policy audit", "perf/rollout_wait_s": "rollout wait",
             "perf/weight_sync_s": "weight sync", "perf/eval_s": "evaluation"}  # eval_s only on the steps that evaluate
    timing.stackplot(x, *(col(k, 0.0) for k in parts), labels=parts.values(), alpha=0.8)
    timing.plot(x, col("perf/step_s"), color="k", lw=0.5, label="step total")
    timing.set_title("where a step's time goes (s)")

    queue.plot(x, col("sample/rollout_queue_size"), label="groups waiting for the trainer")
    gens = [r for r in read_records(storage, "generate-", bad)
            if isinstance(r.get("time"), (int, float)) and r["time"] >= steps[0].get("time", 0)]
    backpressure = []  # each generator's cumulative backpressure, its wall time put on the step axis
    for name in sorted({r.get("generator", "") for r in gens}):
        g = [r for r in gens if r.get("generator", "") == name]
        at = np.interp([r["time"] for r in g], [r.get("time", 0) for r in steps], x)
        cum = np.cumsum([r.get("rollout/backpressure_s", 0) for r in g])
        backpressure.append((at, cum, f"backpressure s (cum.) {name}", "C3"))
    right_axis(queue, "rollout queue against generator backpressure", backpressure)

    entropy.plot(x, col("entropy"), label="entropy (nats/token)")
    right_axis(entropy, "entropy and completion length",
               [(x, col("completions/mean_length"), "completion length", "C1")])

    for a in (reward, ratio, stale, timing, queue, entropy):  # one legend a panel, both axes', under it: off the lines
        a.set_xlabel("step")
        axes = sorted(a.get_shared_x_axes().get_siblings(a), key=lambda ax: ax is not a)  # the left axis' lines first
        handles = [h for ax in axes for h in ax.get_legend_handles_labels()[0]]
        a.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=8, frameon=False)
        a.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_run(run_dir: str, out: str = "") -> str:  # draws into `out` or RUN/dashboard.png (a bucket too); the path
    bad, png, storage = [], io.BytesIO(), Storage(run_dir)
    dashboard(storage, bad).savefig(png, format="png", dpi=90)
    if bad:
        print(f"skipped {len(bad)} lines that are not JSON records, first {bad[0]}", flush=True)
    where, name = (Storage(os.path.dirname(out) or "."), os.path.basename(out)) if out else (storage, "dashboard.png")
    where.put(name, png.getvalue())
    return where.url(name)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--out", default="", help="a PNG path or URL (default: RUN_DIR/dashboard.png)")
    print(f"wrote {plot_run(**vars(parser.parse_args()))}")
