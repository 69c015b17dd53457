"""How sharp can the demo model get? LoRA trains only the attention and MLP projections (minigrpo/lora.py), so the
output head W (the demo's is its own matrix, not the embeddings) and the final RMSNorm's gain g stay frozen.
Whatever LoRA does below that norm, the last hidden state is g * x with x of norm sqrt(hidden), and the logits are
W (g * x): a token's probability can only rise as far as that sphere allows. This finds, for each token, the highest
probability any such hidden state gives it (gradient ascent over the sphere, 3 starts), then the highest held-out
pass@1 at T=1 those allow: the mean over problems of the product over each answer's tokens and EOS. With a tied
head, W is the embedding matrix, and the same bound holds.

With --adapter, it also scores that adapter on the same problems: greedy, and at T=1 with --samples draws per
problem (how far it is from sampling what it knows).

    python bench/demo_ceiling.py                                  # ~1 minute
    python bench/demo_ceiling.py --adapter runs/long/adapters/policy-<run id>-v003000
"""
import argparse
import math

import torch

from common import report
from minigrpo.engine import SamplingParams, TorchEngine
from minigrpo.lora import inject_lora, load_adapter
from minigrpo.model import load_model, stop_token_ids
from minigrpo.run import RunSettings
from minigrpo.tasks import ReverseAddition, prompt_ids


def best_probability(E, g, y: int, starts: int = 3, iters: int = 2000) -> float:
    """max over x with |x| = sqrt(H) of softmax(E (g * x))[y]."""
    best = 0.0
    for s in range(starts):
        u = torch.randn(E.shape[1], generator=torch.Generator().manual_seed(s)).requires_grad_()
        opt = torch.optim.Adam([u], lr=0.05)
        for _ in range(iters):
            logp = torch.log_softmax(E @ (g * u / u.norm() * E.shape[1] ** 0.5), -1)[y]
            opt.zero_grad()
            (-logp).backward()
            opt.step()
        best = max(best, logp.exp().item())
    return best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--adapter", default="", help="also score this adapter: greedy and at T=1")
    p.add_argument("--samples", type=int, default=32, help="draws per problem at T=1 for --adapter")
    p.add_argument("--eval_size", type=int, default=400, help="held-out problems (train.py's default)")
    args = p.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model("demo", torch.device("cpu"))
    E, g = model.get_output_embeddings().weight, model.model.norm.weight  # the head W and the gain: both frozen
    top = {y: best_probability(E, g, y) for y in range(E.shape[0])}
    task, run = ReverseAddition(), RunSettings()
    problems = task.eval_problems(args.eval_size)
    answers = [tokenizer(p.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for p in problems]
    rows = [{"token": repr(tokenizer.decode([y])), "highest_probability": top[y]} for y in top]
    extra = {"pass@1_T1_bound": sum(math.prod(top[t] for t in a) for a in answers) / len(answers)}
    if args.adapter:
        inject_lora(model, run.lora_r, run.lora_alpha, run.lora_targets)
        load_adapter(model, args.adapter)
        engine = TorchEngine(model, stop_token_ids(model, tokenizer), tokenizer.pad_token_id, seed=0)
        prompts = [prompt_ids(tokenizer, p.prompt) for p in problems]
        for name, sp in (("greedy", SamplingParams(max_tokens=run.max_new_tokens, temperature=0)),
                         ("T1", SamplingParams(n=args.samples, max_tokens=run.max_new_tokens))):
            outs = engine.generate(prompts, sp)
            extra[f"adapter_pass@1_{name}"] = sum(task.reward(tokenizer.decode(c.token_ids, skip_special_tokens=True),
                                                              p.answer) for p, cs in zip(problems, outs) for c in cs
                                                  ) / (len(problems) * sp.n)
    report("demo_ceiling", rows, "  ".join(f"{k} {v:.3f}" for k, v in extra.items()) + f"  ({args.eval_size} held-out "
           f"problems; a bound for any weights below the final norm, as far as the ascent finds each maximum)", extra | {"adapter": args.adapter})


if __name__ == "__main__":
    main()
