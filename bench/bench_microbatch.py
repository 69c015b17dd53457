"""The trainer's micro-batching: tokens per second of train_step with token-budget micro-batches (longest first,
packed under --micro_batch_tokens) against one sequence per micro-batch, on completions of varied lengths.

    python bench/bench_microbatch.py       # ~1 minute on a 2-core CPU
"""
import random

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from common import report, timed_together
from minigrpo.lora import inject_lora
from minigrpo.run import RunSettings
from train import TrainConfig, micro_batches, train_step

torch.set_num_threads(2)


def sequences(n=64, prompt=64, max_new=512, seed=0):
    """Completion lengths from a long-tailed distribution, as reasoning rollouts have."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        T = min(max_new, max(8, int(rng.lognormvariate(4.5, 0.8))))
        out.append({"ids": [rng.randrange(1, 1000) for _ in range(prompt + T)], "P": prompt,
                    "behav": [-1.0] * T, "adv": rng.choice([-1.0, 1.0])})
    return out


if __name__ == "__main__":
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=1000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024))
    for p in model.parameters():
        p.requires_grad = False
    inject_lora(model, 8, 16)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    rows, notes = [], []
    for case, seqs in [("reasoning-like: 64 x (64 + 19..512)", sequences()),
                       ("demo-like: 128 x (6 + 1..8)", sequences(n=128, prompt=6, max_new=8))]:
        run, tokens = RunSettings(max_new_tokens=512), sum(len(s["ids"]) for s in seqs)
        budgets = {"budget 8192": 8192, "one per micro-batch": 1}
        fns = {name: (lambda b=b: train_step(model, opt, seqs, run, TrainConfig(micro_batch_tokens=b), 0, torch.device("cpu")))
               for name, b in budgets.items()}
        t = timed_together(fns, iters=3)
        for name, b in budgets.items():
            mbs = micro_batches(seqs, b)
            padded = sum(len(mb) * len(mb[0]["ids"]) for mb in mbs)
            rows.append({"sequences": case, "micro-batching": name, "micro_batches": len(mbs),
                         "padding_frac": 1 - tokens / padded, "step_s": t[name], "tokens_per_s": tokens / t[name]})
        notes.append(f"{case}: {rows[-2]['tokens_per_s'] / rows[-1]['tokens_per_s']:.2f}x (target >= 3x)")
    report("micro_batching", rows, "budget 8192 against one sequence per micro-batch: " + "; ".join(notes))
