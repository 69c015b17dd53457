"""How long an evaluation stops training: train.py's evaluate() (the trainer's own TorchEngine samples one completion
per held-out problem, --eval_batch_tokens' worth of rows at a time, while training waits) against one train_step(), measured on this CPU
at small shapes, then scaled to the README's math recipes (qwen-math-1.5b: max_new_tokens 3000; r1-distill-1.5b: 8192;
both eval_size 500, eval_every 50, 500 steps, 16 groups x G=8) with the trainer on one H100-class GPU.

1. evaluate() vs train_step() (the recipes' loss: dr_grpo, --old_logp recompute, LoRA r=1, micro-batches of 16,384
   tokens), float32, 1 thread (train.py's default), 3 interleaved repeats, mean +- sd: the demo model (stops at EOS)
   and two random Qwen2-shaped models (vocabulary 32,000, never say EOS, so every completion runs to max_new_tokens),
   at max_new_tokens M in {16, 64, 256}, 32 held-out problems, batches of B in {8, 32} rows; train_step on 2 groups
   x G=8 completions of M tokens. Each evaluate() is fitted, per model, by the engine's decode loop:
       T_eval = sum over batches of  S * a  +  S * B * b  +  B * sum_t (P + t) * c
   S = decode steps of the batch = its LONGEST completion (rows stay in the batch until all are done), P the padded
   prompt; a: fixed cost of a step (Python, dispatch), b: per row (weights, sampler, the seeded noise), c: per row per
   token of context (attention, and DynamicCache's torch.cat that copies the whole cache every step).
2. The fixed per-step cost `a` of a 28-layer Qwen2 (Qwen2.5-1.5B's depth) at tiny widths (hidden 64, vocab 1024), so
   that compute is ~0 and what is left is Python + op dispatch, the part that bounds HF-style per-token decoding on a
   GPU; the per-row cost of evaluate()'s per-problem seeds (one torch.rand per row per step); and the context term c,
   from each forward's time over one 768-token batch of 16 rows (DynamicCache copies the whole cache every step).
3. The scaling to the recipes (SCALING below: every assumption, low and high): T_eval by the formula above with GPU
   values of a, b, c; a step's wall time bound by the trainer (4N FLOPs per trained token at an MFU) or by 1 or 4 vLLM
   generator GPUs, which keep sampling into the --max_ready buffer while the trainer evaluates; the share = the
   evaluations' lost time / (the steps' time + the evaluations' lost time), low - high (central).

    python bench/eval_share.py   # ~10 minutes on 2 cores: writes bench/results/eval_share.json
"""
import os
import random
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

from common import report
import train  # noqa: E402 (train.py at the repository root: evaluate, train_step, TrainConfig)
from minigrpo.engine import SamplingParams, TorchEngine
from minigrpo.lora import inject_lora
from minigrpo.model import DEMO_MODEL, load_model, stop_token_ids
from minigrpo.packing import Sample
from minigrpo.run import RunSettings
from minigrpo.tasks import ReverseAddition

torch.set_num_threads(1)  # train.py's default --threads; 2 threads on 2 shared cores oversubscribe (50x slower)
EVAL_PROBLEMS, GROUPS, G, REPEATS, LENGTHS, EVAL_BATCHES = 32, 2, 8, 3, (16, 64, 256), (8, 32)
SHAPES = {"qwen2-2x256": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=32000),
          "qwen2-4x512": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                              num_key_value_heads=2, vocab_size=32000),
          "tiny-28x64": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=28, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=1024)}
QWEN_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                num_key_value_heads=2, vocab_size=151936)  # Qwen2.5-Math-1.5B and R1-Distill-Qwen-1.5B


def matmul_params(c: dict) -> int:
    """N: weights every token multiplies (the layers' linears and the output head; not the embedding lookup)."""
    h, kv = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"] * c["num_key_value_heads"]
    return c["num_hidden_layers"] * (2 * h * h + 2 * h * kv + 3 * h * c["intermediate_size"]) + c["vocab_size"] * h


