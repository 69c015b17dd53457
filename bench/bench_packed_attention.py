"""Packed attention on this CPU: peak memory and time of one forward+backward through packed_logprobs (LoRA
gradients), with the two plans minigrpo.model makes, side by side:

    padded mask         on a CPU (and MPS): the runs grouped by length, each group one SDPA call with a dense
                        (k, 1, L, Q + L) boolean mask, the shared prefixes right-aligned and padded to the longest, Q;
                        the mask is made once a forward and shared by every layer
    (L, q) + CausalBias on CUDA (FLAG_DEVICES): the runs grouped by length and shared prefix, so nothing is padded,
                        and a branch group's lower-right causality is torch's causal_lower_right, a flag that the
                        flash and memory-efficient kernels take; a CPU has no kernel for it, so here SDPA materialises
                        it in every call (FLAG_DEVICES is set to the CPU to run it)

    python bench/bench_packed_attention.py           # ~4 minutes on 2 cores; writes bench/results/packed_attention.json

Two rows: the demo's step (the demo model, 32 prompts x G=8 short completions of mixed lengths in one packed row)
and 2 x 8k tokens (a small Qwen2, 4 heads over 2 KV heads, head_dim 32: one 512-token prompt, then two completions
of 7,680 tokens, each sequence 8,192 tokens long). Each arm runs in a fresh process, which resets its peak resident
set size (echo 5 > /proc/self/clear_refs) after building the model and the row and one warm-up step, runs STEPS
steps (its time: their median) and reads VmHWM, minus VmRSS before them: the steps' own growth, allocator noise
included. One more step counts the peak bytes of tensors alive (bench_logprobs_memory.LiveBytes: exact, the same
every run) and one more lists the SDPA operators that ran (torch.profiler); neither is timed. The arms alternate,
REPEATS processes each (mean +- sd over processes).

What a CPU cannot show: on a GPU a boolean mask keeps SDPA off its flash kernel (the memory-efficient one then scores
every (query, key) pair, the masked half too); the flag lets it pick flash. bench/gpu_smoke.sh prints the kernels
that ran there. On a CPU the flag's plan makes more, smaller calls (one per length and prefix) and a mask in each,
which is why a CPU keeps the padded mask.
"""
import json
import statistics
import subprocess
import sys
import time

import torch
from torch.nn.attention.bias import causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes
from transformers import Qwen2Config, Qwen2ForCausalLM

from common import report
import minigrpo.model as M
from minigrpo.lora import inject_lora, lora_layers
from minigrpo.packing import Sample, collate

REPEATS, STEPS = 3, 3
CASES = {"demo": "demo model, 32 prompts x G=8, completions of 1-5 tokens", "8k": "2 x 8k tokens (prompt 512 + 7,680 each)"}


def cuda_plan():
    """The plan minigrpo.model makes on CUDA, here on the CPU; causal_lower_right made outside LiveBytes' dispatch mode,
    in which a tensor subclass cannot be made."""
    M.FLAG_DEVICES = ("cpu",)

    def flag(L: int, kv: int):
        with _disable_current_modes():
            return causal_lower_right(L, kv)
    M.causal_lower_right = flag


ARMS = {"padded mask": lambda: None, "(L, q) + CausalBias": cuda_plan}


def build(case: str):
    """(model, a packed row's inputs) with LoRA on, B != 0, so every LoRA weight gets a gradient."""
    torch.manual_seed(0)
    if case == "demo":
        model, _ = M.load_model("demo", torch.device("cpu"))
        rng = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 13, (int(torch.randint(6, 9, (1,), generator=rng)),), generator=rng).tolist()
                   for _ in range(32)]
        seqs = [Sample(p + torch.randint(3, 13, (int(torch.randint(1, 6, (1,), generator=rng)),), generator=rng).tolist(),
                       len(p), [], 1.0) for p in prompts for _ in range(8)]
    else:
        model = Qwen2ForCausalLM(Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                                             max_position_embeddings=8192, attn_implementation=M.PACKED_SDPA)).eval()
        model.requires_grad_(False)
        prompt = torch.randint(0, 1024, (512,)).tolist()
        seqs = [Sample(prompt + torch.randint(0, 1024, (7680,)).tolist(), 512, [], 1.0) for _ in range(2)]
    inject_lora(model, 8, 16)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(std=0.01)
    for s in seqs:
        s.behav = [0.0] * (len(s.ids) - s.prompt_len)
    return model, collate(seqs, torch.device("cpu"))[0]


def step(model, inputs):
    logp, _ = M.packed_logprobs(model, *inputs, 1.0)
    logp.sum().backward()
    model.zero_grad(set_to_none=True)


def status_kb(field: str) -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))


def arm(name: str, case: str) -> dict:
    from bench_logprobs_memory import LiveBytes
    torch.set_num_threads(2)
    ARMS[name]()
    model, inputs = build(case)
    step(model, inputs)  # a warm-up: one-time costs (first calls, the kernel line) stay out of the figures
    open("/proc/self/clear_refs", "w").write("5")  # the peak RSS restarts from the current RSS
    rss0, times = status_kb("VmRSS"), []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        step(model, inputs)
        times.append(time.perf_counter() - t0)
    out = {"growth_bytes": (status_kb("VmHWM") - rss0) * 1024, "step_s": statistics.median(times)}
    known = [t.untyped_storage() for t in (*model.parameters(), *model.buffers(), *inputs)]
    with LiveBytes(known) as mem:
        step(model, inputs)
    out["tensor_peak_bytes"] = mem.peak
    with torch.profiler.profile() as prof:
        step(model, inputs)
    out["kernels"] = sorted({e.key for e in prof.key_averages() if "attention" in e.key and e.key.startswith("aten::_")})
    return out


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--arm":
        print(json.dumps(arm(sys.argv[2], sys.argv[3])))
        sys.exit()
    rows = []
    for case, what in CASES.items():
        runs = {name: [] for name in ARMS}
        for _ in range(REPEATS):
            for name in runs:
                out = subprocess.run([sys.executable, __file__, "--arm", name, case], capture_output=True, text=True,
                                     check=True)
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(case, name, runs[name][-1], flush=True)  # a slow machine shows its progress
        for name, rs in runs.items():
            mb, t = [r["growth_bytes"] / 2**20 for r in rs], [r["step_s"] for r in rs]
            rows.append({"case": what, "plan": name, "tensor_peak_mib": rs[0]["tensor_peak_bytes"] / 2**20,
                         "rss_growth_mib_mean": statistics.mean(mb), "rss_growth_mib_sd": statistics.stdev(mb),
                         "step_s_mean": statistics.mean(t),
                         "step_s_sd": statistics.stdev(t), "sdpa_ops": " ".join(rs[0]["kernels"])})
    report("packed_attention", rows, f"forward+backward of packed_logprobs (LoRA r=8 gradients): the median of {STEPS} "
           f"steps after a warm-up, in each of {REPEATS} fresh processes per arm, alternating; 2 threads, torch "
           f"{torch.__version__}, CPU; tensor peak: bytes of tensors alive (exact); rss growth: VmHWM after the steps minus "
           "VmRSS before them")
