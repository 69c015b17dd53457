"""proxy.py: one address in front of several inference replicas, so that they look like a single vLLM server.

    python -m minigrpo.replica.serve --port 8001 & python -m minigrpo.replica.serve --port 8002 &      # or real `vllm serve`
    python proxy.py --upstream http://127.0.0.1:8001 --upstream http://127.0.0.1:8002 --port 8000 --api_key KEY
    python generate.py --engine http --url http://127.0.0.1:8000 --api_key KEY & python train.py

Completions go to one replica by KV-prefix affinity, adapter loads to every replica, all or nothing (README, "Many
replicas"). Replicas get --upstream_token (or HF_TOKEN), never a client's key. Answers are buffered, not streamed."""
import asyncio
import collections
import json
import os
import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from minigrpo import protocol as P
from minigrpo.router import PrefixRouter
from minigrpo.run import parse_config


@dataclass
class ProxyConfig(P.ServerConfig):
    upstream: list[str] = field(kw_only=True, metadata={"help": "each replica's base URL", "action": "extend"})
    no_auth: bool = field(default=False, metadata={"help": "run without a client key (only on a trusted network)"})
    upstream_token: str = field(default="", metadata={"help": "bearer token sent to the replicas (default: env HF_TOKEN)"})
    imbalance: int = field(default=32, metadata={"help": "affinity only while a replica is at most this many requests "
                                                     "ahead of the least loaded (about 2G for G completions a prompt)"})
    load_timeout_s: float = field(default=300.0, metadata={"help": "keep retrying 'No adapter found' this long"})
    retry_s: float = field(default=2.0, metadata={"help": "interval between those retries"})
    request_timeout_s: float = field(default=600.0, metadata={"help": "a replica that takes longer gets a 504"})


HOP_HEADERS = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
               "transfer-encoding", "upgrade", "host", "authorization", "content-length", "content-encoding"}
Answer = collections.namedtuple("Answer", "status body headers unreachable", defaults=(False,))  # a replica's reply


def forwardable(headers) -> dict:  # both ways: no hop-by-hop headers, credentials or what aiohttp recomputes
    return {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}


def reply(a: Answer, headers: dict | None = None) -> web.Response:
    return web.Response(status=a.status, body=a.body, headers=a.headers | (headers or {}))


