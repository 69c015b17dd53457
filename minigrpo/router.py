"""KV-prefix affinity routing: send a prompt to the replica that most likely holds its prefix in the KV cache.

GRPO sends each prompt G times: the first goes where there is room, the other G - 1 should follow. As in vLLM's prefix
cache (not its exact hashes), a prompt is cut into 16-token blocks hashed in a chain from the model (adapter) name. A
replica owns the blocks sent to it (a bounded LRU table). The template prompts start with comes from the data: blocks
every replica owns, or that two different blocks follow. The longest prefix past it wins while its replica is at most
`imbalance` requests ahead of the least loaded, else the least loaded does (round-robin on ties). A prompt that extends
an earlier one (a multi-turn conversation's next turn) is no template's fan-out: it follows the earlier one. Only a prompt's first
max_prompt_blocks blocks (4,096 tokens) count; memory is bounded by max_blocks entries (~0.6 KB each), not prompts."""
import array
import collections
import hashlib
import itertools
import json


class PrefixRouter:
    def __init__(self, n: int, block_size: int = 16, imbalance: int = 32, max_blocks: int = 500_000, max_prompt_blocks: int = 256):
        self.n, self.block_size, self.imbalance, self.max_blocks = n, block_size, imbalance, max_blocks
        self.max_prompt_blocks, self.turns = max_prompt_blocks, itertools.count()  # turns: round-robin on load ties
        self.table = collections.OrderedDict()  # block hash -> (owners: set[int], successors: set[bytes | int]), LRU

    def choose(self, model: str, prompt, inflight: list[int]) -> tuple[int, str]:
        """(replica index, "affinity" | "spilled" | "unmatched"), and remember where the prompt went."""
        try:
            data, size = array.array("q", prompt).tobytes(), 8  # token ids: 8 bytes each
        except (OverflowError, TypeError):
            data, size = json.dumps(prompt).encode(), 4  # text, chat messages, huge ids: JSON, about 4 bytes a token
        data, block = data[:size * self.block_size * self.max_prompt_blocks], size * self.block_size
        hashes, matched, owners_so_far, common, fanout = chain(model, data, block), [0] * self.n, set(range(self.n)), 0, 0
        for depth, h in enumerate(hashes, 1):
            owners, successors = self.table.get(h, (set(), set()))  # a block nobody owns ends the match below
            tails = [data[depth * block:depth * block + t] for t in successors if type(t) is int]  # (see below)
            if len(successors) - len(tails) >= 2 and not any(hashlib.blake2b(h + tail, digest_size=16).digest()
                                                             in self.table for tail in tails):  # extends none of them
                fanout = depth  # prompts part ways after this block: what comes before is the template
            if len(owners) == self.n or fanout == depth:
                common = depth  # the shared template so far
            owners_so_far &= owners
            if not owners_so_far:
                break
            for i in owners_so_far:
                matched[i] = depth
        specific = [max(0, m - common) for m in matched]
        best, least = max(range(self.n), key=lambda i: (specific[i], -inflight[i])), min(inflight)
        if specific[best] > 0 and inflight[best] - least <= self.imbalance:
            pick, kind = best, "affinity"
        else:
            ties = [i for i in range(self.n) if inflight[i] == least]
            pick, kind = ties[next(self.turns) % len(ties)], "spilled" if specific[best] > 0 else "unmatched"
            if matched[pick] == len(hashes) and len(hashes) > fanout:  # the loop saw every block: fanout is final
                kind = "affinity"  # every replica holds this whole prompt (it spilled before): a hit wherever it goes
        for prev, h in zip((None, *hashes), hashes):  # remember where the prompt went
            self.table.setdefault(h, (set(), set()))[0].add(pick)
            self.table.move_to_end(h)
            if prev in self.table and sum(type(s) is bytes for s in self.table[prev][1]) < 2:
                self.table[prev][1].add(h)  # two successors are enough to call a block shared
        if full := len(data) // block:  # where it ended: its last full block's successors hold how many bytes came after
            self.table[hashes[full - 1]][1].add(len(data) - full * block)  # (an int), for a next turn to find it
        while len(self.table) > self.max_blocks:
            self.table.popitem(last=False)
        return pick, kind


def chain(model: str, data: bytes, size: int) -> tuple[bytes, ...]:
    # the seed: the model name (surrogatepass: JSON can carry a lone surrogate, which plain UTF-8 refuses)
    hashes = [hashlib.blake2b(model.encode("utf-8", "surrogatepass"), digest_size=16).digest()]
    for i in range(0, len(data), size):  # the last block may be partial
        hashes.append(hashlib.blake2b(hashes[-1] + data[i:i + size], digest_size=16).digest())
    return tuple(hashes[1:])
