"""What the trainer's policy audit costs: train.py's audit() (every fresh group scored, without gradient, under the
weights of the version it names) against the train_step() it guards, on the same batch. The batch is the demo's:
32 groups x G=8 of reverse_add sampled by the torch engine, half named version v, half v - 1 (two versions' weights
to load, as a generator a step ahead gives).

    python bench/bench_audit.py                         # the demo model, 3 seeds x 5 steps, about a minute
    python bench/bench_audit.py --model models/smollm2 --groups 8 --task_data data/sums.jsonl   # a real model
"""
import argparse
import random
import statistics
import time

import torch

from common import report, score
from minigrpo.engine import SamplingParams, TorchEngine
from minigrpo.lora import inject_lora, load_lora_state_dict, lora_state_dict
from minigrpo.model import load_model, stop_token_ids
from minigrpo.rollouts import Group
from minigrpo.run import RunSettings
from minigrpo.tasks import make_task, prompt_ids
from train import TrainConfig, audit, build_samples, train_step


def batch(model, tokenizer, task, run, groups: int, seed: int, weights: dict) -> list[Group]:
    """groups Groups sampled with the engine, alternately under weights[1] (version 1) and weights[0] (version 0)."""
    rng, engine = random.Random(seed), TorchEngine(model, stop_token_ids(model, tokenizer), tokenizer.pad_token_id, seed)
    out = []
    for v in (0, 1):
        load_lora_state_dict(model, weights[v])
        problems = [task.sample(rng) for _ in range(groups // 2)]
        prompts = [prompt_ids(tokenizer, p.prompt, run.system_prompt) for p in problems]
        completions = engine.generate(prompts, SamplingParams(n=run.group_size, max_tokens=run.max_new_tokens,
                                                              temperature=run.temperature))
        for prompt, group, r in zip(prompts, completions, score(task, tokenizer, problems, completions)):
            out.append(Group(prompt, [c.token_ids for c in group], [c.logprobs for c in group], r,
                             [c.finish_reason == "length" for c in group], v, run.temperature))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument("--task_data", default="", help="a math task file (with --model DIR)")
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--max_new_tokens", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as train.py runs on a CPU (--threads 1)
    math = {"task": "math", "task_data": args.task_data, "answer_format": "last_number"} if args.task_data else {}
    run, cfg = RunSettings(model=args.model, max_new_tokens=args.max_new_tokens, **math), TrainConfig(device="cpu")
    task, device = make_task(run), torch.device("cpu")
    times = {"audit_ms": [], "train_step_ms": [], "ratio": []}
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        model, tokenizer = load_model(run.model, device)
        inject_lora(model, run.lora_r, run.lora_alpha, run.lora_targets)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
        v0 = {k: v.clone() for k, v in lora_state_dict(model).items()}
        v1 = {k: v + 0.01 * torch.randn_like(v) for k, v in v0.items()}  # another version's weights
        groups = batch(model, tokenizer, task, run, args.groups, seed, {0: v0, 1: v1})
        samples = build_samples(groups, run, cfg)[0]
        for _ in range(args.steps):
            load_lora_state_dict(model, v1)
            t0 = time.perf_counter()
            caught = audit(model, groups, {0: v0, 1: v1}.get, run, cfg, device)
            t1 = time.perf_counter()
            train_step(model, opt, samples, run, cfg, device)
            t2 = time.perf_counter()
            assert caught == [], "honest groups were caught"
            times["audit_ms"].append((t1 - t0) * 1e3)
            times["train_step_ms"].append((t2 - t1) * 1e3)
            times["ratio"].append((t1 - t0) / (t2 - t1))
    row = {"model": args.model, "groups": args.groups, "G": run.group_size, "runs": len(times["ratio"])}
    row |= {k: f"{statistics.mean(v):.3g} ± {statistics.stdev(v):.2g}" for k, v in times.items()}
    report(f"audit_{'demo' if args.model == 'demo' else 'real'}", [row],
           notes=f"mean ± sd over {args.seeds} seeds x {args.steps} steps, 1 thread; ratio = audit / train_step on the "
                 f"same batch. Command: python bench/bench_audit.py --model {args.model} --groups {args.groups}",
           extra={"times": times})
