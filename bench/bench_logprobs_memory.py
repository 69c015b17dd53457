"""Memory-lean log-probs: peak memory and time of one forward+backward through sequence_logprobs (the output head
applied a chunk of tokens at a time) against the textbook full-logits log_softmax, on a random Qwen2.5-1.5B-shaped
model (vocabulary 151,936, 2 layers, bf16 weights, rank-1 LoRA) and 2 x 1024 tokens, on the CPU.

Memory is the operating system's count, so torch's allocations are all seen: each arm runs in a fresh process,
which resets its peak resident set size (echo 5 > /proc/self/clear_refs) once the model and inputs are built and
reads VmHWM (the peak) after one step, minus VmRSS before it: the first step, with no cached allocations to hide
behind. The step is also timed. The arms alternate, 3 processes each.

    python bench/bench_logprobs_memory.py  # Linux (/proc); hours on a CPU without bf16 matrix instructions, where
                                           # a bf16 matmul with a 151,936-long reduction runs at 0.3 GFLOP/s
    python bench/bench_logprobs_memory.py 256 float32   # 2 x 256 tokens in float32: ~5 minutes on 2 cores
    python bench/bench_logprobs_memory.py 1024 float32  # 2 x 1024 tokens in float32: ~10 minutes, 8 GB of memory
    python bench/bench_logprobs_memory.py 1024 count    # tensor bytes, float32 and bf16, under fake tensors: seconds
Each setting writes bench/results/logprobs_memory_<tokens>_<dtype>.json.

`count` runs the same step on fake tensors (torch's FakeTensorMode: shapes and dtypes, no memory, no arithmetic)
and counts the bytes of tensor storage alive after each operation (LiveBytes), so bf16 is measured where this
CPU cannot run it. It sees no allocator overhead, no temporaries inside an operation and no storage that an
`out=` operation grows (the step writes only into slices of the right size): in float32, where both
methods run, it reads 0.3 GB below the operating system's peak in both arms (bench/README.md, Performance).
"""
import json
import statistics
import subprocess
import sys
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import Qwen2Config, Qwen2ForCausalLM

from common import report
from minigrpo.lora import inject_lora
from tests.conftest import sequence_logprobs

B, LAYERS, REPEATS = 2, 2, 3
QWEN_15B = dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
                vocab_size=151936, tie_word_embeddings=True)


def full_logits_logprobs(model, ids, attn, temperature):
    """The textbook way (the trainer's before): the whole (B, L-1, V) logits, log_softmax and its exp."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # (B, L-1, V)
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, L-1, V)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1), entropy


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive, and their peak, after each operation. Storages there on entry (`known`) are
    not counted: the step's growth is what it allocates."""

    def __init__(self, known):
        super().__init__()
        self.live = {ref.cdata: (ref, 0) for ref in map(StorageWeakRef, known)}  # storage -> (weak ref, bytes)
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for key, (ref, n) in list(self.live.items()):  # freed since the last operation
            if ref.expired():
                del self.live[key]
                self.now -= n
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            ref = StorageWeakRef(t.untyped_storage()) if isinstance(t, torch.Tensor) else None
            if ref is not None and ref.cdata not in self.live:  # a view or an in-place result is not new memory
                self.live[ref.cdata] = (ref, t.untyped_storage().nbytes())
                self.now += self.live[ref.cdata][1]
        self.peak = max(self.peak, self.now)
        return out


def build(L: int, dtype: str):
    torch.manual_seed(0)
    torch.set_default_dtype(getattr(torch, dtype))  # built in that dtype: no float32 copy of bf16 weights exists
    model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=LAYERS, **QWEN_15B)).eval()
    torch.set_default_dtype(torch.float32)
    inject_lora(model, 1, 2)
    ids = torch.randint(0, QWEN_15B["vocab_size"], (B, L))
    return model, ids, torch.ones_like(ids)


def step(name, model, ids, attn):
    fn = {"full logits": full_logits_logprobs, "chunked head": sequence_logprobs}[name]
    logp, entropy = fn(model, ids, attn, 1.0)
    logp.mean().backward()
    model.zero_grad(set_to_none=True)


def counted(name: str, L: int, dtype: str) -> int:
    """Peak bytes of tensors the step allocates, on fake tensors."""
    with FakeTensorMode():
        model, ids, attn = build(L, dtype)
        with LiveBytes([t.untyped_storage() for t in (*model.parameters(), *model.buffers(), ids, attn)]) as mem:
            step(name, model, ids, attn)
    return mem.peak


def status_kb(field: str) -> int:
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":"))


def arm(name: str, L: int, dtype: str) -> dict:
    torch.set_num_threads(2)
    model, ids, attn = build(L, dtype)
    open("/proc/self/clear_refs", "w").write("5")  # the peak RSS restarts from the current RSS
    rss0, t0 = status_kb("VmRSS"), time.perf_counter()
    step(name, model, ids, attn)
    return {"growth_bytes": (status_kb("VmHWM") - rss0) * 1024, "step_s": time.perf_counter() - t0}


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--arm":
        print(json.dumps(arm(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
        sys.exit()
    L, dtype = (int(sys.argv[1]), sys.argv[2]) if len(sys.argv) == 3 else (1024, "bfloat16")
    if dtype == "count":
        rows = []
        for name in ("full logits", "chunked head"):
            for dt in ("float32", "bfloat16"):
                unit = B * L * QWEN_15B["vocab_size"] * getattr(torch, dt).itemsize
                peak = counted(name, L, dt)
                rows.append({"arm": name, "dtype": dt, "growth_gb": peak / 1e9, "growth_vs_logits": peak / unit})
        report(f"logprobs_memory_{L}_count", rows, f"{B} x {L} tokens: peak bytes of tensors alive during forward+backward "
               "(fake tensors, counted after each operation), in units of one logits tensor of that dtype; exact, "
               "the same on every run (target <= 1.5x in bf16)")
        sys.exit()
    logits_bytes = B * L * QWEN_15B["vocab_size"] * getattr(torch, dtype).itemsize  # one logits tensor
    runs = {"full logits": [], "chunked head": []}
    for _ in range(REPEATS):
        for name in runs:
            out = subprocess.run([sys.executable, __file__, "--arm", name, str(L), dtype], capture_output=True, text=True,
                                 check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(name, runs[name][-1], flush=True)  # a slow machine shows its progress
    rows = []
    for name, rs in runs.items():
        g = [r["growth_bytes"] / logits_bytes for r in rs]
        t = [r["step_s"] for r in rs]
        rows.append({"arm": name, "growth_vs_logits_mean": statistics.mean(g), "growth_vs_logits_sd": statistics.stdev(g),
                     "growth_gb_mean": statistics.mean(r["growth_bytes"] for r in rs) / 1e9,
                     "step_s_mean": statistics.mean(t), "step_s_sd": statistics.stdev(t)})
    ratios = [n["step_s"] / o["step_s"] for o, n in zip(runs["full logits"], runs["chunked head"])]
    report(f"logprobs_memory_{L}_{dtype}", rows, f"{B} x {L} tokens, {dtype}: peak memory growth of forward+backward in units of "
           f"one {dtype} logits tensor ({logits_bytes / 1e9:.2f} GB), {REPEATS} fresh processes per arm, alternating (target <= 1.5x); time "
           f"chunked/full per pair: {statistics.mean(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}; "
           f"target <= 1.2)")
