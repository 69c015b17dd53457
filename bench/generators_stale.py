"""Stale drops with N generators on one trainer: the demo (evaluations off but for the last), 1, 2 and 4 generators.

    python bench/generators_stale.py --steps 150 [--root /path/to/another/checkout]   # bench/results/generators_stale.json
"""
import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / d) for d in ("", "tests")]
from test_fencing import stale_share  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--generators", default="1,2,4")
    parser.add_argument("--root", default=str(Path(__file__).resolve().parent.parent), help="the checkout to run")
    parser.add_argument("--out", default="bench/results/generators_stale.json")
    args, results = parser.parse_args(), []
    for n in map(int, args.generators.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(stale_share(os.path.join(tmp, "run"), n, args.steps, root=args.root, timeout=3000))
        print(json.dumps(results[-1]), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    json.dump(results, open(args.out, "w"), indent=1)