def build(name: str, work: str) -> str:
    """A random Qwen2 model saved with the demo's character tokenizer (as bench/gpu_smoke.sh does)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    path = os.path.join(work, name)
    Qwen2ForCausalLM(Qwen2Config(**SHAPES[name], max_position_embeddings=4096, tie_word_embeddings=False,
                                 eos_token_id=0, pad_token_id=0)).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(DEMO_MODEL, f), path)
    return path


class Recorder:
    """Wraps engine.generate: per batch, (rows B, decode steps S = longest completion, padded prompt length P)."""

    def __init__(self, engine):
        self.engine, self.generate, self.batches = engine, engine.generate, []
        engine.generate = self

    def __call__(self, prompts, params):
        out = self.generate(prompts, params)
        S = max(len(c.token_ids) for group in out for c in group)
        self.batches.append((sum(p.n for p in params), S, max(map(len, prompts))))
        return out


def features(batches) -> list[float]:
    """The fit's regressors for one evaluate(): steps, row-steps, row-context-steps."""
    return [sum(S for B, S, P in batches), sum(B * S for B, S, P in batches),
            sum(B * (S * P + S * (S + 1) / 2) for B, S, P in batches)]


def measure(name: str, path: str, lengths, eval_batches) -> tuple[list, list]:
    model, tokenizer = load_model(path, torch.device("cpu"))
    inject_lora(model, 1, 2.0)  # the recipes' rank-1 adapter
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=4e-5)
    engine = TorchEngine(model, stop_token_ids(model, tokenizer), tokenizer.pad_token_id)
    recorder = Recorder(engine)
    task = ReverseAddition()
    problems = task.eval_problems(EVAL_PROBLEMS)
    n = matmul_params(model.config.to_dict())
    rows, fit_points = [], []
    for M in lengths:
        run = RunSettings(max_new_tokens=M, group_size=G, lora_r=1, lora_alpha=2.0)
        cfg = train.TrainConfig(loss_type="dr_grpo", old_logp="recompute", micro_batch_tokens=16384)
        rng = random.Random(M)
        samples = []
        for p in [task.sample(rng) for _ in range(GROUPS)]:
            ids = tokenizer(p.prompt)["input_ids"]
            samples += [Sample(ids + [rng.randrange(1, model.config.vocab_size) for _ in range(M)], len(ids),
                               [-2.0] * M, rng.choice([-1.0, 1.0])) for _ in range(G)]
        trained = sum(len(s.behav) for s in samples) + GROUPS * samples[0].prompt_len  # a prompt once per group
        times, shapes = {B: [] for B in eval_batches} | {"train": []}, {}
        for _ in range(REPEATS + 1):  # the first round warms up
            for B in eval_batches:
                recorder.batches = []
                t0 = time.perf_counter()
                longest = max(len(tokenizer(p.prompt)["input_ids"]) for p in problems)  # B rows of KV: its token budget
                train.evaluate(engine, tokenizer, task, problems, run, 0, B * (longest + M))
                times[B].append(time.perf_counter() - t0)
                shapes[B] = recorder.batches  # per-problem seeds: the same draws, so the same shapes, every round
            t0 = time.perf_counter()
            train.train_step(model, optimizer, samples, run, cfg, torch.device("cpu"))
            times["train"].append(time.perf_counter() - t0)
        train_s = times["train"][1:]
        for B in eval_batches:
            f, eval_s = features(shapes[B]), times[B][1:]
            fit_points += [(f, t) for t in eval_s]
            tokens = sum(Bb * S for Bb, S, P in shapes[B])
            rows.append({"model": name, "N_M": n / 1e6, "max_new_tokens": M, "eval_batch": B,
                         "eval_s": statistics.mean(eval_s), "eval_sd": statistics.stdev(eval_s),
                         "decode_steps": f[0], "row_steps": tokens,
                         "ms_per_step": 1e3 * statistics.mean(eval_s) / f[0],
                         "train_s": statistics.mean(train_s), "train_sd": statistics.stdev(train_s),
                         "train_tokens": trained, "train_gflop_s": 4 * n * trained / statistics.mean(train_s) / 1e9,
                         "decode_gflop_s": 2 * n * tokens / statistics.mean(eval_s) / 1e9,
                         "eval/train": statistics.mean(e / t for e, t in zip(eval_s, train_s))})
            print(rows[-1], flush=True)
    return rows, fit_points


