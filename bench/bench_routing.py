"""Routing quality: the blog's traffic replayed through the router (8 rollouts per prompt, a shared 48-token
template, prompts of 100-400 more tokens, requests finishing at random), for 2 and 3 replicas and 128 to 384
requests in flight. The ceiling for affinity is 7/8 = 87.5%: a prompt's first request cannot know where to go.

    python bench/bench_routing.py          # ~1 minute
"""
import random

from common import report
from minigrpo.router import PrefixRouter


def replay(replicas: int, inflight: int, prompts: int = 3000, G: int = 8, seed: int = 0) -> dict:
    rng, router = random.Random(seed), PrefixRouter(replicas)
    template = [rng.randrange(150_000) for _ in range(48)]
    arrivals = []
    for k in range(prompts):
        p = template + [rng.randrange(150_000) for _ in range(rng.randrange(100, 400))]
        arrivals += [(k + rng.random() * 6, p) for _ in range(G)]  # a prompt's G requests arrive close together
    arrivals.sort(key=lambda a: a[0])
    load, running = [0] * replicas, []
    for _, p in arrivals:
        while len(running) >= inflight:  # some request finishes; long ones are as likely as short ones
            load[running.pop(rng.randrange(len(running)))] -= 1
        pick, _ = router.choose("policy-v000007", p, load)
        load[pick] += 1
        running.append(pick)
    s = router.stats()
    return {"replicas": replicas, "inflight": inflight, "requests": s["routed"], "affinity": s["affinity"] / s["routed"],
            "spilled": s["spilled"] / s["routed"], "unmatched": s["unmatched"] / s["routed"]}


if __name__ == "__main__":
    rows = [replay(n, f) for n in (2, 3) for f in (128, 256, 384)]
    report("routing", rows, "the blog's router: 84.5% affinity, 1.3% spilled; the ceiling is 87.5%")
