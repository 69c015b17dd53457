"""Generation engines. Each one samples n completions per prompt with the current adapter and returns, for every
sampled token, its behaviour log-probability: log softmax(logits / temperature), in float32, the distribution the
token was actually drawn from. The trainer reproduces exactly that number, so at version 0 the ratio is 1.

    engine.load_adapter(version, path)        switch to a published adapter, between batches
    engine.generate(prompts, n, ...)          -> list (per prompt) of lists (per sample) of Completion

TorchEngine is built in (CPU or GPU): batched sampling over the LoRA-wrapped model with a KV cache.
"""
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from minigrpo.lora import load_adapter


@dataclass
class Completion:
    token_ids: list[int]  # sampled tokens, the stop token included when one was sampled
    logprobs: list[float]  # behaviour log-prob of each sampled token
    finish_reason: str  # "stop" (a stop token was sampled) or "length" (hit max_new_tokens)


class TorchEngine:
    def __init__(self, model, stop_ids: list[int], pad_id: int):
        self.model, self.stop_ids, self.pad_id = model, stop_ids, pad_id
        self.device = next(model.parameters()).device
        self.version = None  # adapter version now loaded
        # transformers >= 5.24 takes the KV cache as `cache=`; the 5.20 line that vllm pins only `past_key_values=`
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def load_adapter(self, version: int, path: str):
        load_adapter(self.model, path)
        self.version = version

    def _forward(self, ids, mask, pos, cache, keep=1):
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         logits_to_keep=keep, **{self.cache_kw: cache})
        return out.logits[:, -1].float()  # (B, V)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float = 1.0,
                 seed: int | None = None, stop_token_ids=()) -> list[list[Completion]]:
        """Sample n completions for each prompt (token ids), all in one batch. temperature 0 is greedy."""
        rows = [p for p in prompts for _ in range(n)]  # prompt-major, as vLLM orders choices
        B, L = len(rows), max(len(p) for p in rows)
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for i, p in enumerate(rows):  # left-pad so every row's next token sits in the last column
            ids[i, L - len(p):], mask[i, L - len(p):] = torch.tensor(p), 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, L) positions ignore the padding
        stops = torch.tensor(sorted(set(self.stop_ids) | set(stop_token_ids)), device=self.device)
        gen = torch.Generator(self.device).manual_seed(seed) if seed is not None else None
        cache = DynamicCache()

        logits = self._forward(ids, mask, pos, cache)  # (B, V)
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        tokens, logps, alive = [], [], []
        for t in range(max_new_tokens):
            if temperature > 0:
                logp_all = torch.log_softmax(logits / temperature, -1)  # (B, V)
                tok = torch.multinomial(logp_all.exp(), 1, generator=gen).squeeze(1)  # (B,)
            else:
                logp_all = torch.log_softmax(logits, -1)
                tok = logp_all.argmax(-1)
            tokens.append(tok)
            logps.append(logp_all.gather(1, tok[:, None]).squeeze(1))
            alive.append(~done)
            done = done | torch.isin(tok, stops)
            if bool(done.all()) or t == max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=self.device)], 1)
            pos = pos[:, -1:] + 1
            logits = self._forward(tok[:, None], mask, pos, cache)

        tokens, logps = torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist()  # (B, T)
        lengths = torch.stack(alive, 1).sum(1).tolist()  # tokens up to and including the first stop
        stopped = done.tolist()
        out = [Completion(tokens[i][:k], logps[i][:k], "stop" if stopped[i] else "length")
               for i, k in enumerate(lengths)]
        return [out[i * n:(i + 1) * n] for i in range(len(prompts))]
