"""A picture of a run: the dashboard to read when a run learns slowly or one side waits on the other.

    python -m minigrpo.plot runs/demo                  # writes ./dashboard.png (RUN may be a URL too)

Panels: reward and eval accuracy; the policy ratio and clip fractions; staleness, what was dropped and the
health of the importance weights (effective sample size, trainer-sampler KL); where each
step's time went (forward+backward, waiting for rollouts, weight sync); the rollout queue against the generators'
backpressure (a full queue with backpressure: the trainer is the bottleneck; an empty one with rollout wait: the
generators are); entropy and completion length.
"""
import argparse

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from minigrpo.run import latest_per_step, read_records  # noqa: E402
from minigrpo.storage import Storage  # noqa: E402


def plot_run(run_dir: str, out: str) -> str:
    storage = Storage(run_dir)
    by_step = latest_per_step(read_records(storage, "train"))  # a step redone after a resume: the last record
    train = [by_step[s] for s in sorted(by_step)]
    steps = [r for r in train if r["step"] > 0]
    x = [r["step"] for r in steps]
    col = lambda key: [r.get(key, float("nan")) for r in steps]
    fig, ax = plt.subplots(2, 3, figsize=(16, 8.5))
    fig.suptitle(f"minigrpo run {run_dir}")
    (reward, ratio, stale), (timing, queue, entropy) = ax

    reward.plot(x, col("reward/mean"), lw=0.8, alpha=0.6, label="reward/mean (train batch)")
    evals = [r for r in train if "eval/accuracy" in r]
    reward.plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], "o-", c="C3", label="eval/accuracy")
    reward.set_title("reward and held-out accuracy")

    ratio.plot(x, col("ratio/mean"), label="ratio/mean")
    ratio.fill_between(x, col("ratio/min"), col("ratio/max"), alpha=0.2, label="ratio min..max")
    ratio.set_yscale("log")  # a ratio is multiplicative: 2x and 0.5x sit at the same distance from 1
    b = ratio.twinx()
    b.plot(x, col("clip_ratio/low"), color="C2", lw=0.8, label="clip_ratio/low")
    b.plot(x, col("clip_ratio/high"), color="C3", lw=0.8, label="clip_ratio/high")
    b.legend(loc="upper right", fontsize=8)
    ratio.set_title("policy ratio pi/mu and clipped fractions")

    stale.plot(x, col("sample/staleness_mean"), label="staleness mean")
    stale.plot(x, col("sample/staleness_max"), label="staleness max")
    stale.plot(x, col("sample/dropped_stale_total"), label="dropped stale (total)")
    b = stale.twinx()
    b.plot(x, col("health/ess_frac"), color="C4", lw=0.8, label="health/ess_frac (1 = on-policy)")
    b.plot(x, col("health/mismatch_kl"), color="C5", lw=0.8, label="health/mismatch_kl")
    b.legend(loc="upper right", fontsize=8)
    stale.set_title("staleness (versions behind) and off-policy health")

    parts = {"perf/fwd_bwd_s": "forward+backward", "perf/rollout_wait_s": "rollout wait",
             "perf/weight_sync_s": "weight sync"}
    timing.stackplot(x, *map(col, parts), labels=parts.values(), alpha=0.8)
    timing.plot(x, col("perf/step_s"), color="k", lw=0.5, label="step total")
    timing.set_title("where a step's time goes (s)")

    queue.plot(x, col("sample/rollout_queue_size"), label="groups waiting for the trainer")
    gens = read_records(storage, "generate-")
    t0 = steps[0]["time"] if steps else 0
    b = queue.twinx()
    for name in sorted({r.get("generator", "") for r in gens}):  # cumulative backpressure against wall time
        g = [r for r in gens if r.get("generator", "") == name and r["time"] >= t0]
        at = np.interp([r["time"] for r in g], [r["time"] for r in steps], x)  # wall time -> step axis
        cum = np.cumsum([r["rollout/backpressure_s"] for r in g])
        b.plot(at, cum, color="C3", lw=0.8, label=f"backpressure s (cum.) {name}")
    b.legend(loc="lower right", fontsize=8)
    queue.set_title("rollout queue against generator backpressure")

    entropy.plot(x, col("entropy"), label="entropy (nats/token)")
    b = entropy.twinx()
    b.plot(x, col("completions/mean_length"), color="C1", lw=0.8, label="completion length")
    b.legend(loc="upper right", fontsize=8)
    entropy.set_title("entropy and completion length")

    for a in ax.flat:
        a.set_xlabel("step")
        a.legend(loc="upper left", fontsize=8)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--out", default="dashboard.png", help="PNG path")
    args = parser.parse_args()
    print(plot_run(args.run_dir, args.out))


if __name__ == "__main__":
    main()
