"""A rank table (issue 26): LoRA rank 1, 4, 8 and 32 on the demo, at equal steps and at equal wall-clock.

    nice -n 5 python bench/bench_rank.py --work_dir /tmp/rank-work      # 4 ranks x 3 seeds of the default demo
    python bench/bench_rank.py --ranks 1,32 --seeds 1 --max_steps 10 --eval_every 5 --eval_size 50 --name rank_smoke

bench/results/rank.json and rank.png came from a copy of this checkout's working tree (tracked and untracked files,
taken while it was being edited, so that the runs saw one version of the scripts), with 250 steps (the default):

    mkdir /tmp/rank-snap && git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C /tmp/rank-snap
    nice -n 5 python bench/bench_rank.py --root /tmp/rank-snap --work_dir /tmp/rank-work    # 12 runs, 29 min here

and then the same command again, which ran nothing and rewrote the report from the kept summaries (with the
acc_last3evals column and the notes' time spread added). A run took 37-244 s with start-up on a 2-core machine
whose load average went from 26 down to 2.5 during the bench (median 11.6): see the notes on the wall-clock columns.

"LoRA Without Regret" (Thinking Machines, 2025) finds that for RL even rank 1 matches full fine-tuning, since
RL puts few bits into the weights; its recipe keeps alpha fixed (32 there) so that the learning rate transfers
across ranks: the update is scaled by alpha / r, the "1/r" parametrization. Here alpha stays at minigrpo's
default (16) for every rank, and everything else is the demo's default (lr 3e-3, 32 groups x G=8 per step,
max_staleness 4, ...) but --lora_r R, --seed S for both scripts and --eval_every 25, so that both comparisons
have points along the way. Each run is the real pair of scripts on a fresh run directory, one thread each:

    python train.py    --run_dir RUN --seed S --device cpu --lora_r R --lora_alpha 16 --max_steps N --eval_every 25
    python generate.py --run_dir RUN --seed S --device cpu --lora_r R --lora_alpha 16 --generator_id g

(--generator_id g fixes the generator's name, which seeds its prompt stream with S, so seed S of every rank sees
the same first prompts.) Runs go one at a time, seeds in the outer loop and ranks in turn within a seed, so that
a slow spell of a shared machine does not fall on one rank alone.

Measured, from the trainer's records (RUN/metrics/train-*.jsonl):
  equal steps       held-out pass@1 at the last step (train.py's own evaluation: the first --eval_size held-out
                    problems at T=1, problem i sampled with seed S * 1_000_003 + i), mean ± sd over seeds
  equal wall-clock  the clock of a run starts at its step-0 record (version 0 is published, then the base is
                    evaluated: the generator is already sampling) and reads each record's "time"; T = the shortest
                    total (last record - step 0) among all runs; each run's pass@1 is that of its last evaluation
                    at or before T (so up to eval_every steps old), and "steps by T" its last step done by then.
                    The clock includes the evaluations (about the same work at every rank)
  s/step            total time / steps (evaluations included); the median step without an evaluation is in `extra`
  adapter           bytes of the last version's adapter_model.safetensors and the LoRA parameters in it
  base              the step-0 evaluation (the shipped model; seed S's draws)

--root runs the scripts of another checkout (e.g. a snapshot of this one while it is being edited); the records
are read with this checkout's minigrpo.run. --work_dir keeps logs and each run's summary; a second call with the
same --work_dir skips the runs it already holds.
"""
import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from common import ROOT, report, stop_all


def bench_env() -> dict:
    return os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                         "TOKENIZERS_PARALLELISM": "false"}


