"""The honest gap the trainer's policy audit must tolerate: groups sampled by the torch engine with a version's weights,
scored by train.py's audit() under the same weights, for each pair of generator and trainer dtypes. The audit's gap
is a group's mean |log pi - log mu| per completion token; --policy_check_tol (0.01) is scaled x1 for float32 on both
sides, x10 for bf16 on both, x30 for mixed (train.py's policy_tol). This prints what an honest sampler gives, so the
margin under each tolerance is a measured number.

    python bench/bench_honest_gap.py                  # the demo model, 3 seeds x 32 groups of 8, about a minute
"""
import argparse
import statistics

import torch

from bench_audit import batch
from common import report
from minigrpo.lora import inject_lora, load_lora_state_dict, lora_state_dict
from minigrpo.model import load_model
from minigrpo.run import RunSettings
from minigrpo.tasks import make_task
from train import TrainConfig, audit, policy_tol

PAIRS = [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32")]  # (generator, trainer)


def gaps(gen_dtype: str, train_dtype: str, seed: int, groups: int, max_new_tokens: int, model_name: str) -> list:
    """Every group's audit gap: sampled in gen_dtype with a random non-zero LoRA, scored in train_dtype under it."""
    run = RunSettings(model=model_name, max_new_tokens=max_new_tokens, generator_dtype=gen_dtype)
    cfg, task, device = TrainConfig(device="cpu", dtype=train_dtype), make_task(run), torch.device("cpu")
    torch.manual_seed(seed)
    models = {}
    for dtype in {gen_dtype, train_dtype}:
        models[dtype], tokenizer = load_model(run.model, device, dtype)
        inject_lora(models[dtype], run.lora_r, run.lora_alpha, run.lora_targets)
    weights = {k: v + 0.05 * torch.randn_like(v) for k, v in lora_state_dict(models[train_dtype]).items()}
    for model in models.values():
        load_lora_state_dict(model, weights)
    sampled = batch(models[gen_dtype], tokenizer, task, run, groups, seed, {0: weights, 1: weights})
    cfg.policy_check_tol = 1e-300 / (policy_tol(cfg, run) / cfg.policy_check_tol)  # every gap above 0 is returned
    found = [gap for _, gap, _ in audit(models[train_dtype], sampled, lambda v: weights, run, cfg, device)]
    return found + [0.0] * (len(sampled) - len(found))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--max_new_tokens", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for gen_dtype, train_dtype in PAIRS:
        per_seed = [gaps(gen_dtype, train_dtype, s, args.groups, args.max_new_tokens, args.model) for s in range(args.seeds)]
        means, maxes = [statistics.mean(g) for g in per_seed], [max(g) for g in per_seed]
        tol = policy_tol(TrainConfig(dtype=train_dtype), RunSettings(generator_dtype=gen_dtype))
        rows.append({"generator": gen_dtype, "trainer": train_dtype, "groups": sum(map(len, per_seed)),
                     "mean_gap": f"{statistics.mean(means):.2g} ± {statistics.stdev(means):.1g}",
                     "max_gap": f"{max(maxes):.2g} (per seed {min(maxes):.2g}-{max(maxes):.2g})", "tolerance": tol,
                     "margin": f"{tol / max(max(maxes), 1e-12):.3g}x"})
    report("honest_gap", rows, notes=f"audit gap per group (mean |log pi - log mu| a token) of honest groups, {args.seeds} "
           f"seeds x {args.groups} groups of 8, {args.model} model, torch engine, CPU, 1 thread; margin = tolerance / "
           f"largest gap. Command: python bench/bench_honest_gap.py --model {args.model} --groups {args.groups}")
