"""Build the tiny built-in demo model: a Qwen2-architecture causal LM with its own character tokenizer, trained with
plain supervised learning on reverse_add until it is right only part of the time, so GRPO has room to improve it.

    python -m minigrpo.tools.demo                      # rewrites minigrpo/demo_model/ (about 1-2 minutes on a laptop CPU)

Its heads are 32 wide (hidden 128 / 4 heads), a size vLLM's CPU and GPU attention take, so real vLLM serves it. Its
output head, which LoRA leaves frozen, is its own and starts at 4x the usual scale: README, "Remaking the demo model".
"""
import random

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

from minigrpo.engine import SamplingParams, TorchEngine
from minigrpo.model import DEMO_MODEL
from minigrpo.tasks import ReverseAddition

CHARS = "0123456789+="
ARCH = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, tie_word_embeddings=False)
SEED, LR, MAX_STEPS, HEAD_GAIN = 3, 2e-3, 5000, 4.0
PROBE = (0.15, 0.45)  # pass@1 at T=1 on 128 problems: learning is a sharp phase transition, so stop on a band
BAND = (0.26, 0.29)  # then train.py's step-0 eval (400 held-out problems), its mean over seeds 0-9, must land here


def build_tokenizer() -> Qwen2Tokenizer:
    """One token per character, no merges (README, "Remaking the demo model", says why). <|endoftext|> (id 0) is EOS
    and padding; no BOS. The chat template only joins the messages' contents: a templated prompt is the plain prompt."""
    tokenizer = Qwen2Tokenizer(vocab={"<|endoftext|>": 0} | {c: i + 1 for i, c in enumerate(CHARS)}, merges=[])
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tokenizer


def accuracy(model, tokenizer, task, problems, seed=0) -> float:
    """pass@1 at T=1 with train.py's draws: problem i samples with seed * 1_000_003 + i, up to 8 new tokens."""
    engine = TorchEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)  # dropout 0: no eval()
    prompts = [tokenizer(p.prompt)["input_ids"] for p in problems]
    params = [SamplingParams(max_tokens=8, seed=seed * 1_000_003 + i) for i in range(len(prompts))]
    texts = [tokenizer.decode(g[0].token_ids, skip_special_tokens=True) for g in engine.generate(prompts, params)]
    return sum(map(task.reward, texts, [p.answer for p in problems])) / len(problems)


def supervised_batch(tokenizer, task, rng, size):
    """Prompt + answer + EOS, right-padded, the loss on the answer and EOS only. Half the rows open with a wrong try
    (prompt, wrong answer, EOS), as --max_turns 2 asks again: without them it cannot read a problem after an answer."""
    seqs, labels, eos = [], [], tokenizer.eos_token_id
    for p in [task.sample(rng) for _ in range(size)]:  # all problems first: this rng order makes the shipped bytes
        one, head = tokenizer(p.prompt + p.answer)["input_ids"] + [eos], []
        if rng.random() < 0.5:
            wrong = str(rng.randrange(10, 200))
            head = tokenizer(p.prompt + (wrong if wrong != p.answer else wrong + "1"))["input_ids"] + [eos]
        seqs.append(head + one)
        labels.append([-100] * (len(head) + len(p.prompt)) + one[len(p.prompt):])
    pad = lambda lists, fill: pad_sequence([torch.tensor(x) for x in lists], True, fill)  # noqa: E731
    return pad(seqs, tokenizer.pad_token_id), pad(labels, -100)


def main():
    torch.set_num_threads(1)  # one thread: the same numerics, so the same model, on any machine of this kind
    tokenizer, task, rng, _ = build_tokenizer(), ReverseAddition(), random.Random(SEED), torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id, **ARCH))
    model.lm_head.weight.data.mul_(HEAD_GAIN)  # std 0.08: a sharper head, a higher ceiling (bench/demo_ceiling.py)
    print(f"demo model: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(tokenizer)}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    probe, held_out = task.eval_problems(528)[400:], task.eval_problems(400)  # the probe is not train.py's eval
    for step in range(1, MAX_STEPS + 1):  # a new module is in training mode
        ids, labels = supervised_batch(tokenizer, task, rng, 64)
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 5 == 0:
            acc = accuracy(model, tokenizer, task, probe, seed=step)
            print(f"step {step} | loss {loss.item():.3f} | probe acc {acc:.2f}")
            if acc > PROBE[1]:
                raise SystemExit(f"jumped past the band at step {step}; try a smaller LR or another SEED")
            if acc >= PROBE[0]:  # one seed's eval has a sampling sd of about 0.02: take ten
                final = sum(accuracy(model, tokenizer, task, held_out, seed=s) for s in range(10)) / 10
                if BAND[0] <= final <= BAND[1]:
                    break
    else:
        raise SystemExit(f"did not reach the band {BAND} in {MAX_STEPS} steps")
    model.save_pretrained(DEMO_MODEL)  # its generation_config takes EOS and padding from the model config
    tokenizer.save_pretrained(DEMO_MODEL, save_jinja_files=False)  # the chat template inside tokenizer_config.json
    print(f"saved to {DEMO_MODEL}: train.py's step-0 eval/accuracy {final:.3f} (mean of seeds 0-9; step {step})")


if __name__ == "__main__":
    main()
