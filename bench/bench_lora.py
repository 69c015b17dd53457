"""Hand-written LoRA costs nothing: forward+backward of our LoRA-wrapped model against peft's on the same base
weights and rank, the overhead against the bare base model, and the size of a rank-1 adapter for a 1.5B model.

    python bench/bench_lora.py             # ~3 minutes on a 2-core CPU (the 0.5B-shaped model dominates)
"""
import copy

import peft
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from common import report, timed_together
from minigrpo.lora import DEFAULT_TARGETS, inject_lora
from minigrpo.model import load_model

torch.set_num_threads(2)
QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
QWEN_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)


def fwd_bwd(model, ids):
    def step():
        loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
        if loss.requires_grad:
            loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def compare(name, base, batch, length, r=8, iters=5):
    torch.manual_seed(0)
    ids = torch.randint(0, base.config.vocab_size, (batch, length))
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    inject_lora(ours, r, 2 * r, DEFAULT_TARGETS)
    theirs = peft.get_peft_model(theirs, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(DEFAULT_TARGETS)))
    t = timed_together({"ours": fwd_bwd(ours, ids), "peft": fwd_bwd(theirs, ids)}, iters)
    t_ours, t_peft = t["ours"], t["peft"]
    with torch.no_grad():
        f = timed_together({"base": lambda: base(input_ids=ids), "ours": lambda: ours(input_ids=ids),
                            "peft": lambda: theirs(input_ids=ids)}, iters)
    t_base, f_ours, f_peft = f["base"], f["ours"], f["peft"]
    return {"model": name, "tokens": batch * length, "rank": r, "fwd_bwd_ours_s": t_ours, "fwd_bwd_peft_s": t_peft,
            "ours/peft": t_ours / t_peft, "fwd_base_s": t_base, "fwd_ours_s": f_ours, "fwd_peft_s": f_peft,
            "fwd_ours/base": f_ours / t_base}


if __name__ == "__main__":
    demo, _ = load_model("demo", torch.device("cpu"))
    rows = [compare("demo (279k)", demo, 64, 12, iters=20)]
    big = Qwen2ForCausalLM(Qwen2Config(**QWEN_05B)).eval()
    for p in big.parameters():
        p.requires_grad = False
    rows.append(compare("Qwen2.5-0.5B-shaped (random)", big, 2, 128, iters=7))
    with torch.device("meta"):
        m15 = Qwen2ForCausalLM(Qwen2Config(**QWEN_15B))
    inject_lora(m15, 1, 2, DEFAULT_TARGETS)
    n = sum(p.numel() for n_, p in m15.named_parameters() if ".lora_" in n_)
    notes = f"rank-1 adapter on all 7 projections of a Qwen2.5-1.5B-shaped model: {n:,} parameters = {n * 4 / 2**20:.2f} MiB (float32)"
    report("lora_vs_peft", rows, notes)
