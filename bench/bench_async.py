"""Asynchrony pays: the same demo run (same steps, seeds and batch) with generation and training overlapping, and
in lock step (generate a batch, train on it, publish, repeat).

    python bench/bench_async.py            # ~4 minutes on a 2-core CPU
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from common import ROOT, report

STEPS = 150


def run(mode: str) -> dict:
    run_dir = tempfile.mkdtemp(prefix=f"bench-{mode}-")
    flags = ["--lockstep"] if mode == "lockstep" else []
    t0 = time.time()
    gen = subprocess.Popen([sys.executable, "generate.py", "--run_dir", run_dir, "--generator_id", "g", "--seed", "0",
                            "--prompts_per_batch", "16", *flags], cwd=ROOT, stdout=subprocess.DEVNULL)
    subprocess.run([sys.executable, "train.py", "--run_dir", run_dir, "--max_steps", str(STEPS), "--eval_every",
                    str(STEPS), "--seed", "0"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    gen.wait()
    wall = time.time() - t0
    train = [json.loads(l) for l in open(os.path.join(run_dir, "metrics", "train.jsonl"))]
    gen_log = [json.loads(l) for l in open(os.path.join(run_dir, "metrics", "generate-g.jsonl"))]
    shutil.rmtree(run_dir)
    steps = [r for r in train if r["step"] > 0]
    return {"mode": mode, "wall_s": wall, "train_s": steps[-1]["time"] - train[0]["time"],
            "rollout_wait_s": sum(r["perf/rollout_wait_s"] for r in steps),
            "backpressure_s": sum(r["rollout/backpressure_s"] for r in gen_log),
            "staleness_mean": sum(r["sample/staleness_mean"] for r in steps) / len(steps),
            "eval_start": train[0]["eval/accuracy"], "eval_end": steps[-1]["eval/accuracy"]}


if __name__ == "__main__":
    rows = [run("async"), run("lockstep")]
    ratio = rows[0]["train_s"] / rows[1]["train_s"]
    report("async_vs_lockstep", rows, f"async/lockstep time for {STEPS} steps (from the first step): {ratio:.2f} (target <= 0.6)")
