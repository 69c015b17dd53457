"""The proxy's cost: its CPU time per request, and requests per second and latency (p50, p99) through proxy.py
against going straight to a replica, at 64 and 256 requests in flight, with upstreams that answer at once (so
only the proxy is measured). The proxy gets a core of its own (taskset); the load generator and the two
upstreams share the other cores, so "direct" and "proxied" do the same work there and differ by the proxy hop.

    python bench/bench_proxy.py            # ~2 minutes; 3 interleaved repeats
"""
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import aiohttp
from aiohttp import web

from common import ROOT, cpu_s, report

BODY = json.dumps({"id": "cmpl-x", "object": "text_completion", "model": "m", "choices": [
    {"index": 0, "text": "64", "token_ids": [7, 5, 0], "logprobs": {"token_logprobs": [-0.1, -0.2, -0.01]},
     "finish_reason": "stop"}]}).encode()


def serve_fast(port: int):
    async def completion(request):
        await request.read()
        return web.Response(body=BODY, content_type="application/json")
    app = web.Application()
    app.add_routes([web.post("/v1/completions", completion), web.get("/health", lambda r: completion(r))])
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def load(url: str, inflight: int, total: int) -> dict:
    prompt = list(range(48)) + list(range(1000, 1200))  # a shared template, then a prompt-specific part
    latencies, sem = [], asyncio.Semaphore(inflight)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=inflight)) as session:
        async def one(i):
            async with sem:
                body = {"model": "m", "prompt": prompt[:48] + [i // 8] + prompt[48:], "max_tokens": 8}
                t0 = time.perf_counter()
                async with session.post(url + "/v1/completions", json=body) as r:
                    await r.read()
                    assert r.status == 200, r.status
                latencies.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(total)))
        wall = time.perf_counter() - t0
    latencies.sort()
    return {"rps": total / wall, "p50_ms": 1000 * statistics.median(latencies), "p99_ms": 1000 * latencies[int(0.99 * total)]}


def wait_healthy(url):
    import urllib.request
    for _ in range(200):
        try:
            if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        serve_fast(int(sys.argv[2]))
        sys.exit()
    cores = sorted(os.sched_getaffinity(0))
    proxy_core, rest = cores[0], ",".join(map(str, cores[1:] or cores))
    os.sched_setaffinity(0, set(cores[1:] or cores))  # the load generator: not on the proxy's core
    ports, total, repeats = [18101, 18102, 18100], 4000, 3
    pin = lambda c: ["taskset", "-c", str(c)]  # noqa: E731
    procs = [subprocess.Popen(pin(rest) + [sys.executable, __file__, "--serve", str(p)]) for p in ports[:2]]
    procs.append(subprocess.Popen(pin(proxy_core) + [sys.executable, os.path.join(ROOT, "proxy.py"), "--upstream",
                                  f"http://127.0.0.1:{ports[0]}", "--upstream", f"http://127.0.0.1:{ports[1]}",
                                  "--port", str(ports[2]), "--no_auth"], stdout=subprocess.DEVNULL))
    try:
        for p in ports:
            wait_healthy(f"http://127.0.0.1:{p}")
        runs = {(k, inflight): [] for k in ("direct", "proxy") for inflight in (64, 256)}
        for _ in range(repeats):  # interleaved, so background load hits both alike
            for inflight in (64, 256):
                runs["direct", inflight].append(asyncio.run(load(f"http://127.0.0.1:{ports[0]}", inflight, total)))
                before = cpu_s(procs[-1].pid)
                runs["proxy", inflight].append(asyncio.run(load(f"http://127.0.0.1:{ports[2]}", inflight, total)))
                runs["proxy", inflight][-1]["cpu_ms"] = 1000 * (cpu_s(procs[-1].pid) - before) / total
        mean = lambda xs: statistics.mean(xs)  # noqa: E731
        rows = []
        for inflight in (64, 256):
            d, p = runs["direct", inflight], runs["proxy", inflight]
            ratio = [b["rps"] / a["rps"] for a, b in zip(d, p)]
            rows.append({"inflight": inflight, "proxy_cpu_ms_per_request": mean([r["cpu_ms"] for r in p]),
                         "cpu_ms_min": min(r["cpu_ms"] for r in p), "cpu_ms_max": max(r["cpu_ms"] for r in p),
                         "direct_rps": mean([r["rps"] for r in d]), "proxy_rps": mean([r["rps"] for r in p]),
                         "proxy/direct": mean(ratio), "ratio_min": min(ratio), "ratio_max": max(ratio),
                         "added_p50_ms": mean([b["p50_ms"] - a["p50_ms"] for a, b in zip(d, p)]),
                         "proxy_p99_ms": mean([r["p99_ms"] for r in p])})
        report("proxy", rows, f"means (min-max) over {repeats} interleaved repeats of {total} requests; proxy on core "
               f"{proxy_core}, load generator and upstreams on {rest}. Targets: <= 0.25 ms of proxy CPU "
               f"a request, proxy/direct >= 0.9")
    finally:
        for p in procs:
            p.kill()