def fit(points) -> dict:
    """Least squares T = a f1 + b f2 + c f3 (no intercept), coefficients >= 0 (a negative one is dropped and the rest
    refitted: on a CPU the context term is below resolution at these lengths), and R^2."""
    X, y = np.array([f for f, _ in points]), np.array([t for _, t in points])
    keep = [0, 1, 2]
    while True:
        coef = np.zeros(3)
        coef[keep] = np.linalg.lstsq(X[:, keep], y, rcond=None)[0]
        if (coef >= 0).all():
            break
        keep.remove(int(coef.argmin()))
    r2 = 1 - ((X @ coef - y) ** 2).sum() / ((y - y.mean()) ** 2).sum()
    return {"a_ms": 1e3 * coef[0], "b_us": 1e6 * coef[1], "c_ns": 1e9 * coef[2], "r2": r2}


def dispatch_overhead(work: str) -> dict:
    """Per decode step of the 28-layer tiny model at ~zero compute: its time at B=1 (the fixed cost a, ms) and at
    B=16, with per-row seeds as evaluate() gives; and the engine's seeded-noise loop alone, per row (us)."""
    model, _ = load_model(build("tiny-28x64", work), torch.device("cpu"))
    inject_lora(model, 1, 2.0)
    engine = TorchEngine(model, [], 0)  # no stop id: every row runs to the limit
    steps, per_step = 32, {}
    for _ in range(REPEATS + 1):
        for B in (1, 16):
            params = [SamplingParams(max_tokens=steps, seed=i) for i in range(B)]
            t0 = time.perf_counter()
            engine.generate([[1, 2, 11, 3, 4, 12]] * B, params)
            per_step.setdefault(B, []).append((time.perf_counter() - t0) / steps)
    gens, u, noise = {r: torch.Generator().manual_seed(r) for r in range(256)}, torch.empty(256, 1024), []
    for _ in range(REPEATS + 1):  # TorchEngine.generate's loop over seeded rows, once per step
        t0 = time.perf_counter()
        for _ in range(10):
            for r, g in gens.items():
                u[r] = torch.rand(u.shape[1], generator=g)
        noise.append((time.perf_counter() - t0) / 10 / 256)
    # the context term: one long batch, each step's forward timed; its slope over the context, per row
    B, M, forward, stamps = 16, 768, engine._forward, []

    def timed_forward(*args):
        t0 = time.perf_counter()
        out = forward(*args)
        stamps.append(time.perf_counter() - t0)
        return out
    engine._forward = timed_forward
    engine.generate([[1, 2, 11, 3, 4, 12]] * B, SamplingParams(max_tokens=M, seed=0))
    engine._forward = forward
    ctx, t = np.arange(len(stamps) - 1) + 7, np.array(stamps[1:])  # decode steps (the first is the prefill)
    slope = np.polyfit(ctx, t, 1)[0] / B
    kv_bytes = 28 * 2 * 1 * 32 * 4  # per row per context token: layers x (K, V) x KV heads x head_dim x float32
    return {"layers": 28, "a_ms (step, B=1)": 1e3 * statistics.mean(per_step[1][1:]),
            "a_sd": 1e3 * statistics.stdev(per_step[1][1:]), "step_ms_B16": 1e3 * statistics.mean(per_step[16][1:]),
            "seeded_noise_us_per_row": 1e6 * statistics.mean(noise[1:]),
            "forward_ms_B16_first64": 1e3 * t[:64].mean(), "forward_ms_B16_last64": 1e3 * t[-64:].mean(),
            "c_ns_per_row_ctx_token": 1e9 * slope, "kv_bytes_per_row_ctx_token": kv_bytes,
            "implied_GB_s_at_1x_kv": kv_bytes / slope / 1e9}


