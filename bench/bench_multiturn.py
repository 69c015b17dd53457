"""Multi-turn environments (--max_turns) learning, per seed, against the single-turn demo in the same run of this
script. Each run is the README's generate.py + train.py pair on a fresh run directory; held-out accuracy (the
conversation's final reward, T=1) at step 0 and every --eval_every steps, with step 1's ratio and mismatch_kl.

    python bench/bench_multiturn.py --arms demo1,demo2                  # the demo, 1 and 2 turns: ~15 min on 2 cores
    python bench/real_model.py build models/smollm2 && python bench/real_model.py task data/sums.jsonl
    python bench/bench_multiturn.py --arms calculator                   # SmolLM2 with a calculator: ~40 min

    python bench/bench_multiturn.py --probe DIR                         # how often a second try is right (DIR: --work_dir)
    python bench/bench_multiturn.py --arms demo1,demo2 --model DIR --name old   # on another demo model (a folder)

Arms: demo1 (the Quick start), demo2 (a wrong answer is asked again: --max_turns 2 --max_new_tokens 16), calculator
(SmolLM2-135M-Instruct on data/sums.jsonl; arithmetic in a turn is answered by a calculator, then a second turn;
--max_turns 2, 20 steps). Writes bench/results/multiturn_<arms>.json: per arm, mean +- sd over the seeds.
--probe samples two-turn demo conversations on the 400 held-out problems (4 each, sampling seeds 0-2) with the base
model and with each demo run's final adapter in DIR: how often the first try is right, and how often the second try
is right after a wrong first one (bench/results/multiturn_probe.json; --model: with that base model).
--model runs the demo arms on another demo model, for example the one shipped up to commit 1eee192, which never saw
a second try in its training rows (results: multiturn_<arms>_<--name>.json).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

from common import generate_and_train, report  # common puts the repository on the path

from minigrpo.storage import Storage  # noqa: E402

SMOL = ["--model", "models/smollm2", "--task", "calculator", "--task_data", "data/sums.jsonl", "--answer_format",
        "last_number", "--max_new_tokens", "48", "--max_turns", "2"]
ARMS = {  # (flags both take, generate.py's, train.py's)
    "demo1": ([], [], []),
    "demo2": (["--max_turns", "2", "--max_new_tokens", "16"], [], []),
    "calculator": (SMOL, ["--prompts_per_batch", "4"], ["--lr", "1e-3", "--groups_per_step", "4", "--max_steps", "20",
                                                        "--eval_every", "10", "--save_every", "10"]),
}


def one_run(arm: str, seed: int, work: str, model: str = "") -> dict:
    run_dir, (both, gen_flags, train_flags) = os.path.join(work, f"{arm}-s{seed}"), ARMS[arm]
    both = both + ["--model", model] if model and arm.startswith("demo") else both
    common = ["--run_dir", run_dir, "--seed", str(seed), *both]
    env, t0, load = os.environ | {"PYTHONUNBUFFERED": "1"}, time.time(), os.getloadavg()[0]
    steps, evals = generate_and_train(run_dir, [sys.executable, "generate.py", *common, *gen_flags],
                                      [sys.executable, "train.py", *common, *train_flags], env)
    first = steps[0]
    return {"arm": arm, "seed": seed, "evals": evals, "ratio1": first["ratio/mean"], "ratio1_min": first["ratio/min"],
            "ratio1_max": first["ratio/max"], "kl1": first["health/mismatch_kl"],
            "kl_mean": statistics.mean(r["health/mismatch_kl"] for r in steps),
            "length_mean": statistics.mean(r["completions/mean_length"] for r in steps),
            "wall_s": time.time() - t0, "load": [load, os.getloadavg()[0]]}


def probe(work: str, base: str = "demo", suffix: str = "") -> None:
    from minigrpo.engine import SamplingParams, TorchEngine
    from minigrpo.lora import inject_lora
    from minigrpo.model import load_model, stop_token_ids
    from minigrpo.run import RunSettings
    from minigrpo.tasks import make_task, prompt_ids, rollout
    run = RunSettings(max_turns=2, max_new_tokens=16)
    model, tok = load_model(base, "cpu")
    inject_lora(model, run.lora_r, run.lora_alpha, run.lora_targets)  # B = 0: the base model until an adapter loads
    task, rows = make_task(run), []
    problems = task.eval_problems(400)
    prompts = [prompt_ids(tok, task.reset(p)) for p in problems]
    dirs = sorted(d for d in os.listdir(work) if d.startswith("demo") and os.path.isdir(os.path.join(work, d)))
    for name in ["base"] + dirs:
        engine = TorchEngine(model, stop_token_ids(model, tok), tok.pad_token_id)
        if name != "base":
            adapters = Storage(os.path.join(work, name, "adapters"))
            engine.load_adapter(0, os.path.join(work, name, "adapters", max(adapters.list("", "policy-"))))
        first, second = [], []
        for seed in range(3):
            engine.rng.manual_seed(seed)
            out, rewards = rollout(engine, tok, task, problems, prompts, SamplingParams(n=4, max_tokens=16), run)
            for p, group, rs in zip(problems, out, rewards):
                for c, r in zip(group, rs):
                    turn1 = c.mask.index(0) if 0 in c.mask else len(c.mask)
                    right = task.reward(tok.decode(c.token_ids[:turn1], skip_special_tokens=True), p.answer)
                    first.append(right)
                    if not right and turn1 < len(c.mask):  # a wrong first try that was asked again
                        second.append(r)
        rows.append({"policy": name, "first try right": round(statistics.mean(first), 4), "second tries": len(second),
                     "second try right": round(statistics.mean(second), 4) if second else None})
        print(rows[-1], flush=True)
    flags = f"--probe {work}" + ("" if base == "demo" else f" --model {base}") + (f" --name {suffix}" if suffix else "")
    report("multiturn_probe" + (f"_{suffix}" if suffix else ""), rows, f"python bench/bench_multiturn.py {flags}: "
           "400 held-out problems x 4 samples x sampling seeds 0-2, T=1, --max_turns 2 --max_new_tokens 16")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="demo1,demo2", help="comma-separated: " + ", ".join(ARMS))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--work_dir", default="", help="keep the run directories and logs here (default: a temp folder)")
    p.add_argument("--probe", default="", metavar="DIR", help="no runs: probe the second try of DIR's demo runs")
    p.add_argument("--model", default="", help="the demo arms' (and --probe's) base model, a folder")
    p.add_argument("--name", default="", help="a suffix for the results file")
    args = p.parse_args()
    if args.probe:
        return probe(args.probe, args.model or "demo", args.name)
    work = args.work_dir or tempfile.mkdtemp(prefix="bench-multiturn-")
    os.makedirs(work, exist_ok=True)
    arms, runs = args.arms.split(","), []
    for seed in range(args.seeds):
        for arm in arms:  # in turns: every arm sees the same stretch of load
            runs.append(one_run(arm, seed, work, args.model))
            print(runs[-1], flush=True)
    ms = lambda xs: f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) if len(xs) > 1 else 0:.3f}"  # noqa: E731
    rows = []
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        rows.append({"arm": arm, **{f"eval@{s}": ms([r["evals"][s] for r in mine]) for s in sorted(mine[0]["evals"])},
                     "step1 ratio": ms([r["ratio1"] for r in mine]),
                     "step1 ratio min-max": f"{min(r['ratio1_min'] for r in mine):.5f}-{max(r['ratio1_max'] for r in mine):.5f}",
                     "step1 mismatch_kl": f"{max(r['kl1'] for r in mine):.2g} (max)", "length": ms([r["length_mean"] for r in mine]),
                     "wall s": ms([r["wall_s"] for r in mine])})
    name, model = f"multiturn_{'_'.join(arms)}" + (f"_{args.name}" if args.name else ""), args.model
    report(name, rows, f"{args.seeds} seeds, arms in turns{', base model ' + model if model else ''}; load at start/end "
           "of each run in 'runs'", {"runs": runs})


if __name__ == "__main__":
    main()
