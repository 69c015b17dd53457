"""Generation engines. Each one samples n completions per prompt with the current adapter and returns, for every
sampled token, its behaviour log-probability: log softmax(logits / temperature), in float32, the distribution the
token was actually drawn from. The trainer reproduces exactly that number, so at version 0 the ratio is 1.

    engine.load_adapter(version, path)        switch to a published adapter, between batches
    engine.generate(prompts, params)          -> list (per prompt) of lists (per sample) of Completion

TorchEngine is built in (CPU or GPU): batched sampling over the LoRA-wrapped model with a KV cache.
"""
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from minigrpo.lora import load_adapter


@dataclass
class SamplingParams:
    """Per request, as in vLLM. Row i of a request with a seed samples with seed + i (vLLM's n > 1 rule)."""
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # keep 1 for training: the trainer reproduces plain temperature sampling only
    seed: int | None = None  # None: the engine's own generator
    stop_token_ids: tuple = ()  # stop on these as well as on the model's EOS ids
    logprobs: int = 0  # also return this many top alternatives per token (the sampled token is always scored)


@dataclass
class Completion:
    token_ids: list[int]  # sampled tokens, the stop token included when one was sampled
    logprobs: list[float]  # behaviour log-prob of each sampled token
    finish_reason: str  # "stop" (a stop token was sampled) or "length" (hit max_tokens)
    top_logprobs: list[dict] | None = None  # per token {token_id: logprob} of the top alternatives, when asked
    adapter_digest: str = ""  # digest of the adapter weights that sampled it, when the sampler knows it


def nucleus(logp: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p: keep the smallest set of tokens whose probability reaches top_p, renormalised. logp (B, V), top_p (B,)."""
    sorted_lp, order = logp.sort(-1, descending=True)  # (B, V)
    mass_before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()  # (B, V) probability of the better tokens
    drop = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, order, mass_before >= top_p[:, None])
    drop &= (top_p < 1)[:, None]
    return torch.log_softmax(logp.masked_fill(drop, float("-inf")), -1)


class TorchEngine:
    def __init__(self, model, stop_ids: list[int], pad_id: int, seed: int = 0):
        self.model, self.stop_ids, self.pad_id = model, list(stop_ids), pad_id
        self.device = next(model.parameters()).device
        self.rng = torch.Generator(self.device).manual_seed(seed)  # for rows without a seed of their own
        self.version = None  # adapter version now loaded
        # transformers >= 5.24 takes the KV cache as `cache=`; the 5.20 line that vllm pins only `past_key_values=`
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def load_adapter(self, version: int, path: str):
        load_adapter(self.model, path)
        self.version = version

    def _forward(self, ids, mask, pos, cache):
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         logits_to_keep=1, **{self.cache_kw: cache})
        return out.logits[:, -1].float()  # (B, V)

    def _noise(self, gens, B, V):
        """Gumbel noise (B, V): argmax(logp + noise) is a sample from softmax(logp). Seeded rows get their own
        stream, so a request's sample does not depend on what it was batched with."""
        u = torch.rand(B, V, generator=self.rng, device=self.device)
        for i, g in gens.items():
            u[i] = torch.rand(V, generator=g, device=self.device)
        return -torch.log(-torch.log(u.clamp(1e-20, 1 - 1e-7)))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params) -> list[list[Completion]]:
        """Sample params.n completions for each prompt (token ids), all in one batch; params may differ per prompt."""
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        rows = [(p, sp, i) for p, sp in zip(prompts, params) for i in range(sp.n)]  # prompt-major, as vLLM orders
        B, L = len(rows), max(len(p) for p, _, _ in rows)
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for r, (p, _, _) in enumerate(rows):  # left-pad so every row's next token sits in the last column
            ids[r, L - len(p):], mask[r, L - len(p):] = torch.tensor(p), 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, L) positions ignore the padding
        col = lambda f, dtype=torch.float32: torch.tensor([f(sp) for _, sp, _ in rows], dtype=dtype, device=self.device)
        temp, top_p, limit = col(lambda sp: sp.temperature), col(lambda sp: sp.top_p), col(lambda sp: sp.max_tokens, torch.long)
        greedy, temp, use_top_p = temp == 0, temp.clamp(min=1e-6), bool((top_p < 1).any())  # sorting V costs
        stops = [self.stop_ids + list(sp.stop_token_ids) for _, sp, _ in rows]
        stops = torch.tensor([s + [-1] * (max(map(len, stops)) - len(s)) for s in stops], device=self.device)  # (B, S)
        gens = {r: torch.Generator(self.device).manual_seed(sp.seed + i) for r, (_, sp, i) in enumerate(rows)
                if sp.seed is not None}
        k = max(sp.logprobs for _, sp, _ in rows)
        cache = DynamicCache()

        logits = self._forward(ids, mask, pos, cache)  # (B, V)
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        stopped = torch.zeros_like(done)
        tokens, logps, alive, tops = [], [], [], []
        for t in range(int(limit.max())):
            logp_all = torch.log_softmax(logits / temp[:, None], -1)  # (B, V) what is sampled from
            if use_top_p:
                logp_all = nucleus(logp_all, top_p)
            sampled = (logp_all + self._noise(gens, *logp_all.shape)).argmax(-1)  # (B,)
            tok = torch.where(greedy, logp_all.argmax(-1), sampled)
            tokens.append(tok)
            logps.append(logp_all.gather(1, tok[:, None]).squeeze(1))
            if k:
                tops.append(logp_all.topk(k, -1))
            alive.append(~done)
            hit = (tok[:, None] == stops).any(1) & ~done
            stopped |= hit
            done |= hit | (t + 1 >= limit)
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=self.device)], 1)
            pos = pos[:, -1:] + 1
            logits = self._forward(tok[:, None], mask, pos, cache)

        tokens, logps = torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist()  # (B, T)
        lengths = torch.stack(alive, 1).sum(1).tolist()  # tokens up to the first stop or the row's limit
        stopped = stopped.tolist()
        out = []
        for r, n in enumerate(lengths):
            top = [dict(zip(tops[t].indices[r].tolist(), tops[t].values[r].tolist())) for t in range(n)] if k else None
            out.append(Completion(tokens[r][:n], logps[r][:n], "stop" if stopped[r] else "length", top))
        starts = [0]
        for sp in params:
            starts.append(starts[-1] + sp.n)
        return [out[a:b] for a, b in zip(starts, starts[1:])]