# ---- 3. scaling to the recipes: every assumption, (low, high) ----
# eval_batch_size: rows a batch, the default (256) before --eval_batch_tokens; these figures were scaled with it
SCALING = {
    "eval_size": 500, "eval_batch_size": 256, "eval_every": 50, "max_steps": 500, "completions_per_step": 16 * 8,
    "prompt_tokens": (100, 200),  # a MATH problem in the chat template
    # S / max_new_tokens: the batch's LONGEST completion. Of 256 rows at T=1 at least one runs to the limit when more
    # than ~2% are truncated, which is usual at the start of a run; low: none is
    "longest_frac": (0.6, 1.0),
    # mean completion / max_new_tokens, for the trained tokens and the generator: Qwen2.5-Math-1.5B at T=1 writes a
    # few hundred to ~1000 tokens (of 3000); R1-Distill-Qwen-1.5B ~4-6k of 8192, many truncated
    "mean_frac": {"qwen-math-1.5b": (0.15, 0.35), "r1-distill-1.5b": (0.5, 0.8)},
    # per decode step, HF-eager TorchEngine on one H100: a = the host's Python + dispatch for 28 layers and the
    # sampler, which the GPU waits on (part 2 measures ~20 ms on this machine's slow shared core; a GPU host's core is
    # 1-2x faster, un-overlapped CUDA launches add to it); b per row: 2N FLOPs at 400-700 TFLOP/s (4-8 us) + ~10
    # passes of the sampler over 151,936 float32 logits (2-3 us) + the seeded torch.rand per row (part 2: ~7 us of
    # dispatch) ~ 10-30 us; c per row per context token: KV of 28 layers x 2 x 2 KV heads x 128 x 2 B = 28,672 B,
    # read by attention and read + written by DynamicCache's torch.cat each step: 3 x 28.7 KB at 2-3 TB/s
    "a_ms": (10.0, 25.0), "b_us": (10.0, 30.0), "c_ns": (3 * 28672 / 3.0e12 * 1e9, 3 * 28672 / 2.0e12 * 1e9),
    # the trainer: 4N FLOPs per token (forward 2N, backward through frozen weights 2N: LoRA has no weight gradients;
    # 6N if they were counted) + causal attention 6 * layers * hidden * L^2 per sequence, at an MFU of an H100's
    # 989 dense bf16 TFLOP/s, + a second of packing / publishing / logging per step
    "peak_flops": 989e12, "mfu": (0.25, 0.45), "step_overhead_s": (0.5, 1.5),
    # one vLLM H100 generating: a batch of 8 prompts x G = 64 completions takes its longest completion's steps at
    # 6-12 ms a step (1.5B, CUDA graphs); 2 batches a step; it runs ahead by generate.py's --max_ready 64 groups
    # (4 steps) while the trainer evaluates, which hides that much of each evaluation
    "vllm_step_ms": (6.0, 12.0), "generator_batches_per_step": 2, "ahead_steps": 4,
}


