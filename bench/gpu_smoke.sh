#!/usr/bin/env bash
# The prepared GPU check, in one call on the lent machine (one H100 or H200, no network, 10 minutes a call).
# A randomly initialised Qwen2 model of DeepSeek-R1-Distill-Qwen-1.5B's shape is built there (nothing is downloaded).
# Then, in bf16:
#   1. one gradient-checkpointed forward+backward on two 8k-token sequences (a 256-token prompt shared by two
#      7,936-token completions, 16k tokens in one packed row, as train.py packs them): its time, MFU, peak memory,
#      and which SDPA kernels ran (torch.profiler's operator and kernel names); then train.py's train_step on them,
#      counting the host's waits for the device (CUDA's sync debug mode; one is expected);
#   2. generate.py --engine torch beside train.py for four steps, with evaluations and a checkpoint; the trainer is
#      killed right after the step-2 checkpoint (MINIGRPO_FAULT) and resumed from it. Per step: step time without the
#      evaluation, forward+backward time, trained tokens/s, MFU, peak memory, the ratio and health/mismatch_kl; then
#      the peak memory per phase and the generator's tokens/s.
#
#   bash bench/gpu_smoke.sh --prepare  # here, where pip reaches its index: the wheels the lent machine lacks, into
#                                      # bench/wheels (ignored by git, about 15 MiB; a call carries at most 64)
#   bash bench/gpu_smoke.sh            # there: installs those wheels offline, then the check (estimated at 5-8
#                                      # minutes on an H100 or H200; not yet run there). Deadline: SMOKE_TOTAL_S (560)
#   bash bench/gpu_smoke.sh --tiny     # a CPU dry run with tiny shapes, so the script cannot rot (tests/test_gpu_smoke.py)
#
# The one-call command (the device tool's run, carry ["bench/wheels"], timeout_s 600):
#   bash bench/gpu_smoke.sh
# Where $OUT is set (the device tool sets it), the whole output and every phase's log come back in it.
#
# The lent machine (python3 3.12 with torch 2.11, transformers 5.17, no math-verify; /work/.library/device/KINDS.md)
# lacks requirements.txt's transformers (the pinned one goes along, so the run measures what users install) and
# math-verify, which minigrpo/tasks.py imports (the task here is the demo's reverse_add). The random model never says
# EOS, so every completion runs to --max_new_tokens.
set -uo pipefail  # no -e: a phase that fails prints its own log and says why (phase below), instead of a silent exit
cd "$(dirname "$0")/.."
# nothing may reach the network (a machine without one can hang on a connect)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 HF_HUB_DISABLE_PROGRESS_BARS=1 \
       PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 TOKENIZERS_PARALLELISM=false
mode=${1:-}
py=${SMOKE_PYTHON:-python3}  # python3: a bare machine may have no `python`
wheels=${SMOKE_WHEELS:-bench/wheels}
limit=${SMOKE_PHASE_TIMEOUT_S:-300}  # one phase's deadline at most
# The whole script's deadline, under the 600 s a device call may run: a phase cut short by it still prints its log,
# which a kill of the whole call would not. Each phase gets the smaller of its own limit and the time left.
end=$((SECONDS + ${SMOKE_TOTAL_S:-560}))
# the dense bf16 peak MFU is taken against: 989 TFLOP/s on an H100 SXM and an H200 alike (another card: set it)
export SMOKE_PEAK_TFLOPS=${SMOKE_PEAK_TFLOPS:-989}
failed=0

say() { echo "gpu_smoke: $*"; }
die() { say "$*"; exit 1; }
left() {  # seconds a phase may run: its limit ($1), or what is left of the script's deadline, at least 1
  local t=$((end - SECONDS))
  [ "$t" -gt "$1" ] && t=$1
  [ "$t" -lt 1 ] && t=1
  echo "$t"
}
phase() {  # phase NAME LIMIT CMD...: CMD under `timeout`, its output in $work/NAME.log; on failure: the log, and why
  local name=$1 rc=0 t
  t=$(left "$2")
  shift 2
  timeout "$t" "$@" > "$work/$name.log" 2>&1 || rc=$?
  [ "$rc" -eq 0 ] && return 0
  show "$work/$name.log"
  say "phase '$name' failed: exit code $rc$([ "$rc" -eq 124 ] && echo ", past its deadline of ${t}s")"
  return "$rc"
}
show() {  # a log, its last 200 lines (the whole of it comes back in $OUT)
  echo "----- $1 (last 200 lines) -----"
  tail -n 200 "$1"
  echo "----- end of $1 -----"
}