class Proxy:
    def __init__(self, cfg: ProxyConfig):
        self.cfg, self.upstreams, self.loading = cfg, [u.rstrip("/") for u in cfg.upstream], collections.defaultdict(asyncio.Lock)
        self.router, self.inflight = PrefixRouter(len(cfg.upstream), imbalance=cfg.imbalance), [0] * len(cfg.upstream)
        self.auth = P.bearer(cfg.upstream_token or os.environ.get("HF_TOKEN", ""))

    async def send(self, i: int, request: web.Request, path="", method="", body=b"") -> Answer:
        """The client's request to replica i (or, with `path`, one of the proxy's own), less HOP_HEADERS."""
        path, body = (path, body) if path else (request.path, await request.read())  # the proxy's own request, or the client's
        self.inflight[i] += 1
        try:
            async with self.session.request(method or request.method, self.upstreams[i] + path, params=request.query, data=body,
                                            headers=forwardable(request.headers) | self.auth) as r:
                return Answer(r.status, await r.read(), forwardable(r.headers))
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:  # a timeout is a 504, any other failure a 502
            late, unreachable = isinstance(e, asyncio.TimeoutError), isinstance(e, aiohttp.ClientConnectorError)
            why = f"timed out after {self.cfg.request_timeout_s:.0f}s" if late else f"{type(e).__name__}: {e}"
            return Answer(504 if late else 502, f"proxy: {self.upstreams[i]}: {why}".encode(), {}, unreachable)
        finally:
            self.inflight[i] -= 1

    def failure(self, what: str, answers: list[Answer], bad: list[int], status: int | None = None) -> web.Response:
        """Encoded with replacement: `what` may quote a name holding a lone surrogate (JSON can escape one)."""
        first, text = answers[bad[0]], answers[bad[0]].body[:300].decode(errors="replace")
        text = f"proxy: {len(bad)}/{len(answers)} servers {what}; first: {self.upstreams[bad[0]]} -> {first.status} {text}"
        return web.Response(status=status or first.status, body=text.encode(errors="replace"), content_type="text/plain")

    async def forward(self, request: web.Request, first: int | None = None):
        """To replica `first`, else the least busy; the next one only if it cannot be reached at all."""
        for i in sorted(range(len(self.upstreams)), key=lambda i: (i != first, self.inflight[i])):
            if not (answer := await self.send(i, request)).unreachable:
                break
        return reply(answer, {"X-Proxy-Upstream": str(i)})

    async def completions(self, request: web.Request):
        body = P.parse_json(await request.read())
        prompt, model = body.get("prompt", body.get("messages")), str(body.get("model") or "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # a batch of prompts is routed by its first one
        return await self.forward(request, self.router.choose(model, prompt, self.inflight)[0])

    async def load_lora(self, request: web.Request):
        body = P.parse_json(await request.read())
        name, path = str(body.get("lora_name")), body.get("lora_path")

        async def load(i):  # retry while the replica cannot see the directory yet
            deadline = time.time() + self.cfg.load_timeout_s
            while (a := await self.send(i, request)).status != 200 and P.NO_ADAPTER.encode() in a.body and time.time() <= deadline:
                await asyncio.sleep(self.cfg.retry_s)
            return a

        async with self.loading[name]:  # one load per adapter name at a time
            answers = await asyncio.gather(*(load(i) for i in range(len(self.upstreams))))
            loaded = [i for i, a in enumerate(answers) if a.status == 200]
            already = [i for i, a in enumerate(answers) if a.status == 400 and P.LOADED.encode() in a.body]
            bad = [i for i in range(len(answers)) if i not in loaded and i not in already]
            models = [] if bad else await asyncio.gather(*(self.send(i, request, "/v1/models", "GET") for i in already))
            other_weights = any(P.card_of(m.body, name).get("root") != path for m in models)  # the name, but not these weights
            if not bad and not other_weights:  # everywhere now; if every replica had it, say so as one server would
                return reply(answers[loaded[0]] if loaded else answers[0])
            for i in loaded:  # all or nothing: take it back where it went in
                await self.send(i, request, "/v1/unload_lora_adapter", "POST", json.dumps({"lora_name": name}).encode())
        if other_weights:
            return P.error(400, P.already_loaded(name), "InvalidUserInput")
        status = 504 if P.NO_ADAPTER.encode() in answers[bad[0]].body else None  # the directory never appeared
        return self.failure(f"failed to load {name}; rolled back on the others.", answers, bad, status)

    async def everywhere(self, request: web.Request):
        answers = await asyncio.gather(*(self.send(i, request) for i in range(len(self.upstreams))))
        fine = (200, 404) if request.path == "/v1/unload_lora_adapter" else (200,)
        if bad := [i for i, a in enumerate(answers) if a.status not in fine]:
            return self.failure("unhealthy" if request.method == "GET" else f"failed {request.path}", answers, bad)
        return reply(next((a for a in answers if a.status == 200), answers[0]))

    async def connect(self, app: web.Application):  # keepalive 4 s: vLLM drops a connection idle 5 s (a request on it: 502)
        timeout = aiohttp.ClientTimeout(total=self.cfg.request_timeout_s, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=4)) as self.session:
            yield


def main():
    cfg, = parse_config(ProxyConfig)
    cfg.api_key = cfg.api_key or os.environ.get("MINIGRPO_API_KEY", "")
    if not cfg.api_key and not cfg.no_auth:
        raise SystemExit("set --api_key KEY (or MINIGRPO_API_KEY), or pass --no_auth to run without client auth")
    proxy = Proxy(cfg)
    routes = [web.post("/v1/completions", proxy.completions), web.post("/v1/chat/completions", proxy.completions),
              web.post("/v1/load_lora_adapter", proxy.load_lora), web.post("/reset_prefix_cache", proxy.everywhere),
              *[web.post(p, proxy.everywhere) for p in ("/v1/unload_lora_adapter", "/pause", "/resume")],
              *[web.get(p, proxy.everywhere) for p in ("/health", "/ping")], web.route("*", "/{tail:.*}", proxy.forward)]
    P.run(cfg, routes, proxy.connect, f"proxy -> {len(cfg.upstream)} replicas")


if __name__ == "__main__":
    main()