def scale(preset: str, M: int) -> list[dict]:
    """Per regime: (low, central, high) evaluation time, step time and share. x = 0 takes every assumption's low
    end, 1 its high end, 0.5 their middles; the share is lowest with short evaluations and slow steps."""
    s, n, layers, h = SCALING, matmul_params(QWEN_15B), QWEN_15B["num_hidden_layers"], QWEN_15B["hidden_size"]
    at = lambda key, x, table=s: table[key][0] + x * (table[key][1] - table[key][0])  # noqa: E731
    sizes = [min(s["eval_batch_size"], s["eval_size"] - k) for k in range(0, s["eval_size"], s["eval_batch_size"])]

    def eval_s(x):  # the fitted decode formula, summed over the evaluation's batches
        P, S, a, b, c = at("prompt_tokens", x), at("longest_frac", x) * M, at("a_ms", x) / 1e3, at("b_us", x) / 1e6, \
            at("c_ns", x) / 1e9
        return sum(S * a + S * B * b + B * (S * P + S * S / 2) * c for B in sizes)

    def train_s(x):  # the trainer's own step: x = 0 short completions and a high MFU
        L = at(preset, x, s["mean_frac"]) * M
        flops = s["completions_per_step"] * (4 * n * L + 6 * layers * h * L * L)
        return flops / (s["peak_flops"] * at("mfu", 1 - x)) + at("step_overhead_s", x)

    def gen_s(x):  # on one vLLM GPU: each batch lasts its longest completion
        return s["generator_batches_per_step"] * at("longest_frac", x) * M * at("vllm_step_ms", x) / 1e3

    n_evals = s["max_steps"] // s["eval_every"] + 1  # step 0, then every 50th (the last step is one)
    rows = []
    for gpus in (1, 4, None):  # vLLM generator GPUs; None: so many that the trainer never waits
        regime = f"{gpus} vLLM GPU{'s' * (gpus > 1)}" if gpus else "trainer-bound"
        cases = []
        for e in (0.0, 0.5, 1.0):  # low share: short evaluations (e = 0) and slow steps (x = 1 - e)
            ev, x = eval_s(e), 1 - e
            step = max(train_s(x), gen_s(x) / gpus) if gpus else train_s(x)
            # what the generator makes while the trainer evaluates (at most ahead_steps), trained afterwards at the
            # trainer's own pace instead of the generator's: trainer-bound, the buffer is full already and nothing is
            ahead = min(s["ahead_steps"], ev / step) if gpus else 0.0
            lost = ev - ahead * (step - train_s(x))
            cases.append((ev, step, lost, n_evals * lost / (s["max_steps"] * step + n_evals * lost)))
        # each span: the low-share case - the high-share case (the central case)
        span = lambda i, f: "-".join(f(c[i]) for c in (cases[0], cases[2])) + f" ({f(cases[1][i])})"  # noqa: E731
        minutes = lambda v: f"{v / 60:.1f}"  # noqa: E731
        rows.append({"preset": preset, "max_new_tokens": M, "regime": regime, "evals": n_evals,
                     "eval_min": span(0, minutes), "step_s": span(1, lambda v: f"{v:.1f}"),
                     "lost_per_eval_min": span(2, minutes), "eval_share": span(3, lambda v: f"{v:.0%}"),
                     "share_low": cases[0][3], "share_central": cases[1][3], "share_high": cases[2][3]})
    return rows


if __name__ == "__main__":
    work = tempfile.mkdtemp(prefix="bench-eval-share-")
    rows, fits = [], {}
    for name, path, lengths in (("demo", DEMO_MODEL, (8,)), ("qwen2-2x256", build("qwen2-2x256", work), LENGTHS),
                                ("qwen2-4x512", build("qwen2-4x512", work), LENGTHS)):
        r, points = measure(name, path, lengths, EVAL_BATCHES)
        rows += r
        fits[name] = fit(points) if name != "demo" else None
        print(name, fits[name], flush=True)
    overhead = dispatch_overhead(work)
    print("dispatch", overhead, flush=True)
    scaled = scale("qwen-math-1.5b", 3000) + scale("r1-distill-1.5b", 8192)
    report("eval_share", rows, extra={"fits": fits, "dispatch_28_layers": overhead, "scaling": SCALING,
                                      "presets": scaled, "N_qwen_1.5b": matmul_params(QWEN_15B)},
           notes="CPU, float32, 1 thread, 3 interleaved repeats (mean, sd). eval: train.evaluate on 32 problems, "
                 "eval_batch problems at a time; train: train.train_step on 2 x G=8 completions of max_new_tokens; "
                 "decode_steps: sum over batches of the longest completion; eval/train: paired per repeat.")
    print("\n== math recipes, scaled (SCALING: low-high) ==")
    for r in scaled:
        print("  ".join(f"{k} {v}" for k, v in r.items() if not k.startswith("share_")))
