"""Pause-and-takeover trials: trainer A stops (SIGSTOP) at a random write point of a random step, B takes the run
over, and A wakes after a random number of B's steps plus a random extra pause. Counts what a fence must prevent.

    python bench/fencing_trials.py --trials 30            # writes bench/results/fencing_trials.json
"""
import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / d) for d in ("", "tests")]
from test_fencing import pause_and_take_over  # noqa: E402

POINTS = ["before_publish", "before_latest", "before_metrics", "after_metrics", "after_checkpoint", "mid_gc"]

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args, rng, results = parser.parse_args(), None, []
    rng = random.Random(args.seed)
    for i in range(args.trials):
        trial = {"point": rng.choice(POINTS), "pause_step": rng.randint(3, 9), "wake_after": rng.randint(1, 4),
                 "pause_s": round(rng.uniform(0, 3), 2)}
        t0 = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            try:
                audit = pause_and_take_over(Path(tmp), **trial)
            except AssertionError as e:  # B or the generator failed: a finding too
                audit = {"error": str(e)[-500:]}
        results.append(trial | audit | {"seconds": round(time.time() - t0, 1)})
        print(json.dumps(results[-1]), flush=True)
    total = {k: sum(r.get(k, 0) for r in results) for k in ("trained_twice", "names_with_two_digests", "unaccounted")}
    total |= {"latest_went_back": sum(bool(r.get("latest_went_back")) for r in results),
              "lineage_wrong": sum(not r.get("lineage", False) for r in results),
              "a_not_fenced": sum(not r.get("a_lost_lease", False) for r in results),
              "errors": sum("error" in r for r in results), "trials": len(results)}
    print(json.dumps(total))
    os.makedirs("bench/results", exist_ok=True)
    json.dump({"total": total, "trials": results}, open("bench/results/fencing_trials.json", "w"), indent=1)