if [ "$mode" = "--prepare" ]; then
  # No python runs there before these are installed, so their versions are pinned here: transformers and math-verify
  # at requirements.txt's pins; math-verify 0.9.0 pins latex2sympy2_extended 1.11.0, which takes antlr4-python3-runtime
  # 4.9.3 to 4.13.2 and sympy (torch brings sympy). transformers 5.24's other needs are there (huggingface_hub 1.33,
  # tokenizers 0.23.2, safetensors 0.8.0, typer), except that nobody read its regex version (it needs >= 2025.10.22):
  # regex goes along for Python 3.12 and pip installs it only if the machine's is older.
  work=$(mktemp -d)
  pins=$(grep -oE '^(transformers|math-verify)==[^ ]+' requirements.txt | tr '\n' ' ')
  rm -rf "$wheels" && mkdir -p "$wheels"
  # shellcheck disable=SC2086
  phase download "$limit" "$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$wheels" \
    $pins latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 regex==2026.12.2 || die "pip download failed"
  ls -l "$wheels"
  kib=$(du -sk "$wheels" | cut -f1)
  say "$wheels holds $(ls "$wheels" | wc -l) wheels, $((kib / 1024)) MiB ($kib KiB); carry it: run with carry [\"$wheels\"]"
  [ "$kib" -le 65536 ] || die "$wheels is over the 64 MiB a device call carries"
  exit 0
fi

work=${SMOKE_DIR:-$(mktemp -d)}
mkdir -p "$work"
if [ -n "${OUT:-}" ]; then  # on the device machine: the whole output and every log come back as files
  exec > >(tee "$OUT/gpu_smoke.out") 2>&1
