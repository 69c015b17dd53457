"""The generation engine: tokens per second of minigrpo's batched KV-cache sampler against transformers'
model.generate on the same model, batch and length, both returning the log-prob of every sampled token, and
where the engine's time goes.

    python bench/bench_generate.py         # ~1 minute on a 2-core CPU
"""
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from common import report, timed_together
from minigrpo.engine import SamplingParams, TorchEngine
from minigrpo.lora import inject_lora
from minigrpo.model import load_model

torch.set_num_threads(2)


def compare(name, model, batch, prompt_len, new_tokens):
    inject_lora(model, 8, 16)
    prompts = torch.randint(1, model.config.vocab_size, (batch, prompt_len))
    engine = TorchEngine(model, stop_ids=[], pad_id=0)  # no stop token: every row runs to the full length
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0)

    def ours():
        engine.generate(prompts.tolist(), params)

    def theirs():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)

    with torch.no_grad():
        t = timed_together({"ours": ours, "hf": theirs}, iters=3)
    spent = {"forward": 0.0}
    forward = engine._forward

    def timed_forward(*a):
        t0 = time.perf_counter()
        out = forward(*a)
        spent["forward"] += time.perf_counter() - t0
        return out
    engine._forward = timed_forward
    t0 = time.perf_counter()
    ours()
    total = time.perf_counter() - t0
    tokens = batch * new_tokens
    return {"model": name, "batch": batch, "new_tokens": new_tokens, "ours_tok_s": tokens / t["ours"],
            "generate_tok_s": tokens / t["hf"], "ours/generate": t["hf"] / t["ours"],
            "forward_share": spent["forward"] / total}


if __name__ == "__main__":
    demo, _ = load_model("demo", torch.device("cpu"))
    torch.manual_seed(0)
    mid = Qwen2ForCausalLM(Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=6,
                                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)).eval()
    rows = [compare("demo (279k)", demo, 128, 7, 8), compare("Qwen2-shaped 6x512 (random)", mid, 32, 64, 128)]
    report("generation", rows, "ours/generate is the speed ratio (target >= 1.0); forward_share is the part of the "
                               "engine's time spent inside the model's forward (the rest: sampling, masks, bookkeeping)")