class LoadSampler(threading.Thread):
    """The 1-minute load average every `every` seconds while the runs go."""

    def __init__(self, every: float = 15.0):
        super().__init__(daemon=True)
        self.every, self.samples, self.stop = every, [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            with open("/proc/loadavg") as f:
                self.samples.append([round(time.time(), 1), float(f.read().split()[0])])
            self.stop.wait(self.every)


def tail(path, n=30):
    with open(path) as f:
        return "".join(f.readlines()[-n:])


def run_one(rank: int, seed: int, args, out: str) -> dict:
    """train.py + generate.py on a fresh run directory until train.py is done; returns the run's summary."""
    from safetensors import safe_open

    from minigrpo.tools.plot import latest_per_step
    from minigrpo.run import read_records
    from minigrpo.storage import Storage
    run_dir = os.path.join(out, "run")
    shutil.rmtree(run_dir, ignore_errors=True)
    common = ["--run_dir", run_dir, "--seed", str(seed), "--device", "cpu", "--lora_r", str(rank),
              "--lora_alpha", f"{args.lora_alpha:g}"]
    train = [sys.executable, "train.py", *common, "--max_steps", str(args.max_steps),
             "--eval_every", str(args.eval_every), "--eval_size", str(args.eval_size)]
    gen = [sys.executable, "generate.py", *common, "--generator_id", "g"]
    logs = [open(os.path.join(out, name), "w") for name in ("train.log", "generate.log")]
    t_start = time.time()
    procs = [subprocess.Popen(c, cwd=args.root, stdout=log, stderr=subprocess.STDOUT, env=bench_env(),
                              start_new_session=True) for c, log in zip((train, gen), logs)]
    try:
        while procs[0].poll() is None:
            if time.time() - t_start > args.timeout_s:
                raise SystemExit(f"r={rank} seed {seed}: not done after {args.timeout_s:.0f} s; see {out}")
            if procs[1].poll() is not None and (procs[1].returncode or not os.path.exists(os.path.join(run_dir, "DONE"))):
                raise SystemExit(f"r={rank} seed {seed}: generate.py stopped:\n{tail(os.path.join(out, 'generate.log'))}")
            time.sleep(0.5)
        if procs[0].returncode:
            raise SystemExit(f"r={rank} seed {seed}: train.py failed:\n{tail(os.path.join(out, 'train.log'))}")
        procs[1].wait(timeout=60)  # it stops when it sees DONE
    finally:
        stop_all(procs, logs)
    wall = time.time() - t_start

    by_step = latest_per_step(read_records(Storage(run_dir), "train"))
    records = [by_step[s] for s in sorted(by_step)]
    t0, last = records[0]["time"], records[-1]
    if records[0]["step"] != 0 or last["step"] != args.max_steps:
        raise SystemExit(f"r={rank} seed {seed}: records from step {records[0]['step']} to {last['step']}")
    evals = [r for r in records if "eval/accuracy" in r]
    weights = glob.glob(os.path.join(run_dir, "adapters", f"policy-*-v{last['version']:06d}", "adapter_model.safetensors"))
    if len(weights) != 1:
        raise SystemExit(f"r={rank} seed {seed}: the last version's weights: {weights}")
    with safe_open(weights[0], "pt") as f:
        params = sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] for k in f.keys())
    plain = [r["perf/step_s"] for r in records if r["step"] > 0 and "eval/accuracy" not in r]
    summary = {"rank": rank, "seed": seed, "params": params, "adapter_bytes": os.path.getsize(weights[0]),
               "final_version": last["version"], "base": records[0]["eval/accuracy"],
               "final": last["eval/accuracy"], "total_s": last["time"] - t0, "wall_s": wall,
               "median_step_s_no_eval": statistics.median(plain),
               "eval_steps": [r["step"] for r in evals], "eval_acc": [r["eval/accuracy"] for r in evals],
               "eval_t": [r["time"] - t0 for r in evals],
               "step_t": [r["time"] - t0 for r in records],  # index = step
               "reward_mean_last25": statistics.mean(r["reward/mean"] for r in records[1:][-25:]),
               "staleness_mean": statistics.mean(r["sample/staleness_mean"] for r in records[1:])}
    shutil.rmtree(run_dir, ignore_errors=True)
    return summary


