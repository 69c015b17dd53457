"""The built-in generation engine (CPU or GPU): batched sampling over the LoRA-wrapped model with a KV cache. For
every sampled token it returns the behaviour log-probability, under the distribution it was actually drawn from:
log softmax(logits / temperature) in float32, after vLLM's sampling parameters in vLLM's order
(vllm/v1/sample/sampler.py), as `vllm serve --logprobs-mode processed_logprobs` reports it. The trainer reproduces
exactly that number, so at version 0 the ratio is 1. Every engine (remote.py has the others) offers:

    engine.load_adapter(version, path)        switch to a published adapter, between batches
    engine.generate(prompts, params)          -> list (per prompt) of lists (per sample) of Completion
"""
import inspect
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import DynamicCache

from minigrpo.lora import load_adapter


@dataclass
class SamplingParams:
    """Per request, as in vLLM. Row i of a request with a seed samples with seed + i (vLLM's n > 1 rule)."""
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # keep the fewest best tokens whose probability reaches top_p; 1 (off) for training
    seed: int | None = None  # None: the engine's own generator
    stop_token_ids: tuple = ()  # stop on these as well as on the model's EOS ids
    logprobs: int = 0  # also return this many top alternatives per token (the sampled token is always scored)
    stop: tuple = ()  # stop strings: the text ends before the first one that appears (needs the engine's decode)
    ignore_eos: bool = False  # keep going past the model's EOS ids
    min_tokens: int = 0  # stop ids are banned until this many tokens are out
    logit_bias: dict | None = None  # {token_id: bias} added to the logits
    repetition_penalty: float = 1.0  # > 1 discourages every token seen in the prompt or the output so far
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one


@dataclass
class Completion:
    token_ids: list[int]  # sampled tokens, the stop token included when one was sampled
    logprobs: list[float]  # behaviour log-prob of each sampled token
    finish_reason: str  # "stop" (a stop token was sampled) or "length" (hit max_tokens)
    top_logprobs: list[dict] | None = None  # per token {token_id: logprob} of the top alternatives, when asked
    stop_reason: int | str | None = None  # the stop_token_ids id or the stop string that ended it (None for EOS)
    text: str | None = None  # the text cut before the stop string, when one ended it
    adapter_digest: str = ""  # lora.adapter_digest of the weights that sampled it; "" for the base model


def per_row(rows, field: str, device, dtype=torch.float32) -> torch.Tensor:  # (B,)
    return torch.tensor([getattr(sp, field) for _, sp, _ in rows], dtype=dtype, device=device)


def renormalised(logp: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logp.masked_fill(drop, float("-inf")), -1)


