"""The replica server's sampling: vLLM's sampling parameters beyond the core engine's temperature, seed and EOS, as a
subclass of engine.Sampler. In vLLM's order (vllm/model_executor/layers/utils.py apply_penalties, vllm/v1/sample:
logits_processor/builtin.py, ops/topk_topp_sampler.py; vllm/v1/engine/detokenizer.py check_stop_strings), each step
built only when some row of the batch uses it:
    logits += logit_bias
    logits[stop ids] = -inf                          while fewer than min_tokens tokens are out
    logits /= rep  where seen and logits > 0, logits *= rep where seen and logits <= 0   (prompt and output)
    logits -= frequency_penalty * count + presence_penalty * (count > 0)                  (output only)
    logp = log_softmax(logits / temperature), then min_p and top_p, each renormalised
Past min_tokens, a stop string in the new text ends the row (its tokens kept) and cuts the text before it.
"""
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from minigrpo.engine import Completion, Sampler, SamplingParams, TorchEngine, per_row


@dataclass
class ServerParams(SamplingParams):
    stop_token_ids: tuple = ()  # stop on these as well as on the model's EOS ids
    logprobs: int = 0  # also return this many top alternatives per token (the sampled token is always scored)
    stop: tuple = ()  # stop strings
    ignore_eos: bool = False  # keep going past the model's EOS ids
    min_tokens: int = 0  # stop ids are banned until this many tokens are out
    logit_bias: dict | None = None  # {token_id: bias} added to the logits
    repetition_penalty: float = 1.0  # > 1 discourages every token seen in the prompt or the output so far
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    top_p: float = 1.0  # keep the fewest best tokens whose probability reaches top_p (training never sets it)


@dataclass
class Choice(Completion):
    top_logprobs: list[dict] | None = None  # per token {token_id: logprob} of the top alternatives, when asked
    stop_reason: int | str | None = None  # the stop_token_ids id or the stop string that ended it (None for EOS)
    text: str | None = None  # the text cut before the stop string, when one ended it


class VllmSampler(Sampler):
    def __init__(self, rows, ids, mask, eos: list[int], decode, V: int, device):  # ids, mask (B, L): the prompts
        super().__init__(rows, eos, device)
        B, column = len(rows), lambda field: per_row(rows, field, device)[:, None]  # (B, 1)
        stop_ids = [torch.tensor(list(sp.stop_token_ids) + ([] if sp.ignore_eos else eos)).long() for _, sp, _ in rows]
        self.stops = pad_sequence(stop_ids, True, V).to(device)  # (B, S) each row's stops, padded with V: not a token
        self.rows, self.eos, self.bias, self.min_tokens, self.penalties = rows, eos, None, None, None
        if any(sp.logit_bias for _, sp, _ in rows):
            bias = torch.zeros(B, V)  # filled on the host, copied once
            for r, (_, sp, _) in enumerate(rows):
                for t, b in (sp.logit_bias or {}).items():
                    bias[r, t] = b
            self.bias = bias.to(device)
        if any(sp.min_tokens for _, sp, _ in rows):
            self.min_tokens = column("min_tokens")
            self.ban = torch.zeros(B, V + 1, dtype=torch.bool, device=device).scatter(1, self.stops, True)[:, :V]
        if any((sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty) != (1, 0, 0) for _, sp, _ in rows):
            self.penalties = [column(k) for k in ("repetition_penalty", "frequency_penalty", "presence_penalty")]
            self.in_prompt = torch.zeros(B, V, device=device).scatter_add(1, ids, mask.float()) > 0
            self.counts = torch.zeros(B, V, device=device)  # (B, V) occurrences in the output so far
        self.min_p = column("min_p") if any(sp.min_p > 0 for _, sp, _ in rows) else None
        self.top_p = column("top_p") if any(sp.top_p < 1 for _, sp, _ in rows) else None
        self.k, self.tops = max(sp.logprobs for _, sp, _ in rows), []
        self.strings = {r: sp.stop for r, (_, sp, _) in enumerate(rows) if sp.stop}
        self.decode, self.seen, self.reason, self.text = decode, {r: "" for r in self.strings}, {}, {}

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
            logp = torch.log_softmax(logp.masked_fill(p < p.max(-1, keepdim=True).values * self.min_p, -torch.inf), -1)
        if self.top_p is not None:  # a token goes once the better ones hold top_p; rows at 1 keep every token
            sorted_lp, order = logp.sort(-1, descending=True)  # (B, V)
            mass_before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()  # (B, V) probability of the better tokens
            drop = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, order, mass_before >= self.top_p)
            logp = torch.log_softmax(logp.masked_fill(drop & (self.top_p < 1), -torch.inf), -1)
        if self.k:
            self.tops.append(logp.topk(self.k, -1))
        return logp

    def hit(self, tokens: list[torch.Tensor], done: torch.Tensor) -> torch.Tensor:
        if self.penalties is not None:  # a row that ended counts on, unread
            self.counts.scatter_add_(1, tokens[-1][:, None], torch.ones_like(self.counts[:, :1]))
        hit = super().hit(tokens, done)
        if not self.strings:  # nothing to decode: no copy to the host in the sampling loop
            return hit
        ended, ids = (hit | done).tolist(), torch.stack(tokens, 1).tolist()  # (B, t+1)
        for r, strings in self.strings.items():
            if ended[r]:
                continue
            text = self.decode(ids[r])
            new, self.seen[r] = len(text) - len(self.seen[r]), text
            for s in strings if len(tokens) > self.rows[r][1].min_tokens else ():
                i = text.find(s, max(0, len(text) + 1 - new - len(s)))
                if i >= 0:
                    hit[r], self.reason[r], self.text[r] = True, s, text[:i]
                    break
        return hit

    def completion(self, r: int, token_ids: list[int], logprobs: list[float], stopped: bool, digest: str) -> Choice:
        if self.k and isinstance(self.tops[0], tuple):  # once a batch: (B, T, k) indices and values on the host
            self.tops = [torch.stack([top[i] for top in self.tops], 1).tolist() for i in (1, 0)]
        top = [dict(zip(*alts)) for alts in zip(self.tops[0][r], self.tops[1][r])][:len(token_ids)] if self.k else None
        last, sp = token_ids[-1], self.rows[r][1]
        eos = last in self.eos and not sp.ignore_eos  # vLLM checks EOS before the request's stop ids
        reason = self.reason.get(r, last if stopped and last in sp.stop_token_ids and not eos else None)
        return Choice(token_ids, logprobs, "stop" if stopped else "length", digest, top, reason, self.text.get(r))


class ServerEngine(TorchEngine):
    """The torch engine with every sampling parameter above; decode (token ids -> text) finds the stop strings."""

    def __init__(self, model, stop_ids: list[int], pad_id: int, decode, seed: int = 0):
        super().__init__(model, stop_ids, pad_id, seed)
        self.decode = decode

    def sampler(self, rows, ids: torch.Tensor, mask: torch.Tensor) -> VllmSampler:
        return VllmSampler(rows, ids, mask, self.stop_ids, self.decode, self.model.config.vocab_size, self.device)