def mean_sd(xs, digits=3) -> str:
    xs = list(xs)
    return f"{statistics.mean(xs):.{digits}f} ± {statistics.stdev(xs):.{digits}f}" if len(xs) > 1 else f"{xs[0]:.{digits}f}"


def at_time(run: dict, T: float) -> tuple[float, int, int]:
    """(pass@1 of the last evaluation at or before T, its step, the last step done by T)."""
    i = max(k for k, t in enumerate(run["eval_t"]) if t <= T)
    steps = max(k for k, t in enumerate(run["step_t"]) if t <= T)
    return run["eval_acc"][i], run["eval_steps"][i], steps


def plot(runs, ranks, T, path):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(12, 4.5))
    a, b = fig.subplots(1, 2)
    for rank, colour in zip(ranks, ("tab:red", "tab:orange", "tab:blue", "tab:green", "tab:purple", "tab:brown")):
        mine = [r for r in runs if r["rank"] == rank]
        steps = mine[0]["eval_steps"]
        accs = [[r["eval_acc"][k] for r in mine] for k in range(len(steps))]
        mean = [statistics.mean(x) for x in accs]
        sd = [statistics.stdev(x) if len(x) > 1 else 0.0 for x in accs]
        a.plot(steps, mean, color=colour, label=f"r={rank}")
        a.fill_between(steps, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)], color=colour, alpha=0.15)
        for k, r in enumerate(mine):
            b.plot(r["eval_t"], r["eval_acc"], color=colour, lw=0.9, marker=".", label=f"r={rank}" if k == 0 else None)
    b.axvline(T, color="grey", ls="--", lw=0.8, label=f"T = {T:.0f} s")
    a.set(xlabel="step", ylabel="held-out pass@1", title=f"equal steps (mean ± sd over {len({r['seed'] for r in runs})} seeds)")
    b.set(xlabel="seconds since step 0 (evaluations included)", ylabel="held-out pass@1", title="equal wall-clock (each seed)")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    from minigrpo.run import RunSettings
    from train import TrainConfig
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="1,4,8,32")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    p.add_argument("--lora_alpha", type=float, default=RunSettings().lora_alpha, help="the same for every rank")
    p.add_argument("--max_steps", type=int, default=TrainConfig().max_steps)
    p.add_argument("--eval_every", type=int, default=25)
    p.add_argument("--eval_size", type=int, default=TrainConfig().eval_size)
    p.add_argument("--last_evals", type=int, default=3, help="also: each run's mean over its last N evaluations "
                   "(less sampling noise than one evaluation)")
    p.add_argument("--timeout_s", type=float, default=900.0, help="a run that takes longer fails the bench")
    p.add_argument("--root", default=ROOT, help="the checkout whose scripts run")
    p.add_argument("--work_dir", default="", help="logs and per-run summaries (default: a temp folder, deleted)")
    p.add_argument("--name", default="rank", help="bench/results/<name>.json (and .png)")
    args = p.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    work = args.work_dir or tempfile.mkdtemp(prefix="bench-rank-")
    sampler, load_file = LoadSampler(), os.path.join(work, "loadavg.json")  # samples of earlier calls on work_dir
    previous = json.load(open(load_file)) if os.path.exists(load_file) else []

    runs = []
    for seed in range(args.seeds):
        for rank in ranks:
            out = os.path.join(work, f"r{rank}-s{seed}")
            done = os.path.join(out, "summary.json")
            if os.path.exists(done):
                runs.append(json.load(open(done)))
                print(f"r={rank} seed {seed}: kept from {done}", flush=True)
                continue
            os.makedirs(out, exist_ok=True)
            if not sampler.is_alive():  # sample only while runs run
                sampler.start()
            with open("/proc/loadavg") as f:
                load = f.read().split()[0]
            runs.append(run_one(rank, seed, args, out) | {"load_at_start": float(load)})
            json.dump(runs[-1], open(done, "w"))
            r = runs[-1]
            print(f"r={rank} seed {seed}: pass@1 {r['base']:.3f} -> {r['final']:.3f} | {r['total_s']:.0f} s of training "
                  f"({r['wall_s']:.0f} s with start-up) | adapter {r['adapter_bytes']} B | load {load}", flush=True)
    sampler.stop.set()
    samples = previous + sampler.samples
    json.dump(samples, open(load_file, "w"))

    T = min(r["total_s"] for r in runs)
    for r in runs:
        r["acc_at_T"], r["eval_step_at_T"], r["steps_by_T"] = at_time(r, T)
    rows = []
    for rank in ranks:
        mine = [r for r in runs if r["rank"] == rank]
        rows.append({"rank": rank, "params": mine[0]["params"], "adapter_KB": round(mine[0]["adapter_bytes"] / 1024, 1),
                     "base": mean_sd(r["base"] for r in mine),
                     f"acc@{args.max_steps}steps": mean_sd(r["final"] for r in mine),
                     f"acc@T={T:.0f}s": mean_sd(r["acc_at_T"] for r in mine),
                     "steps_by_T": mean_sd((r["steps_by_T"] for r in mine), 0),
                     f"acc_last{args.last_evals}evals": mean_sd(statistics.mean(r["eval_acc"][-args.last_evals:])
                                                                for r in mine),
                     "s/step": mean_sd((r["total_s"] / args.max_steps for r in mine), 2),
                     "total_s": mean_sd((r["total_s"] for r in mine), 0)})
    loads, totals = [x[1] for x in samples], [r["total_s"] for r in runs]
    within = max(max(t) / min(t) for t in ([r["total_s"] for r in runs if r["rank"] == k] for k in ranks))
    load_text = (f"load average (1 min, /proc/loadavg every {sampler.every:g} s during the runs, {len(loads)} samples): "
                 f"min {min(loads):.2f}, median {statistics.median(loads):.2f}, max {max(loads):.2f} on "
                 f"{os.cpu_count()} cores" if loads else "load average not sampled")
    notes = (f"LoRA rank r at fixed alpha {args.lora_alpha:g} (update scaled by alpha/r), all other settings the demo's "
             f"defaults; {args.max_steps} steps, eval every {args.eval_every} on the first {args.eval_size} held-out "
             f"problems at T=1; seeds 0-{args.seeds - 1}, mean ± sd. Equal wall-clock: T = the shortest training time "
             f"of all {len(runs)} runs ({T:.1f} s from the step-0 record to the last), each run's last evaluation at "
             f"or before T. acc_last{args.last_evals}evals: each run's mean pass@1 over its last {args.last_evals} "
             f"evaluations (steps {args.max_steps - (args.last_evals - 1) * args.eval_every}-{args.max_steps}), "
             f"then mean ± sd over seeds. Wall-clock numbers come from a shared machine: {load_text}. Training times "
             f"ranged {min(totals):.0f}-{max(totals):.0f} s ({max(totals) / min(totals):.1f}x; within one rank up to "
             f"{within:.1f}x): where that spread exceeds the ranks' difference in cost, the equal wall-clock columns "
             f"measure the machine's load, not the rank.")
    settings = {k: getattr(args, k) for k in ("ranks", "seeds", "lora_alpha", "max_steps", "eval_every", "eval_size",
                                              "root")}
    png = os.path.join(ROOT, "bench", "results", f"{args.name}.png")
    os.makedirs(os.path.dirname(png), exist_ok=True)
    plot(runs, ranks, T, png)
    report(args.name, rows, notes, extra={"settings": settings, "T_s": T, "runs_wall_s": sum(r["wall_s"] for r in runs),
                                           "loadavg": samples, "runs": runs})
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
