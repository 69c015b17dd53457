"""KV-prefix routing on synthetic traffic with the blog's pattern: G requests per prompt behind a shared template.

    python -m pytest -q tests/test_router.py
"""
import random
import time

from minigrpo.router import PrefixRouter

TEMPLATE = list(range(1000, 1048))  # 3 full blocks every prompt starts with (a chat template, a system prompt)


def prompt(k: int, rng: random.Random) -> list[int]:
    return TEMPLATE + [rng.randrange(50_000) for _ in range(100 + k % 60)]


def replay(n_replicas=2, prompts=200, G=8, concurrency=64, seed=0):
    """Requests arrive G per prompt, interleaved across prompts; each stays in flight for a random while."""
    rng, router = random.Random(seed), PrefixRouter(n_replicas)
    arrivals = [(k, p) for k in range(prompts) for p in [prompt(k, rng)] for _ in range(G)]
    arrivals = sorted(arrivals, key=lambda a: a[0] + rng.random() * 4)  # a prompt's G requests arrive close together
    inflight, running, placed = [0] * n_replicas, [], {}
    for k, p in arrivals:
        while len(running) >= concurrency:
            done = running.pop(rng.randrange(len(running)))
            inflight[done] -= 1
        pick, kind = router.choose("policy-v000001", p, inflight)
        placed.setdefault(k, []).append((pick, kind))
        inflight[pick] += 1
        running.append(pick)
    return router, placed


def test_affinity_approaches_the_ceiling_and_first_requests_are_unmatched():
    router, placed = replay()
    kinds = [kind for requests in placed.values() for _, kind in requests]
    assert len(kinds) == 200 * 8
    assert kinds.count("affinity") / len(kinds) > 0.845  # the blog's router reached 84.5%; the ceiling is 7/8
    first = [requests[0][1] for requests in placed.values()]
    assert first.count("unmatched") >= len(first) - 1, "a prompt's first request has nowhere to go"
    # (the one exception: the second prompt ever seen, before any fan-out has shown where the template ends)


def test_affinity_goes_where_the_prompt_lives():
    router, placed = replay(n_replicas=3)
    for requests in list(placed.values())[2:]:
        holders = set()  # replicas that already computed this prompt: where it went first, and where it spilled
        for pick, kind in requests:
            assert kind != "affinity" or pick in holders
            holders.add(pick)


def test_shared_template_is_not_mistaken_for_affinity():
    router, rng = PrefixRouter(2), random.Random(1)
    kinds = [router.choose("m", prompt(k, rng), [0, 0])[1] for k in range(50)]
    assert kinds[2:].count("affinity") == 0  # only the template is shared; prompt 2 reveals where it ends
    assert sum(router.choose("m", prompt(k, rng), [0, 0])[0] for k in range(50)) in range(15, 36), "load is spread"


def test_spills_when_the_home_replica_is_too_far_ahead():
    router, p = PrefixRouter(2, imbalance=8), prompt(0, random.Random(2))
    home, _ = router.choose("m", p, [0, 0])
    loads = [0, 0]
    loads[home] = 9
    assert router.choose("m", p, loads) == (1 - home, "spilled")
    other, q = PrefixRouter(2, imbalance=8), prompt(1, random.Random(2))
    home, _ = other.choose("m", q, [0, 0])
    loads = [0, 0]
    loads[home] = 8  # exactly `imbalance` ahead: still affinity
    assert other.choose("m", q, loads) == (home, "affinity")


def test_the_same_prompt_under_another_adapter_is_another_prefix():
    router, p = PrefixRouter(2), prompt(0, random.Random(3))
    router.choose("policy-v000001", p, [0, 0])
    assert router.choose("policy-v000002", p, [0, 0])[1] == "unmatched"
    assert router.choose("policy-v000001", p, [0, 0])[1] == "affinity"


def test_block_table_is_bounded():
    router, rng = PrefixRouter(2, max_blocks=100), random.Random(4)
    for k in range(100):
        router.choose("m", prompt(k, rng), [0, 0])
    assert len(router.table) == 100


def test_a_prompt_shorter_than_one_block_follows_its_first_request():
    router = PrefixRouter(4)
    home, kind = router.choose("m", [1, 2, 3], [0, 0, 0, 0])
    assert kind == "unmatched"
    assert all(router.choose("m", [1, 2, 3], [0, 0, 0, 0]) == (home, "affinity") for _ in range(15))
    assert router.choose("m", [1, 2, 4], [0, 0, 0, 0])[1] == "unmatched"


def test_refused_huge_prompts_leave_the_proxys_memory_as_it_was():
    """8 distinct 2M-token prompts that the replica refuses: the router keeps entries for their first 256 blocks only
    (about 5 MB for 30; the lru_cache of whole prompts it replaced took the proxy from 179 to 828 MB for 30, 22 MB each)."""
    import http.server
    import json
    import threading
    from conftest import call, free_port, start

    class Refuses(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"object": "error", "message": "prompt too long", "code": 400}).encode()
            self.send_response(400)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    replica = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuses)
    threading.Thread(target=replica.serve_forever, daemon=True).start()
    rng, port = random.Random(0), free_port()
    tokens = [rng.randrange(50_000) for _ in range(2_000_000)]  # one generator: 2M Random(0)s took 15 s
    proxy = start(["proxy.py", "--upstream", f"http://127.0.0.1:{replica.server_port}", "--port", str(port),
                   "--no_auth", "--max_body_mb", "64"], port, wait=False)
    rss = lambda: int(next(l for l in open(f"/proc/{proxy.pid}/status") if l.startswith("VmRSS")).split()[1]) / 1024  # noqa: E731,E741
    send = lambda i: call("POST", f"http://127.0.0.1:{port}/v1/completions", {"model": "m", "prompt": [i] + tokens})[0]  # noqa: E731
    try:
        for _ in range(600):
            try:
                assert send(0) == 400
                break
            except OSError:
                time.sleep(0.2)
        assert all(send(-i) == 400 for i in range(1, 4))  # the allocator's heap reaches its working size
        before = rss()
        assert all(send(i) == 400 for i in range(1, 9))
        after = rss()
        print(f"proxy RSS {before:.0f} MB before, {after:.0f} MB after 8 refused 2M-token prompts")
        assert after - before < 50
    finally:
        proxy.kill()
        replica.shutdown()


def test_the_turns_of_a_conversation_follow_its_first_request():
    """Multi-turn rollouts: turn t + 1 of each of a group's G conversations is the prompt, the turns and replies so far,
    and grows it in G different ways. That fan-out is not a template: a prompt ended there, so the conversations stay
    where their first request went, while the template before the prompts still spreads them."""
    rng, router, inflight = random.Random(0), PrefixRouter(2), [0, 0]
    homes = []
    for k in range(8):
        p = prompt(k, rng)
        home, _ = router.choose("v1", p, inflight)  # the group's first turn: one request, n = G
        homes.append(home)
        convs = [list(p) for _ in range(8)]
        for turn in range(3):
            for c in convs:
                c += [rng.randrange(50_000) for _ in range(rng.randrange(5, 40))]  # a turn and the task's reply
                assert router.choose("v1", c, inflight) == (home, "affinity"), (k, turn)
    assert set(homes) == {0, 1}
