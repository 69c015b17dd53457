"""The proxy's cost: requests per second and latency (p50, p99) through proxy.py against going straight to a
replica, at 64 and 256 requests in flight, with upstreams that answer at once (so only the proxy is measured).

    python bench/bench_proxy.py            # ~1 minute; client, proxy and upstreams share this machine's cores
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

from common import ROOT, report

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
    ports = [18101, 18102, 18100]
    procs = [subprocess.Popen([sys.executable, __file__, "--serve", str(p)]) for p in ports[:2]]
    procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "proxy.py"), "--upstream", f"http://127.0.0.1:{ports[0]}",
                                   "--upstream", f"http://127.0.0.1:{ports[1]}", "--port", str(ports[2]), "--no_auth"],
                                  stdout=subprocess.DEVNULL))
    try:
        for p in ports:
            wait_healthy(f"http://127.0.0.1:{p}")
        rows = []
        for inflight in (64, 256):
            direct = asyncio.run(load(f"http://127.0.0.1:{ports[0]}", inflight, 4000))
            proxied = asyncio.run(load(f"http://127.0.0.1:{ports[2]}", inflight, 4000))
            rows.append({"inflight": inflight, "direct_rps": direct["rps"], "proxy_rps": proxied["rps"],
                         "proxy/direct": proxied["rps"] / direct["rps"], "direct_p50_ms": direct["p50_ms"],
                         "proxy_p50_ms": proxied["p50_ms"], "added_p50_ms": proxied["p50_ms"] - direct["p50_ms"],
                         "direct_p99_ms": direct["p99_ms"], "proxy_p99_ms": proxied["p99_ms"]})
        report("proxy", rows, "targets: proxy/direct >= 0.9 and added p50 < 2 ms (client, proxy and upstreams on 2 cores)")
    finally:
        for p in procs:
            p.kill()
