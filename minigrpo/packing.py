"""Packed micro-batches: the trainer's samples laid out in rows with no padding. A row holds each prompt once, at
positions 0..P-1, then each of its completions at P, P+1, ... (model.packed_attention says why that is exact)."""
from dataclasses import dataclass

import torch

from minigrpo.grpo import Batch


@dataclass
class Sample:  # one completion as the trainer sees it
    ids: list[int]  # prompt + completion token ids
    prompt_len: int
    behav: list[float]  # the sampler's log-prob of each completion token
    adv: float
    mask: list[int] | None = None  # per completion token: 1 sampled by the policy, 0 a task's reply (None: all 1)

    def __post_init__(self):
        self.mask = [1] * len(self.behav) if self.mask is None else self.mask


def micro_batches(samples, budget: int):
    """First-fit decreasing, prompt by prompt (most tokens first) and each prompt's samples longest first: each
    sample goes into the first micro-batch with room, trying first those that hold its prompt, where it costs only
    its completion (collate puts a prompt in a row once). At most `budget` tokens each; a longer sample gets its own."""
    groups = {}  # prompt -> its samples, longest first
    for s in sorted(samples, key=lambda s: -len(s.ids)):
        groups.setdefault(tuple(s.ids[:s.prompt_len]), []).append(s)
    batches, sizes, prompts = [], [], []
    for p, group in sorted(groups.items(), key=lambda item: -sum(len(s.ids) for s in item[1])):
        for s in group:
            cost = [len(s.ids) - (len(p) if p in held else 0) for held in prompts] + [len(s.ids)]  # + a new one
            tried = sorted(range(len(batches)), key=lambda i: p not in prompts[i])  # those holding p first
            if (i := next((j for j in tried if sizes[j] + cost[j] <= budget), len(batches))) == len(batches):  # none has room
                batches, sizes, prompts = batches + [[]], sizes + [0], prompts + [set()]  # a new one
            batches[i].append(s)
            sizes[i] += cost[i]
            prompts[i].add(p)
    return [batches[i] for i in sorted(range(len(batches)), key=lambda i: -sizes[i])]  # the largest row first


def collate(samples, device, num_seqs=None, num_tokens=None):
    """One packed row (1, N) of token ids and positions, laid out as above, a prompt's samples together. Per completion
    token (B, T): `where` is the row index whose hidden state predicts it (the prompt's last token for the first one),
    `targets` the token (-1 past the end). Returns ((ids, pos, where, targets), Batch), only ids and Batch on device."""
    B, T, ids, pos, prompt = len(samples), max(len(s.behav) for s in samples), [], [], None
    where, targets = torch.zeros(B, T, dtype=torch.long), torch.full((B, T), -1)
    mask, behav, adv = torch.zeros(B, T), torch.zeros(B, T), torch.tensor([s.adv for s in samples])  # adv (B,)
    for i, s in enumerate(samples):
        P, completion, n = s.prompt_len, s.ids[s.prompt_len:], len(s.ids) - s.prompt_len
        if s.ids[:P] != prompt:  # a new prompt
            prompt, last = s.ids[:P], len(ids) + P - 1
            ids, pos = ids + prompt, pos + list(range(P))
        where[i, :n] = torch.tensor([last] + list(range(len(ids), len(ids) + n - 1)))[:n]
        targets[i, :n], mask[i, :n], behav[i, :n] = torch.tensor(completion), torch.tensor(s.mask), torch.tensor(s.behav)
        ids, pos = ids + completion, pos + list(range(P, P + n))
    batch = Batch(behav.to(device), adv.to(device), mask.to(device), num_seqs=num_seqs, num_tokens=num_tokens)
    return (torch.tensor([ids], device=device), torch.tensor([pos]), where, targets), batch