fi
gen=""
finish() {  # on any exit: stop the generator, and send the logs and metrics back
  [ -n "$gen" ] && kill "$gen" 2> /dev/null
  if [ -n "${OUT:-}" ]; then
    (cd "$work" && tar czf "$OUT/gpu_smoke_logs.tgz" ./*.log run/metrics 2> /dev/null)
  fi
}
trap finish EXIT

if [ "$mode" = "--tiny" ]; then
  device=cpu; new=16; eval_size=8
else
  # 512 new tokens: the torch engine decodes one token a forward (about 25-50 ms at 1.5B, the trainer's evaluation
  # sharing the GPU), so about 6 batches of 512 steps plus 3 evaluations fit the call's 10 minutes with room to
  # spare; the 8k-token step (1. below) covers long sequences
  device=cuda; new=${SMOKE_NEW_TOKENS:-512}; eval_size=32
  ls "$wheels"/*.whl > /dev/null 2>&1 || die "no wheels in $wheels: run 'bash bench/gpu_smoke.sh --prepare' where pip \
reaches its index, then carry $wheels"
  pins=$(grep -oE '^(transformers|math-verify)==[^ ]+' requirements.txt | tr '\n' ' ')
  # Offline, with pip's resolver: what the machine has and satisfies the pins' needs stays, the rest comes from the
  # folder, and a need neither meets stops here with its name instead of at an import.
  # shellcheck disable=SC2086
  if phase install 180 "$py" -m pip install --no-index --find-links "$wheels" --no-cache-dir --no-compile $pins; then
    tail -n 1 "$work/install.log"
  else  # an environment we cannot write, or a need the machine does not meet: the wheels alone, ahead of it
    say "installing into $work/site instead (first on PYTHONPATH, no dependency check)"
    phase install_site 180 "$py" -m pip install --no-index --no-deps --no-cache-dir --no-compile --upgrade \
      --target "$work/site" "$wheels"/*.whl || die "the wheels could not be installed"
    export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
    tail -n 1 "$work/install_site.log"
  fi
fi

# The first Python of the run, under its own short deadline (an earlier session's first import hung unexplained).
# It imports what generate.py and train.py import, so a missing or refused package is named here; on the GPU the
# transformers must be the pin (an older one could sample wrongly).
phase versions 120 "$py" - "$mode" "$(grep -oE '^transformers==[^ ]+' requirements.txt | cut -d= -f3)" <<'EOF' || exit 1
import importlib.metadata as md, sys
import aiohttp, fsspec, math_verify, safetensors, torch, transformers  # noqa: F401
import minigrpo.engine, minigrpo.model, minigrpo.tasks  # noqa: F401  (minigrpo's own version checks run at import)
tiny, pin = sys.argv[1] == "--tiny", sys.argv[2]
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__,
      "math-verify", md.version("math-verify"), "regex", md.version("regex"), "huggingface_hub", md.version("huggingface_hub"))
if not tiny:
    free, total = torch.cuda.mem_get_info()
    print(f"{torch.cuda.get_device_name()}, {free / 2**30:.0f} of {total / 2**30:.0f} GiB free, CUDA {torch.version.cuda}, "
          f"SDPA enabled: flash {torch.backends.cuda.flash_sdp_enabled()}, mem-efficient "
          f"{torch.backends.cuda.mem_efficient_sdp_enabled()}, cuDNN {torch.backends.cuda.cudnn_sdp_enabled()}, math "
          f"{torch.backends.cuda.math_sdp_enabled()}")
    assert transformers.__version__ == pin, f"transformers {transformers.__version__} is not requirements.txt's {pin}"
EOF
sed 's/^/gpu_smoke: /' "$work/versions.log"

phase build 120 "$py" - "$work/model" "$mode" <<'EOF' || exit 1
import shutil, sys
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from minigrpo.model import DEMO_MODEL
out, tiny = sys.argv[1], sys.argv[2] == "--tiny"
shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=1024) if tiny else dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
             num_attention_heads=12, num_key_value_heads=2, vocab_size=151936)  # R1-Distill-Qwen-1.5B's shape
torch.manual_seed(0)
with torch.device("cpu" if tiny else "cuda"):  # a GPU initialises 1.5B in seconds
    model = Qwen2ForCausalLM(Qwen2Config(**shape, max_position_embeddings=8192, tie_word_embeddings=False,
                                         eos_token_id=0, pad_token_id=0))
model.to(torch.bfloat16).save_pretrained(out)
for f in ("tokenizer.json", "tokenizer_config.json"):  # the demo's character tokenizer: reverse_add's prompts
    shutil.copy(f"{DEMO_MODEL}/{f}", out)
print(f"built {out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")
EOF
grep "^built" "$work/build.log"

# ---- 1. one gradient-checkpointed step on 8k-token sequences, as train.py --gradient_checkpointing true takes it ----
# Before the trainer: it is short and bounded, so its numbers come back even if a later phase runs out of time; and
# a failure here is reported without stopping the rest.
phase long 120 "$py" - "$work/model" "$mode" <<'EOF' || failed=1
import os, sys, time
import torch
from minigrpo.lora import inject_lora
from minigrpo.model import load_model, packed_logprobs
from minigrpo.packing import Sample, collate
path, tiny = sys.argv[1], sys.argv[2] == "--tiny"
cuda = not tiny
device = torch.device("cuda" if cuda else "cpu")
model, _ = load_model(path, device, "bfloat16")
inject_lora(model, 16, 32)
model.activation_checkpointing_enable({"use_reentrant": False})  # as train.py --gradient_checkpointing true
model.train()  # transformers checkpoints only in train mode (train.py's train_step does the same)
P, G, C = (64, 2, 480) if tiny else (256, 2, 7936)  # one prompt, then G completions: sequences of P + C = 8k tokens
c = model.config
torch.manual_seed(0)
prompt = torch.randint(1, c.vocab_size, (P,)).tolist()
samples = [Sample(prompt + torch.randint(1, c.vocab_size, (C,)).tolist(), P, [0.0] * C, 1.0) for _ in range(G)]
inputs, _ = collate(samples, device)  # one packed row, the prompt once: P + G C tokens (train.py's micro-batch)


def step():
    logp, _ = packed_logprobs(model, *inputs, 1.0)
    logp.sum().backward()
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()


step()  # a warm-up: cuBLAS handles, the allocator's pools
if cuda:
    torch.cuda.reset_peak_memory_stats()  # this step's peak alone, the model's weights included
t0 = time.perf_counter()
step()
dt = time.perf_counter() - t0
peak = f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else "(CPU: not measured)"
# Model FLOPs, as the trainer's MFU below counts them (its comment says why): 4 N per token through the layers, 4 V H
# per completion token through the output head, 12 layers heads head_dim per causal (query, key) pair; the input
# embedding and the checkpointed recomputation are not counted.
H, heads, layers = c.hidden_size, c.num_attention_heads, c.num_hidden_layers
d = H // heads
N = layers * (2 * H * H + 2 * H * d * c.num_key_value_heads + 3 * H * c.intermediate_size)
pairs = P * (P + 1) / 2 + G * (C * P + C * (C + 1) / 2)  # the prompt's, then each completion's (the prompt and itself)
flops = 4 * N * (P + G * C) + 4 * c.vocab_size * H * G * C + 12 * layers * heads * d * pairs
mfu = f"{flops / dt / (float(os.environ['SMOKE_PEAK_TFLOPS']) * 1e12):.1%}" if cuda else "n/a"
print(f"checkpointed step, one packed row of {P + G * C} tokens (a {P}-token prompt + {G} x {C}): {dt:.2f} s, "
      f"{(P + G * C) / dt:.0f} tok/s, MFU {mfu} (recomputation not counted), peak {peak}")
# Which SDPA kernel ran: the profiler names the aten operator SDPA dispatched to (_scaled_dot_product_flash_attention,
# _efficient_attention, _cudnn_attention, _attention_math; a math fallback shows its bmm/softmax instead) and, on a
# GPU, the CUDA kernels (flash_fwd..., fmha_cutlass..., cudnn...).
activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
with torch.profiler.profile(activities=activities) as prof:
    step()
events = prof.key_averages()
on_gpu = [e for e in events if str(e.device_type).endswith("CUDA")]  # the kernels themselves, each once
gpu_us = lambda e: getattr(e, "device_time_total", 0) or 0  # noqa: E731  (an operator's: its kernels', children's too)
total_us = sum(gpu_us(e) for e in on_gpu) or 1
for e in sorted((e for e in events if "attention" in e.key and e.key.startswith("aten::")), key=lambda e: e.key):
    print(f"  SDPA operator {e.key} x{e.count}" + (f", {gpu_us(e) / total_us:.0%} of GPU time" if cuda else ""))
kernels = [e for e in on_gpu if any(k in e.key.lower() for k in ("flash", "fmha", "attention", "sdpa", "cudnn"))]
for e in sorted(kernels, key=gpu_us, reverse=True)[:6]:
    print(f"  attention kernel {e.key[:110]} x{e.count}, {gpu_us(e) / total_us:.0%} of GPU time")
if cuda and not kernels:
    print("  attention kernel: none named flash/fmha/cudnn/attention (the math kernel, or the profiler saw no CUDA)")
# train.py's whole step on these samples, one micro-batch each: CUDA's sync debug mode warns at every operation that
# makes the host wait for the device. train_step reads the device once, at the end (its metrics and grad norm).
import warnings
from minigrpo.run import RunSettings
from train import TrainConfig, train_step
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
cfg = TrainConfig(loss_type="dr_grpo", micro_batch_tokens=P + C, gradient_checkpointing=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn") if cuda else None
    m = train_step(model, opt, samples, RunSettings(max_new_tokens=C), cfg, device)
    torch.cuda.set_sync_debug_mode(0) if cuda else None
waits = [str(w.message).splitlines()[0][:100] for w in caught if "synchroniz" in str(w.message)]
print(f"train_step, {m['perf/micro_batches']} micro-batches: " + (f"{len(waits)} host waits {waits}" if cuda else
      "host waits not measured on a CPU"))
EOF
[ -f "$work/long.log" ] && grep -E "^(checkpointed|  |train_step)" "$work/long.log"

# ---- 2. the generator and the trainer side by side, a kill after the step-2 checkpoint, and the resume ----
run=(--model "$work/model" --run_dir "$work/run" --max_new_tokens "$new" --group_size 8 --lora_r 16 --lora_alpha 32
     --generator_dtype bfloat16)
timeout "$(left 600)" "$py" generate.py "${run[@]}" --device "$device" --prompts_per_batch 8 --max_ready 16 \
  > "$work/generate.log" 2>&1 &
gen=$!
# Evaluations at steps 0, 2 and 4, in batches of at most 32 rows (prompts are under 64 tokens). Micro-batches of 8k tokens: without checkpointing
# 1.5B keeps about 3 MB of activations a token, 24 GB here (16k would be 48), beside the generator's model and cache.
# dr_grpo, the math recipes' loss, trains every group (dapo would drop a random model's all-zero ones).
train=(train.py "${run[@]}" --device "$device" --dtype bfloat16 --max_steps 4 --groups_per_step 8 --save_every 2
       --eval_every 2 --eval_size "$eval_size" --eval_batch_tokens $((32 * (64 + new))) --micro_batch_tokens 8192 --lr 1e-5
       --loss_type dr_grpo)
rc=0  # the first life must end by its fault, exit code 137, not by a phase's failure
MINIGRPO_FAULT=after_checkpoint:2 timeout "$(left "$limit")" "$py" "${train[@]}" > "$work/train.log" 2>&1 || rc=$?
if [ "$rc" -ne 137 ] || ! grep -q "MINIGRPO_FAULT" "$work/train.log"; then
  show "$work/train.log"
  show "$work/generate.log"
  die "the trainer did not stop at its fault (exit code $rc$([ "$rc" -eq 124 ] && echo ": past its deadline"))"
fi
phase resume "$limit" "$py" "${train[@]}" || { show "$work/generate.log"; exit 1; }
# the generator stops once it sees DONE; a minute is ample, and a generator that does not stop is reported, but
# does not keep the report below from printing
for _ in $(seq 60); do kill -0 "$gen" 2> /dev/null || break; sleep 1; done
rc=0
kill -0 "$gen" 2> /dev/null && { kill "$gen"; say "the generator did not stop within 60 s of DONE"; }
wait "$gen" || rc=$?
gen=""
[ "$rc" -eq 0 ] || { show "$work/generate.log"; say "the generator failed: exit code $rc"; failed=1; }
cat "$work/train.log" "$work/resume.log" | grep -E "^(step|resumed|trainer on)|attention|[Ww]arning" | cut -c1-200

phase report 60 "$py" - "$work" "$mode" <<'EOF' || exit 1
import glob, json, os, sys
work, tiny = sys.argv[1], sys.argv[2] == "--tiny"


def records(prefix):  # (epoch, record) of RUN/metrics/<prefix>*.jsonl in name order: a trainer's names begin with its epoch
    for f in sorted(glob.glob(f"{work}/run/metrics/{prefix}*.jsonl")):
        yield from ((os.path.basename(f).split("-")[1], json.loads(line)) for line in open(f) if line.strip())


lives = {}  # the trainer's epoch -> its records, in order
for epoch, r in records("train-"):
    lives.setdefault(epoch, []).append(r)
by_step = {r["step"]: (e, r) for e, rs in lives.items() for r in rs}  # a redone step: the newest life's record
c = json.load(open(f"{work}/model/config.json"))
H, V, heads, layers = c["hidden_size"], c["vocab_size"], c["num_attention_heads"], c["num_hidden_layers"]
d = H // heads
# MFU (PaLM, appendix B): model FLOPs per second over the chip's dense bf16 peak. Only matmuls count: the input
# embedding is a lookup, not a matmul, so its V x H parameters are not counted; norms, activations and the softmax
# are not either. Per trained token:
#   the layers: 2N forward + 2N backward, N their matmul weights (q k v o, gate up down; no embedding). PaLM's and
#     Chinchilla's 6N assume every weight is trained: 2N more for the weight gradients. Here the base weights are
#     frozen and only LoRA's factors get gradients, so those 2N never run and 6N would read 1.5x too high; LoRA's own
#     matmuls (about 2% at r=16) are left out.
#   the output head: 4 V H, for completion tokens only (the prompt's never reach it): the logits, and the gradient
#     that HeadLogprobs computes with them.
#   attention: 12 layers heads head_dim per causal (query, key) pair: QK^T and PV forward, their four gradients
#     backward, 2 FLOPs a multiply-add.
# Tokens are the completions' (mean length x 64, all of equal length here); the prompts, a few tokens each, are left
# out. The time is perf/fwd_bwd_s: the forward+backward only, no evaluation, rollout wait, audit or weight sync.
N = layers * (2 * H * H + 2 * H * d * c["num_key_value_heads"] + 3 * H * c["intermediate_size"])
peak = float("nan") if tiny else float(os.environ["SMOKE_PEAK_TFLOPS"]) * 1e12
print(f"{'step':>4} {'dt s':>7} {'fwd_bwd s':>9} {'eval s':>6} {'tokens':>7} {'tok/s':>8} {'MFU':>6} {'peak GB':>7} "
      f"{'ratio':>8} {'mismatch_kl':>11}")
mfus = []
for s in sorted(k for k in by_step if k > 0):
    epoch, r = by_step[s]
    L = r["completions/mean_length"]
    tokens, fb = 64 * L, r["perf/fwd_bwd_s"]  # 8 groups x G=8 completions
    mfu = (4 * N * tokens + 4 * V * H * tokens + 12 * layers * heads * d * 64 * L * (L + 1) / 2) / fb / peak
    if r is not next(x for x in lives[epoch] if x["step"] > 0):  # a life's first step warms up: not in the mean
        mfus.append(mfu)
    print(f"{s:>4} {r['perf/step_s'] - r.get('perf/eval_s', 0):>7.2f} {fb:>9.2f} {r.get('perf/eval_s', 0):>6.1f} "
          f"{tokens:>7.0f} {tokens / fb:>8.0f} {mfu:>6.1%} {r.get('perf/peak_mem_gb', 0):>7.1f} {r['ratio/mean']:>8.5f} "
          f"{r['health/mismatch_kl']:>11.2e}")
print(f"MFU {sum(mfus) / max(len(mfus), 1):.1%}, the mean over the steps that are not a life's first (4N a token, not "
      f"6N: the base weights are frozen); dt excludes the evaluation (perf/step_s - perf/eval_s), MFU and tok/s use "
      f"perf/fwd_bwd_s")
# perf/peak_mem_gb is torch.cuda.max_memory_allocated of the trainer's process: a running maximum since it started,
# so a step's value is training alone only while no evaluation has run in that life yet (the resumed life's first
# step). Where train.py resets it each step and logs perf/eval_peak_mem_gb apart, each is read as it is.
for epoch, rs in lives.items():
    steps, mem = [r["step"] for r in rs], [r["perf/peak_mem_gb"] for r in rs if "perf/peak_mem_gb" in r]
    if evals := [r["perf/eval_peak_mem_gb"] for r in rs if "perf/eval_peak_mem_gb" in r]:
        print(f"peak GB, trainer life {epoch} (steps {steps}): training {max(mem):.1f}, evaluation {max(evals):.1f}")
        continue
    evaluated, train_only = False, None
    for r in rs:
        evaluated |= "eval/accuracy" in r
        if "perf/peak_mem_gb" in r and not evaluated:
            train_only = max(train_only or 0.0, r["perf/peak_mem_gb"])
    print(f"peak GB, trainer life {epoch} (steps {steps}): {max(mem, default=0):.1f} with its evaluations; training "
          "alone " + ("not separable (it evaluated first)" if train_only is None else f"{train_only:.1f}"))
gen = [r for _, r in records("generate-")]
peaks = [g["perf/peak_mem_gb"] for g in gen if "perf/peak_mem_gb" in g]  # where generate.py logs it
print(f"generator: {len(gen)} batches, {sum(g['rollout/generated_tok_s'] for g in gen) / max(len(gen), 1):.0f} tok/s "
      f"mean, peak GB " + (f"{max(peaks):.1f}" if peaks else "not logged"))
print(f"model: {N / 1e9:.2f}B matmul parameters in the layers + {V * H / 1e9:.2f}B in the output head (the input "
      f"embedding not counted); step 1 ratio {by_step[1][1]['ratio/mean']:.5f}")
EOF
cat "$work/report.log"
[ "$failed" -eq 0 ] || die "a phase failed (its log is above); the rest ran"
say "done in ${SECONDS}s"
