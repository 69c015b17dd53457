"""The trainer's packed micro-batches (no padding, each prompt once with its G completions attending to it) against
what a TRL user runs: a fixed count of sequences per micro-batch (8 or 16), in arrival order, right-padded to the
longest. Both take one whole optimizer step with the same loss and the same chunked log-probs; only the batching
differs. Reasoning-like lengths (long, varied completions) and demo-like short ones, on a random Qwen2-shaped model.

    python bench/bench_microbatch.py       # ~5 minutes on a 2-core CPU
"""
import random
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from common import report
from minigrpo.grpo import Batch, grpo_loss
from minigrpo.lora import inject_lora
from minigrpo.model import PACKED_SDPA
from tests.conftest import sequence_logprobs
from minigrpo.run import RunSettings
from minigrpo.packing import Sample, micro_batches
from train import TrainConfig, train_step

torch.set_num_threads(2)
REPEATS = 3


def sequences(prompts, G, prompt_len, mu, sigma, max_new, seed=0):
    """G completions per prompt with long-tailed lengths (lognormal), as reasoning rollouts have; groups in order."""
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        prompt = [rng.randrange(1, 1000) for _ in range(prompt_len)]
        for _ in range(G):
            T = min(max_new, max(1, int(rng.lognormvariate(mu, sigma))))
            out.append(Sample(prompt + [rng.randrange(1, 1000) for _ in range(T)], prompt_len, [-1.0] * T,
                              rng.choice([-1.0, 1.0])))
    return out


def padded_step(model, opt, seqs, run, cfg, k):
    """What a TRL user runs: k sequences per micro-batch in arrival order, right-padded to the longest."""
    num_seqs, num_tokens = len(seqs), sum(len(s.behav) for s in seqs)
    for i in range(0, len(seqs), k):
        mb = seqs[i:i + k]
        B, L = len(mb), max(len(s.ids) for s in mb)
        ids, attn = torch.zeros(B, L, dtype=torch.long), torch.zeros(B, L, dtype=torch.long)
        mask, behav = torch.zeros(B, L - 1), torch.zeros(B, L - 1)
        for j, s in enumerate(mb):
            n, P = len(s.ids), s.prompt_len
            ids[j, :n], attn[j, :n], mask[j, P - 1:n - 1], behav[j, P - 1:n - 1] = torch.tensor(s.ids), 1, 1, torch.tensor(s.behav)
        logp, _ = sequence_logprobs(model, ids, attn, run.temperature)
        batch = Batch(behav, torch.tensor([s.adv for s in mb]), mask, num_seqs=num_seqs, num_tokens=num_tokens)
        loss, _ = grpo_loss(logp, batch, cfg, run.max_new_tokens)
        loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=1000, hidden_size=256, intermediate_size=1408, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                         attn_implementation=PACKED_SDPA))  # as load_model sets it
    for p in model.parameters():
        p.requires_grad = False
    inject_lora(model, 8, 16)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)  # time the step, keep the weights
    cases = {"reasoning-like: 6 prompts x G=8, 64 + lognormal(5.3, 0.8) <= 1024": sequences(6, 8, 64, 5.3, 0.8, 1024),
             "demo-like: 16 prompts x G=8, 6 + 1..8": sequences(16, 8, 6, 1.2, 0.6, 8)}
    rows, notes = [], []
    for case, seqs in cases.items():
        run, cfg, tokens = RunSettings(max_new_tokens=1024), TrainConfig(), sum(len(s.ids) for s in seqs)
        arms = {"fixed 8 a micro-batch, padded": lambda: padded_step(model, opt, seqs, run, cfg, 8),
                "fixed 16 a micro-batch, padded": lambda: padded_step(model, opt, seqs, run, cfg, 16),
                f"packed, {cfg.micro_batch_tokens} tokens a row": lambda: train_step(model, opt, seqs, run, cfg, torch.device("cpu"))}
        times = {a: [] for a in arms}
        for fn in arms.values():
            fn()  # warm-up
        for _ in range(REPEATS):  # interleaved, so background load hits every arm alike
            for a, fn in arms.items():
                t0 = time.perf_counter()
                fn()
                times[a].append(time.perf_counter() - t0)
        packed = times[list(arms)[-1]]
        for a in arms:
            k = int(a.split()[1]) if a.startswith("fixed") else None
            mbs = [seqs[i:i + k] for i in range(0, len(seqs), k)] if k else micro_batches(seqs, cfg.micro_batch_tokens)
            computed = sum(len(mb) * max(len(s.ids) for s in mb) for mb in mbs) if k else tokens
            speedup = [t / p for t, p in zip(times[a], packed)]  # per repeat: this arm's time / packed time
            rows.append({"sequences": case, "micro-batching": a, "micro_batches": len(mbs), "padding_frac": 1 - tokens / computed,
                         "step_s_mean": statistics.mean(times[a]), "step_s_sd": statistics.stdev(times[a]),
                         "packed_speedup_mean": statistics.mean(speedup), "packed_speedup_min": min(speedup),
                         "packed_speedup_max": max(speedup)})
        notes.append(f"{case}: packed is {rows[-3]['packed_speedup_mean']:.2f}x fixed-8 and "
                     f"{rows[-2]['packed_speedup_mean']:.2f}x fixed-16")
    report("micro_batching", rows, f"means over {REPEATS} interleaved repeats (target >= 1.5x on reasoning-like lengths): "
           + "; ".join(notes))
