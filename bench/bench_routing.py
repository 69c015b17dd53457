"""Routing on ground truth: replay GRPO traffic through the proxy's router against 4 simulated replicas of unequal
speed, and count what each replica actually holds (the prompts whose KV blocks it computed, LRU-bounded), not
what the router claims.

Traffic: bursts of 32 prompts x G=16 requests (a generator's batch), a new adapter name every burst (so nothing
cached under the last one helps), short prompts (under one 16-token block), long ones (a 48-token template +
100-400 tokens), or both mixed; requests of a prompt sent one after another, or shuffled a little; a client
that keeps 128 or 512 requests in flight. A replica runs up to 16 requests at once (queueing the rest), a request
takes its decode time plus, when the replica did not hold its prompt, its prefill, divided by the replica's speed
(1, 1, 1 and 1/3). Counted per request:
  hit    the replica it was sent to held its prompt (the ceiling is (G-1)/G: a prompt's first request cannot hit);
  spill  some replica held its prompt, and it was sent to one that did not.
Compared with a least-loaded router (fewest requests in flight, round-robin on ties) for the makespan.

    python bench/bench_routing.py          # ~1 minute
"""
import collections
import heapq
import random
import statistics

from common import report
from minigrpo.router import PrefixRouter

SPEEDS, SLOTS, G, BURSTS, PROMPTS = (1.0, 1.0, 1.0, 1 / 3), 16, 16, 8, 32
CACHE_BLOCKS = 20_000  # KV blocks per replica


class LeastLoaded:
    def __init__(self, n):
        self.n, self.next_rr = n, 0

    def choose(self, model, prompt, inflight):
        least = min(inflight)
        ties = [i for i in range(self.n) if inflight[i] == least]
        self.next_rr += 1
        return ties[self.next_rr % len(ties)], "unmatched"


def traffic(kind: str, order: str, rng: random.Random):
    """Bursts of (adapter, prompt id, prompt tokens, decode time) requests."""
    template = [rng.randrange(150_000) for _ in range(48)]
    bursts = []
    for b in range(BURSTS):
        requests = []
        for k in range(PROMPTS):
            short = kind == "short" or (kind == "mixed" and k % 2)
            p = [rng.randrange(150_000) for _ in range(rng.randrange(3, 16))] if short else \
                template + [rng.randrange(150_000) for _ in range(rng.randrange(100, 400))]
            requests += [(k + (rng.random() * 4 if order == "shuffled" else 0), (b, k), p) for _ in range(G)]
        requests.sort(key=lambda r: r[0])
        bursts.append([(f"policy-v{b:06d}", pid, p, rng.lognormvariate(4.5, 0.7)) for _, pid, p in requests])
    return bursts


def replay(router, bursts, window: int) -> dict:
    n = len(SPEEDS)
    held = [collections.OrderedDict() for _ in range(n)]  # (adapter, prompt id) -> blocks, LRU: the ground truth
    inflight, running, queued = [0] * n, [0] * n, [collections.deque() for _ in range(n)]
    hits = spills = total = 0
    now, events = 0.0, []  # (finish time, replica)

    def start(r, duration):
        running[r] += 1
        heapq.heappush(events, (now + duration / SPEEDS[r], r))

    for burst in bursts:  # the next burst starts when the last one is done, as a generator's batches do
        pending = collections.deque(burst)
        while pending or events:
            while pending and sum(inflight) < window:
                model, pid, prompt, decode = pending.popleft()
                r, _ = router.choose(model, prompt, inflight)
                key, blocks = (model, pid), len(prompt) // 16 + 1
                hit = key in held[r]
                hits += hit
                spills += not hit and any(key in h for h in held)
                total += 1
                held[r][key] = blocks
                held[r].move_to_end(key)
                while sum(held[r].values()) > CACHE_BLOCKS:
                    held[r].popitem(last=False)
                duration = decode + (0 if hit else 0.05 * len(prompt))  # prefill only on a miss
                inflight[r] += 1
                if running[r] < SLOTS:
                    start(r, duration)
                else:
                    queued[r].append(duration)
            now, r = heapq.heappop(events)
            running[r] -= 1
            inflight[r] -= 1
            if queued[r]:
                start(r, queued[r].popleft())
    return {"hit": hits / total, "spill": spills / total, "makespan": now}


if __name__ == "__main__":
    rows, ceiling, seeds = [], (G - 1) / G, range(3)
    routers = {"prefix, imbalance 8": lambda: PrefixRouter(len(SPEEDS), imbalance=8),
               f"prefix, imbalance {2 * G}": lambda: PrefixRouter(len(SPEEDS), imbalance=2 * G)}
    for kind in ("short", "long", "mixed"):
        for order in ("in order", "shuffled"):
            for window in (128, 512):
                base = [replay(LeastLoaded(len(SPEEDS)), traffic(kind, order, random.Random(s)), window) for s in seeds]
                for name, make in routers.items():
                    runs = [replay(make(), traffic(kind, order, random.Random(s)), window) for s in seeds]
                    ratio = [r["makespan"] / b["makespan"] for r, b in zip(runs, base)]
                    rows.append({"prompts": kind, "arrival": order, "window": window, "router": name,
                                 "hit_of_ceiling_min": min(r["hit"] for r in runs) / ceiling,
                                 "spill_max": max(r["spill"] for r in runs),
                                 "least_loaded_hit": statistics.mean(b["hit"] for b in base),
                                 "makespan_vs_least_loaded": statistics.mean(ratio),
                                 "makespan_ratio_min": min(ratio), "makespan_ratio_max": max(ratio)})
    report("routing", rows, f"{len(seeds)} seeds each (min/max/mean over them); G={G}, {BURSTS} bursts of {PROMPTS} "
           f"prompts, replica speeds {SPEEDS}, {SLOTS} running per replica; hit ceiling {ceiling:.4f}. Targets: hit "
           f">= 98% of the ceiling, spill <= 1.3%, makespan <= least-loaded's")
