"""Build the tiny built-in demo model: a Qwen2-architecture causal LM with its own character tokenizer, trained with
plain supervised learning on reverse_add until it is right only part of the time, so GRPO has room to improve it.

    python -m minigrpo.demo                      # rewrites minigrpo/demo_model/ (about 20-60 s on a laptop CPU)

Supervised learning on this task is a sharp phase transition: accuracy sits near 0 and then jumps. So the script
stops on a held-out accuracy band (pass@1 at temperature 1), not on a step count, and the result is shipped in
the repo: the demo's starting point does not depend on this machine's numerics.

The tokenizer is a real Qwen2Tokenizer over single characters with no BPE merges. That is on purpose: for a
`qwen2` model folder, AutoTokenizer builds a Qwen2Tokenizer from the vocab whatever tokenizer.json says, so any
other custom tokenizer would silently get other pre-tokenization and other ids. With no merges, BPE falls back
to one token per character, and the folder loads back exactly as it was saved (tests/test_demo.py checks it).
"""
import argparse
import random

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

from minigrpo.engine import SamplingParams, TorchEngine
from minigrpo.model import DEMO_MODEL
from minigrpo.tasks import ReverseAddition, score

CHARS = "0123456789+="


def build_tokenizer() -> Qwen2Tokenizer:
    """<|endoftext|> (id 0) is EOS and padding, as in Qwen base models; no BOS. The chat template only joins the
    messages' contents, so a templated prompt is the plain prompt: [{"role": "user", "content": "12+34="}] -> "12+34="."""
    tokenizer = Qwen2Tokenizer(vocab={"<|endoftext|>": 0} | {c: i + 1 for i, c in enumerate(CHARS)}, merges=[])
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tokenizer


def build_model(tokenizer, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=96, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return Qwen2ForCausalLM(config)


def accuracy(model, tokenizer, task, problems, seed=0) -> float:
    model.eval()
    engine = TorchEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    prompts = [tokenizer(p.prompt)["input_ids"] for p in problems]
    completions = engine.generate(prompts, SamplingParams(max_tokens=6, seed=seed))
    model.train()
    return sum(r[0] for r in score(task, tokenizer, problems, completions)) / len(problems)


def supervised_batch(tokenizer, task, rng, size):
    """Prompt + answer + EOS, right-padded, with the loss on the answer and EOS only (one token per character)."""
    rows = [task.sample(rng) for _ in range(size)]
    seqs = [tokenizer(p.prompt + p.answer)["input_ids"] + [tokenizer.eos_token_id] for p in rows]
    L = max(map(len, seqs))
    pad = lambda seq, fill: seq + [fill] * (L - len(seq))  # noqa: E731
    ids = torch.tensor([pad(s, tokenizer.pad_token_id) for s in seqs])
    labels = torch.tensor([pad([-100] * len(p.prompt) + s[len(p.prompt):], -100) for p, s in zip(rows, seqs)])
    return ids, labels


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEMO_MODEL)
    parser.add_argument("--band", type=float, nargs=2, default=(0.30, 0.50), help="stop inside this accuracy band")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max_steps", type=int, default=5000)
    args = parser.parse_args()

    torch.set_num_threads(1)  # one thread: the same numerics, so the same model, on any machine of this kind
    tokenizer, task, rng = build_tokenizer(), ReverseAddition(), random.Random(args.seed)
    model = build_model(tokenizer, args.seed)
    print(f"demo model: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(tokenizer)}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    probe, held_out = task.eval_problems(512)[:128], task.eval_problems(512)[128:]
    model.train()
    for step in range(1, args.max_steps + 1):
        ids, labels = supervised_batch(tokenizer, task, rng, 64)
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0:
            acc = accuracy(model, tokenizer, task, probe, seed=step)
            print(f"step {step} | loss {loss.item():.3f} | probe acc {acc:.2f}")
            if args.band[0] <= acc <= args.band[1]:
                final = accuracy(model, tokenizer, task, held_out)
                if args.band[0] <= final <= args.band[1]:
                    break
            if acc > args.band[1]:
                raise SystemExit(f"jumped past the band at step {step}; try a smaller --lr or another --seed")
    else:
        raise SystemExit(f"did not reach the band {args.band} in {args.max_steps} steps")
    model.save_pretrained(args.out)  # its generation_config takes EOS and padding from the model config
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out}: held-out pass@1 {final:.3f} at temperature 1 (step {step})")


if __name__ == "__main__":
    main()
