#!/usr/bin/env bash
# The prepared GPU check, in one call: a randomly initialised Qwen2 model of DeepSeek-R1-Distill-Qwen-1.5B's shape is
# built locally (nothing is downloaded), then generate.py --engine torch and train.py run side by side in bf16 for a
# few steps with an evaluation and a checkpoint; the trainer is killed right after that checkpoint (MINIGRPO_FAULT)
# and resumed from it. At the end it prints, per step: step time, trained tokens/s, the trainer's MFU, peak GPU
# memory, the ratio and health/mismatch_kl; and the generator's tokens/s.
#
#   bash bench/gpu_smoke.sh            # one GPU with ~20 GB free: about 5 minutes on an H200
#   bash bench/gpu_smoke.sh --tiny     # a CPU dry run with tiny shapes, so the script cannot rot (tests/test_gpu_smoke.py)
#
# Needs what requirements.txt installs, except that math-verify is not used (the task is the demo's reverse_add).
# The random model never says EOS, so every completion runs to --max_new_tokens: reasoning-length sequences.
set -euo pipefail
cd "$(dirname "$0")/.."
# nothing may reach the network (a machine without one can hang on a connect), and every phase has a deadline, so a
# hang is a line in the log, not a silent timeout of the whole call
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
limit=${SMOKE_PHASE_TIMEOUT_S:-300}
python() { timeout "$limit" python3 "$@"; }  # python3: a bare machine may have no `python`
echo "gpu_smoke: $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
tiny=${1:-}
work=${SMOKE_DIR:-$(mktemp -d)}
if [ "$tiny" = "--tiny" ]; then
  device=cpu; steps=4; new=16; eval_size=8
else
  device=cuda; steps=4; new=${SMOKE_NEW_TOKENS:-1024}; eval_size=64
fi
python - "$work/model" "$tiny" <<'EOF'
import shutil, sys
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from minigrpo.model import DEMO_MODEL
out, tiny = sys.argv[1], sys.argv[2] == "--tiny"
shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=1024) if tiny else dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
             num_attention_heads=12, num_key_value_heads=2, vocab_size=151936)  # R1-Distill-Qwen-1.5B's shape
torch.manual_seed(0)
with torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu"):  # a GPU initialises 1.5B in seconds
    model = Qwen2ForCausalLM(Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=False,
                                         eos_token_id=0, pad_token_id=0))
model.to(torch.bfloat16).save_pretrained(out)
for f in ("tokenizer.json", "tokenizer_config.json"):  # the demo's character tokenizer: reverse_add's prompts
    shutil.copy(f"{DEMO_MODEL}/{f}", out)
print(f"built {out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")
EOF
run=(--model "$work/model" --run_dir "$work/run" --max_new_tokens "$new" --group_size 8 --lora_r 16 --lora_alpha 32)
timeout $((3 * limit)) python3 generate.py "${run[@]}" --device "$device" --dtype bfloat16 --prompts_per_batch 8 --max_ready 16 \
  > "$work/generate.log" 2>&1 &
gen=$!
trap 'kill $gen 2>/dev/null || true' EXIT
train=(train.py "${run[@]}" --device "$device" --dtype bfloat16 --max_steps "$steps" --groups_per_step 8 --save_every 2
       --eval_every 2 --eval_size "$eval_size" --eval_batch_size 32 --micro_batch_tokens 16384 --lr 1e-5
       --loss_type dr_grpo)  # the math recipes' loss: it trains every group (dapo would drop a random model's all-zero ones)
MINIGRPO_FAULT=after_checkpoint:2 python "${train[@]}" > "$work/train.log" 2>&1 || [ $? -eq 137 ]
grep -q "MINIGRPO_FAULT" "$work/train.log" || { cat "$work/train.log"; echo "the trainer did not stop at its fault"; exit 1; }
python "${train[@]}" >> "$work/train.log" 2>&1 || { cat "$work/train.log"; exit 1; }
wait $gen || { cat "$work/generate.log"; exit 1; }
grep -E "^(step|resumed|trainer on)" "$work/train.log" | cut -c1-200
python - "$work" <<'EOF'
import json, sys
import torch
from minigrpo.run import read_records
from minigrpo.storage import Storage
from safetensors import safe_open
storage = Storage(f"{sys.argv[1]}/run")
by_step = {r["step"]: r for r in read_records(storage, "train") if type(r.get("step")) is int}  # the newest life's
steps = [by_step[s] for s in sorted(by_step) if s > 0]
with open(f"{sys.argv[1]}/model/config.json") as f:
    c = json.load(f)
n = sum(p for p in (c["vocab_size"] * c["hidden_size"] * 2, c["num_hidden_layers"] * (
    c["hidden_size"] * c["hidden_size"] * 2 + c["hidden_size"] * c["hidden_size"] // c["num_attention_heads"]
    * c["num_key_value_heads"] * 2 + 3 * c["hidden_size"] * c["intermediate_size"])))
peak = 989e12 if torch.cuda.is_available() else float("nan")  # dense bf16 of an H100/H200 (SXM)
print(f"{'step':>4} {'dt s':>7} {'fwd_bwd s':>9} {'tokens':>7} {'tok/s':>8} {'MFU':>6} {'peak GB':>7} {'ratio':>8} "
      f"{'mismatch_kl':>11}")
for r in steps:
    tokens = r["completions/mean_length"] * 64  # 8 groups x G=8 completions
    mfu = 4 * n * tokens / r["perf/fwd_bwd_s"] / peak  # forward 2N + backward through frozen weights 2N per token
    print(f"{r['step']:>4} {r['perf/step_s']:>7.2f} {r['perf/fwd_bwd_s']:>9.2f} {tokens:>7.0f} "
          f"{tokens / r['perf/fwd_bwd_s']:>8.0f} {mfu:>6.1%} {r.get('perf/peak_mem_gb', 0):>7.1f} "
          f"{r['ratio/mean']:>8.5f} {r['health/mismatch_kl']:>11.2e}")
gen = read_records(storage, "generate-")
print(f"generator: {len(gen)} batches, {sum(g['rollout/generated_tok_s'] for g in gen) / len(gen):.0f} tok/s mean")
print(f"model: {n / 1e9:.2f}B parameters in matrices; step 1 ratio {steps[0]['ratio/mean']:.5f}; "
      f"steps {[r['step'] for r in steps]}")
EOF
