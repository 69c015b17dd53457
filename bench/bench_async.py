"""Asynchrony against the loop a user would write: one process that samples a batch, trains on it, and repeats,
with every core (same train_step, sampler, batch and seeds; no files). The two-process lock-step pipeline
(generate.py --lockstep with train.py, one core each) is the second baseline.

Asynchrony pays only where generation is a large share of the work, so the bench sweeps that share with longer
completions: a higher sampling temperature makes the demo model stop later, and max_new_tokens caps the length.
The share is measured in the one-process loop (sampling seconds / (sampling + training seconds)).

All arms run train.py's defaults, so the one-process loop also does what the dapo loss needs: it drops a group whose
rewards are all equal and samples another whole batch until it has a step's groups, keeping the rest for the next
step, as generate.py and train.py do together. It does not audit groups:
in one process the sampler's weights are known. The pair audits every group under the weights of the version it
names (train.py's --policy_check_tol); the arm "async, no audit" turns that off, to show what it costs.

    python bench/bench_async.py            # ~8 minutes on a 2-core CPU
"""
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from common import ROOT, report, score
from minigrpo.engine import SamplingParams, TorchEngine
from minigrpo.lora import inject_lora
from minigrpo.model import load_model, stop_token_ids
from minigrpo.rollouts import Group
from minigrpo.run import RunSettings, read_records
from minigrpo.storage import Storage
from minigrpo.tasks import make_task, prompt_ids
from train import TrainConfig, build_samples, train_step

STEPS, PROMPTS, REPEATS = 20, 16, 3
POINTS = [dict(temperature=1.0, max_new_tokens=8), dict(temperature=2.0, max_new_tokens=32),
          dict(temperature=3.0, max_new_tokens=96)]


def two_process(mode: str, point: dict, train_flags=()) -> float:
    """Seconds of the trainer's first STEPS - 1 steps, as train.py logs them (the last step also evaluates)."""
    run_dir = tempfile.mkdtemp(prefix=f"bench-{mode}-")
    flags = [f"--{k}={v}" for k, v in point.items()]
    gen = subprocess.Popen([sys.executable, "generate.py", "--run_dir", run_dir, "--generator_id", "g", "--seed", "0",
                            "--prompts_per_batch", str(PROMPTS), *flags, *(["--lockstep"] if mode == "lockstep" else [])],
                           cwd=ROOT, stdout=subprocess.DEVNULL)
    subprocess.run([sys.executable, "train.py", "--run_dir", run_dir, "--max_steps", str(STEPS), "--eval_every",
                    str(STEPS), "--groups_per_step", str(PROMPTS), "--seed", "0", *flags, *train_flags], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    gen.wait()
    train = read_records(Storage(run_dir), "train")
    shutil.rmtree(run_dir)
    return train[-2]["time"] - train[0]["time"]


def one_process(point: dict) -> dict:
    """The loop without minigrpo's processes: sample, score, train, repeat, on all cores."""
    run, cfg = RunSettings(**point), TrainConfig(seed=0, groups_per_step=PROMPTS, threads=os.cpu_count())
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(run.model, torch.device("cpu"), cfg.dtype)
    inject_lora(model, run.lora_r, run.lora_alpha, run.lora_targets)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = random.Random("0-g")
    engine = TorchEngine(model, stop_token_ids(model, tokenizer), tokenizer.pad_token_id, rng.getrandbits(63))
    sampling = SamplingParams(n=run.group_size, max_tokens=run.max_new_tokens, temperature=run.temperature)
    task, gen_s, train_s, t0 = make_task(run), 0.0, 0.0, time.time()
    waiting = []  # groups sampled but not trained yet, as generate.py leaves them in the run directory
    for _ in range(STEPS - 1):
        while len(waiting) < PROMPTS:  # whole batches, as generate.py samples them; dapo: keep groups with a signal
            t1 = time.time()
            problems = [task.sample(rng) for _ in range(PROMPTS)]
            prompts = [prompt_ids(tokenizer, p.prompt, run.system_prompt) for p in problems]
            completions = engine.generate(prompts, sampling)
            waiting += [Group(prompt, [c.token_ids for c in g], [c.logprobs for c in g], r, [c.finish_reason == "length" for c in g],
                              0, run.temperature) for prompt, g, r in zip(prompts, completions, score(task, tokenizer, problems, completions))
                        if cfg.loss_type != "dapo" or len(set(r)) > 1]
            gen_s += time.time() - t1
        t2, groups, waiting = time.time(), waiting[:PROMPTS], waiting[PROMPTS:]
        samples, _, _ = build_samples(groups, run, cfg)
        train_step(model, optimizer, samples, run, cfg, torch.device("cpu"))
        train_s += time.time() - t2
    return {"time_s": time.time() - t0, "gen_share": gen_s / (gen_s + train_s)}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one_process":  # a fresh process, like the others
        print(json.dumps(one_process(json.loads(sys.argv[2]))))
        sys.exit()
    rows = []
    for point in POINTS:
        t = {"async": [], "async, no audit": [], "lockstep, 2 processes": [], "lockstep, 1 process": []}
        share = []
        for _ in range(REPEATS):  # interleaved, so background load hits every arm alike
            t["async"].append(two_process("async", point))
            t["async, no audit"].append(two_process("async", point, ["--policy_check_tol", "0"]))
            t["lockstep, 2 processes"].append(two_process("lockstep", point))
            out = subprocess.run([sys.executable, __file__, "--one_process", json.dumps(point)], capture_output=True,
                                 text=True, check=True)
            one = json.loads(out.stdout.strip().splitlines()[-1])
            t["lockstep, 1 process"].append(one["time_s"])
            share.append(one["gen_share"])
            print(point, {k: round(v[-1], 1) for k, v in t.items()}, f"generation share {share[-1]:.2f}", flush=True)
        for arm, base in [("async", "lockstep, 1 process"), ("async, no audit", "lockstep, 1 process"),
                          ("async", "lockstep, 2 processes")]:
            ratio = [a / b for a, b in zip(t[arm], t[base])]
            rows.append({**point, "gen_share": statistics.mean(share), "arm": arm, "baseline": base,
                         "async_s": statistics.mean(t[arm]), "baseline_s": statistics.mean(t[base]),
                         "async/baseline": statistics.mean(ratio), "sd": statistics.stdev(ratio),
                         "min": min(ratio), "max": max(ratio)})
    report("async_vs_lockstep", rows, f"{STEPS} steps of {PROMPTS} groups, {REPEATS} interleaved repeats; target <= 0.6 "
                                      f"against the one-process loop where generation is >= 40% of the work")