class LogitProcessors:
    """A batch's raw logits (B, V) -> the log-probs its tokens are sampled from, in vLLM's order, each step built only
    when some row uses it:
        logits += logit_bias
        logits[stop ids] = -inf                          while fewer than min_tokens tokens are out
        logits /= rep  where seen and logits > 0, logits *= rep where seen and logits <= 0   (prompt and output)
        logits -= frequency_penalty * count + presence_penalty * (count > 0)                  (output only)
        logp = log_softmax(logits / temperature), then min_p and top_p (SamplingParams), each renormalised
    as vllm/model_executor/layers/utils.py (apply_penalties) and vllm/v1/sample/logits_processor/builtin.py do."""

    def __init__(self, rows, ids, mask, stops, V: int, device):  # ids, mask (B, L) the prompts, stops (B, S)
        B, column = len(rows), lambda field: per_row(rows, field, device)[:, None]  # (B, 1)
        self.bias = self.min_tokens = self.penalties = None
        if any(sp.logit_bias for _, sp, _ in rows):
            self.bias = torch.zeros(B, V, device=device)
            for r, (_, sp, _) in enumerate(rows):
                for t, b in (sp.logit_bias or {}).items():
                    self.bias[r, t] = b
        if any(sp.min_tokens for _, sp, _ in rows):
            self.min_tokens = column("min_tokens")
            self.ban = torch.zeros(B, V, device=device).scatter_add(1, stops.clamp(min=0), (stops >= 0).float()) > 0
        if any((sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty) != (1, 0, 0) for _, sp, _ in rows):
            self.penalties = [column(k) for k in ("repetition_penalty", "frequency_penalty", "presence_penalty")]
            self.in_prompt = torch.zeros(B, V, device=device).scatter_add(1, ids, mask.float()) > 0
            self.counts = torch.zeros(B, V, device=device)  # (B, V) occurrences in the output so far
        self.temperature = column("temperature").clamp(min=1e-6)  # 0 (greedy) as 1e-6
        self.min_p = column("min_p") if any(sp.min_p > 0 for _, sp, _ in rows) else None
        self.top_p = column("top_p") if any(sp.top_p < 1 for _, sp, _ in rows) else None

    def __call__(self, logits: torch.Tensor, t: int) -> torch.Tensor:  # (B, V) -> (B, V)
        if self.bias is not None:
            logits = logits + self.bias
        if self.min_tokens is not None:
            logits = logits.masked_fill(self.ban & (t < self.min_tokens), float("-inf"))
        if self.penalties is not None:
            rep, freq, presence = self.penalties
            penalty = torch.where(self.in_prompt | (self.counts > 0), rep, 1.0)
            logits = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = logits - freq * self.counts - presence * (self.counts > 0)
        logp = torch.log_softmax(logits / self.temperature, -1)
        if self.min_p is not None:
            p = logp.exp()
            logp = renormalised(logp, p < p.max(-1, keepdim=True).values * self.min_p)
        if self.top_p is not None:
            sorted_lp, order = logp.sort(-1, descending=True)  # (B, V)
            mass_before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()  # (B, V) probability of the better tokens
            drop = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, order, mass_before >= self.top_p)
            logp = renormalised(logp, drop & (self.top_p < 1))
        return logp

    def observe(self, tok: torch.Tensor, alive: torch.Tensor):
        if self.penalties is not None:
            self.counts.scatter_add_(1, tok[:, None], alive[:, None].float())


