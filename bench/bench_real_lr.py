"""The real-model recipe's learning rate: SmolLM2-135M-Instruct (README, "A real model on a CPU") trained with the
recipe's 1e-3 and with the demo's 3e-3, per step rather than per second (a step costs the same at either rate), seeds
in turns so that both rates see the same load. Each run is the README's generate.py + train.py pair on a fresh run
directory, stopped after --steps steps; held-out pass@1 (the task's 56 held-out problems, T=1) at step 0 and every
--eval_every steps, and the off-policy health the trainer logs.

    python bench/real_model.py build models/smollm2 && python bench/real_model.py task data/sums.jsonl
    python bench/bench_real_lr.py --model models/smollm2 --task_data data/sums.jsonl     # ~40 minutes on 2 cores

It writes bench/results/real_lr.json: per rate, mean +- sd over the seeds of the accuracy at each evaluation, of the
mean and largest health/mismatch_kl, of the clipped fractions, and of the step time.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

from common import generate_and_train, report
from compare_trl import REAL  # the recipe's settings


def one_run(model, data, lr, seed, steps, eval_every, work) -> dict:
    run_dir = os.path.join(work, f"lr{lr}-s{seed}")
    flags = lambda d: [x for k, v in d.items() for x in (f"--{k}", str(v))]  # noqa: E731
    common = ["--run_dir", run_dir, "--model", model, "--task_data", data, "--seed", str(seed), *flags(REAL["run"])]
    train = [sys.executable, "train.py", *common, *flags(REAL["train"] | {"lr": lr}), "--max_steps", str(steps),
             "--eval_every", str(eval_every), "--save_every", str(steps)]
    gen = [sys.executable, "generate.py", *common, *flags(REAL["gen"]), "--generator_id", "g"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    steps_, evals = generate_and_train(run_dir, gen, train, env)
    kl = [r["health/mismatch_kl"] for r in steps_]
    return {"lr": lr, "seed": seed, "evals": evals, "kl_mean": statistics.mean(kl), "kl_max": max(kl),
            "clip_low": statistics.mean(r["clip_ratio/low"] for r in steps_),
            "clip_high": statistics.mean(r["clip_ratio/high"] for r in steps_),
            "ratio_min": min(r["ratio/min"] for r in steps_), "ratio_max": max(r["ratio/max"] for r in steps_),
            "step_s": statistics.mean(r["perf/step_s"] - r.get("perf/eval_s", 0.0) for r in steps_),
            "policy_mismatch": sum(r["sample/policy_mismatch"] for r in steps_), "wall_s": time.time() - t0,
            "load": os.getloadavg()[0]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2")
    p.add_argument("--task_data", default="data/sums.jsonl")
    p.add_argument("--lrs", default="1e-3,3e-3", help="comma-separated learning rates")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--eval_every", type=int, default=5)
    p.add_argument("--work_dir", default="", help="keep the run directories and logs here (default: a temp folder)")
    args = p.parse_args()
    work = args.work_dir or tempfile.mkdtemp(prefix="bench-real-lr-")
    os.makedirs(work, exist_ok=True)
    lrs, runs = [float(x) for x in args.lrs.split(",")], []
    for seed in range(args.seeds):
        for lr in lrs:  # in turns: both rates see the same stretch of load
            runs.append(one_run(args.model, args.task_data, lr, seed, args.steps, args.eval_every, work))
            print({k: v for k, v in runs[-1].items()}, flush=True)
    ms = lambda xs: f"{statistics.mean(xs):.3g} ± {statistics.stdev(xs) if len(xs) > 1 else 0:.2g}"  # noqa: E731
    rows = []
    for lr in lrs:
        mine = [r for r in runs if r["lr"] == lr]
        row = {"lr": lr, "seeds": len(mine)}
        row |= {f"pass@1 step {s}": ms([r["evals"][s] for r in mine]) for s in sorted(mine[0]["evals"])}
        row |= {k: ms([r[k] for r in mine]) for k in ("kl_mean", "kl_max", "clip_low", "clip_high", "step_s")}
        row |= {"ratio range": f"{min(r['ratio_min'] for r in mine):.3g}-{max(r['ratio_max'] for r in mine):.3g}",
                "policy_mismatch": sum(r["policy_mismatch"] for r in mine)}
        rows.append(row)
    report("real_lr", rows, extra={"runs": runs, "work_dir": work},
           notes=f"mean ± sd over seeds 0-{args.seeds - 1}; pass@1 on the 56 held-out problems once each (T=1); "
                 f"kl: health/mismatch_kl per step; clip: clipped token fractions; step_s without evaluation. "
                 f"Command: python bench/bench_real_lr.py --model {args.model} --task_data {args.task_data} "
                 f"--steps {args.steps} --eval_every {args.eval_every}")


if __name__ == "__main__":
    main()
