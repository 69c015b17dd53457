"""What fits on one GPU: the trainer's memory per token, with and without gradient checkpointing, and evaluation's
KV cache per token, as formulas over a model's shape, for the Qwen2.5 shapes the recipes use (DeepSeek-R1-Distill-
Qwen and Qwen2.5-Math share them). An estimate from the architecture, not a measurement: bench/gpu_smoke.sh measures
the peaks on a GPU, and no GPU has run it yet. Nothing is downloaded: the shapes are the models' published configs.

    python bench/memory_table.py

The formulas, in bytes, for bf16 weights (2 bytes a number), L layers, hidden h, MLP width i, KV width k (KV heads x
head size) and P parameters; one token of a packed micro-batch:
    weights                  2 P                                   (replicated on every rank; LoRA and AdamW: < 1%)
    activations, plain       L x 2 (6h + 2k + 4i) + 4h             (what backward keeps: the inputs of each norm,
                                                                     projection and activation; SDPA keeps no scores;
                                                                     4h: the float32 head gradient, minigrpo/model.py)
    activations, checkpoint  L x 2h + 2 (6h + 2k + 4i) + 4h        (each layer's input, and one layer recomputed)
    evaluation KV cache      L x 2 x 2k                            (keys and values; --eval_batch_tokens of them)
The trainer needs weights + micro_batch_tokens x activations (evaluation runs between steps, so its KV cache and the
activations are not held at once); 10% is left to the allocator and CUDA's own use.
"""
from common import report

MODELS = {  # layers, hidden, MLP width, KV heads, head size, vocabulary, tied embeddings (the Hub configs)
    "R1-Distill-Qwen-1.5B": (28, 1536, 8960, 2, 128, 151936, False),  # Qwen2.5-1.5B's shape, untied head
    "Qwen2.5-7B": (28, 3584, 18944, 4, 128, 152064, False),
    "Qwen2.5-14B": (48, 5120, 13824, 8, 128, 152064, False),
    "Qwen2.5-32B": (64, 5120, 27648, 8, 128, 152064, False),
}
GB, USABLE = 1e9, 0.9


def sizes(L, h, i, kv_heads, head, vocab, tied) -> dict:
    k = kv_heads * head
    layer = 2 * h * h + 2 * h * k + 3 * h * i  # q, o; k, v; gate, up, down (biases and norms: under 0.1%)
    params = L * layer + vocab * h * (1 if tied else 2)
    per_layer_act = 2 * (6 * h + 2 * k + 4 * i)
    return {"params_B": params / 1e9, "weights_GB": 2 * params / GB, "act_MB_tok": (L * per_layer_act + 4 * h) / 1e6,
            "act_ckpt_MB_tok": (L * 2 * h + per_layer_act + 4 * h) / 1e6, "kv_KB_tok": L * 2 * 2 * k / 1e3}


if __name__ == "__main__":
    rows = []
    for name, shape in MODELS.items():
        s = sizes(*shape)
        row = {"model": name, "params": f"{s['params_B']:.2f}B", "weights": f"{s['weights_GB']:.1f} GB",
               "act/token": f"{s['act_MB_tok']:.2f} MB", "ckpt act/token": f"{s['act_ckpt_MB_tok']:.2f} MB",
               "eval KV/token": f"{s['kv_KB_tok']:.0f} KB"}
        for gpu in (80, 141):
            free = gpu * USABLE - s["weights_GB"]
            plain, ckpt = (max(0, int(free * GB / (s[k] * 1e6))) for k in ("act_MB_tok", "act_ckpt_MB_tok"))
            row[f"{gpu} GB: tokens/micro-batch (plain, ckpt)"] = f"{plain:,}, {ckpt:,}" if free > 0 else "does not fit"
            row[f"{gpu} GB: eval KV tokens"] = f"{max(0, int(free * GB / (s['kv_KB_tok'] * 1e3))):,}"
        rows.append(row)
    report("memory_table", rows, notes="an estimate from the shapes (bench/memory_table.py's docstring has the "
           "formulas), bf16 weights, one GPU per trainer rank, 90% of its memory usable; not a measurement")