class TorchEngine:
    def __init__(self, model, stop_ids: list[int], pad_id: int, seed: int = 0, decode=None):
        self.model, self.stop_ids, self.pad_id, self.decode = model, list(stop_ids), pad_id, decode
        self.device = next(model.parameters()).device
        self.rng = torch.Generator(self.device).manual_seed(seed)  # for rows without a seed of their own
        self.version, self.digest = None, ""  # adapter version now loaded, and its digest
        # transformers >= 5.24 takes the KV cache as `cache=`; the 5.20 line that vllm pins only `past_key_values=`
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def load_adapter(self, version: int, path: str):
        self.digest, self.version = load_adapter(self.model, path), version

    def _forward(self, ids, mask, pos, cache):
        return self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                          **{self.cache_kw: cache}).logits[:, -1].float()  # (B, V)

    def _noise(self, gens, B, V):
        """Gumbel noise (B, V): argmax(logp + noise) samples softmax(logp). Seeded rows draw from their own stream."""
        u = torch.rand(B, V, generator=self.rng, device=self.device)
        for i, g in gens.items():
            u[i] = torch.rand(V, generator=g, device=self.device)
        return -torch.log(-torch.log(u.clamp(1e-20, 1 - 1e-7)))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params) -> list[list[Completion]]:
        """Sample params.n completions for each prompt (token ids), all in one batch; params may differ per prompt."""
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        rows = [(p, sp, i) for p, sp in zip(prompts, params) for i in range(sp.n)]  # prompt-major, as vLLM orders
        unique = {}  # each distinct prompt is prefilled once; its rows start from copies of its KV cache
        src = torch.tensor([unique.setdefault(tuple(p), len(unique)) for p, _, _ in rows], device=self.device)  # (B,)
        B, L = len(rows), max(map(len, unique))  # left-pad: every row's next token is in the last column
        ids = torch.tensor([[self.pad_id] * (L - len(p)) + list(p) for p in unique], device=self.device)  # (U, L)
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in unique], device=self.device)  # (U, L)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (U, L) positions ignore the padding
        noisy = per_row(rows, "temperature", self.device)[:, None] > 0  # (B, 1) temperature 0: greedy, no noise
        limit = per_row(rows, "max_tokens", self.device, torch.long)
        stop_ids = [list(sp.stop_token_ids) + ([] if sp.ignore_eos else self.stop_ids) for _, sp, _ in rows]
        stops = pad_sequence([torch.tensor(s, dtype=torch.long) for s in stop_ids], True, -1).to(self.device)  # (B, S)
        gens = {r: torch.Generator(self.device).manual_seed(sp.seed + i) for r, (_, sp, i) in enumerate(rows)
                if sp.seed is not None}
        k = max(sp.logprobs for _, sp, _ in rows)
        cache = DynamicCache()

        logits = self._forward(ids, mask, pos, cache)[src]  # (B, V)
        cache.reorder_cache(src)
        ids, mask, pos = ids[src], mask[src], pos[src]  # (B, L)
        process = LogitProcessors(rows, ids, mask, stops, logits.shape[1], self.device)
        texts = StopStrings(rows, self.decode)
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        tokens, logps, alive, tops = [], [], [], []
        for t in range(int(limit.max())):
            logp_all = process(logits, t)  # (B, V) what is sampled from
            tok = (logp_all + self._noise(gens, *logp_all.shape) * noisy).argmax(-1)  # (B,) the Gumbel-max trick
            tokens.append(tok)
            logps.append(logp_all.gather(1, tok[:, None]).squeeze(1))
            if k:
                tops.append(logp_all.topk(k, -1))
            alive.append(~done)  # a row keeps its tokens up to its first stop, or up to its limit
            process.observe(tok, ~done)
            hit = (tok[:, None] == stops).any(1)
            hit |= texts.check(tokens, hit | done, t)
            done |= hit | (t + 1 >= limit)
            if bool(done.all()):
                break
            mask = torch.cat([mask, mask.new_ones(B, 1)], 1)
            pos = pos[:, -1:] + 1
            logits = self._forward(tok[:, None], mask, pos, cache)

        tokens, logps = torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist()  # (B, T)
        out = []
        for r, ((_, sp, _), n) in enumerate(zip(rows, torch.stack(alive, 1).sum(1).tolist())):
            top = [dict(zip(tops[t].indices[r].tolist(), tops[t].values[r].tolist())) for t in range(n)] if k else None
            last = tokens[r][n - 1]  # a row that stopped ended on a stop id or a stop string ("abort": scheduler.py)
            finish = "stop" if last in stop_ids[r] or r in texts.reason else "length"
            reason = texts.reason.get(r, last if last in sp.stop_token_ids else None)
            out.append(Completion(tokens[r][:n], logps[r][:n], finish, top, reason, texts.text.get(r), self.digest))
        completions = iter(out)
        return [[next(completions) for _ in range(sp.n)] for sp in params]


class StopStrings:
    """As vLLM's detokenizer (vllm/v1/engine/detokenizer.py, check_stop_strings): past min_tokens, the new characters
    are searched for each string; a hit ends the row (tokens kept) and cuts its text before the string."""

    def __init__(self, rows, decode):
        self.rows = {r: sp for r, (_, sp, _) in enumerate(rows) if sp.stop}
        if self.rows and decode is None:
            raise ValueError("stop strings need an engine built with decode= (token ids -> text)")
        self.decode, self.seen, self.reason, self.text = decode, {r: "" for r in self.rows}, {}, {}

    def check(self, tokens, ended: torch.Tensor, t: int) -> torch.Tensor:  # (B,) rows now holding a stop string
        hit = torch.zeros_like(ended)
        if not self.rows:  # nothing to decode: no copy to the host in the sampling loop
            return hit
        ended, ids = ended.tolist(), torch.stack(tokens, 1).tolist()  # (B, t+1)
        for r, sp in self.rows.items():
            if ended[r]:
                continue
            text = self.decode(ids[r])
            new, self.seen[r] = len(text) - len(self.seen[r]), text
            for s in sp.stop if t + 1 > sp.min_tokens else ():
                i = text.find(s, max(0, len(text) + 1 - new - len(s)))
                if i >= 0:
                    hit[r], self.reason[r], self.text[r] = True, s, text[:i]
                    break
        return hit
