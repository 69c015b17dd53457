"""proxy.py: one address in front of several inference replicas, so that they look like a single vLLM server.

    python -m minigrpo.serve --port 8001 & python -m minigrpo.serve --port 8002 &      # or real `vllm serve`
    python proxy.py --upstream http://127.0.0.1:8001 --upstream http://127.0.0.1:8002 --port 8000 --api_key KEY
    python generate.py --engine http --url http://127.0.0.1:8000 --api_key KEY & python train.py

What goes where:
  - POST /v1/completions, /v1/chat/completions: routed to one replica by KV-prefix affinity (minigrpo/router.py);
    a replica that cannot be reached is skipped for the next one, and the answer names the replica it came from
    in X-Proxy-Upstream;
  - POST /v1/load_lora_adapter: sent to every replica, all or nothing. A replica answering "No adapter found" is
    retried until --load_timeout_s (its bucket mount may lag); on any failure the replicas that accepted unload
    it again, and the answer is the failure;
  - POST /v1/unload_lora_adapter, /pause, /resume, /reset_prefix_cache: sent to every replica, answered as one
    vLLM server would answer (an unload no replica knows is a 404);
  - GET /health: 200 only when every replica answers 200; GET /proxy/stats: the counters;
  - anything else (/v1/models, /server_info, ...): forwarded to one replica, round-robin.
Clients authenticate with --api_key; replicas get --upstream_token (or HF_TOKEN) and never the client's key.

Left out on purpose: streaming (answers are buffered whole, which RL rollouts do not mind) and retrying a request
on another replica after it reached one (sampling is not idempotent for the caller's bookkeeping).
"""
import asyncio
import hmac
import json
import os
import time
from dataclasses import asdict, dataclass, field

import aiohttp
from aiohttp import web
from transformers import HfArgumentParser

from minigrpo.router import PrefixRouter

# never passed through in either direction: hop-by-hop headers, credentials, and what aiohttp recomputes
DROP_HEADERS = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
                "transfer-encoding", "upgrade", "host", "authorization", "content-length", "content-encoding"}


@dataclass
class ProxyConfig:
    upstream: list[str] = field(default_factory=list, metadata={"help": "a replica's base URL; repeat for each replica",
                                                                "action": "extend"})
    host: str = field(default="127.0.0.1", metadata={"help": "bind address (loopback unless told otherwise)"})
    port: int = field(default=8000, metadata={"help": "port"})
    api_key: str = field(default="", metadata={"help": "clients must send 'Authorization: Bearer KEY' (or env MINIGRPO_API_KEY)"})
    no_auth: bool = field(default=False, metadata={"help": "run without a client key (only on a trusted network)"})
    upstream_token: str = field(default="", metadata={"help": "bearer token sent to the replicas (default: env HF_TOKEN)"})
    block_size: int = field(default=16, metadata={"help": "tokens per hashed prefix block"})
    imbalance: int = field(default=8, metadata={"help": "affinity only while a replica is at most this many requests ahead"})
    max_blocks: int = field(default=500_000, metadata={"help": "bound on the router's block table"})
    load_timeout_s: float = field(default=300.0, metadata={"help": "keep retrying 'No adapter found' this long"})
    retry_s: float = field(default=2.0, metadata={"help": "interval between those retries"})
    request_timeout_s: float = field(default=600.0, metadata={"help": "a replica that takes longer gets a 504"})
    max_body_mb: int = field(default=16, metadata={"help": "largest request body accepted"})


@dataclass
class Answer:
    status: int
    body: bytes
    headers: dict
    unreachable: bool = False  # the replica could not be connected to at all

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")


class Proxy:
    def __init__(self, cfg: ProxyConfig):
        self.cfg, self.upstreams = cfg, [u.rstrip("/") for u in cfg.upstream]
        self.router = PrefixRouter(len(self.upstreams), cfg.block_size, cfg.imbalance, cfg.max_blocks)
        self.inflight, self.routed, self.next_rr = [0] * len(self.upstreams), [0] * len(self.upstreams), 0
        token = cfg.upstream_token or os.environ.get("HF_TOKEN", "")
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}
        self.session = None

    async def send(self, i: int, request: web.Request, body: bytes | None, path: str | None = None) -> Answer:
        """Forward to replica i with the client's headers minus credentials and hop-by-hop ones."""
        url = self.upstreams[i] + (path or request.path)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROP_HEADERS} | self.auth
        self.inflight[i] += 1
        try:
            async with self.session.request(request.method, url, params=request.query, data=body, headers=headers) as r:
                kept = {k: v for k, v in r.headers.items() if k.lower() not in DROP_HEADERS}
                return Answer(r.status, await r.read(), kept)
        except asyncio.TimeoutError:
            return Answer(504, f"proxy: {self.upstreams[i]}: timed out after {self.cfg.request_timeout_s:.0f}s".encode(), {})
        except aiohttp.ClientConnectorError as e:
            return Answer(502, f"proxy: {self.upstreams[i]}: {type(e).__name__}: {e}".encode(), {}, unreachable=True)
        except aiohttp.ClientError as e:
            return Answer(502, f"proxy: {self.upstreams[i]}: {type(e).__name__}: {e}".encode(), {})
        finally:
            self.inflight[i] -= 1

    def reply(self, a: Answer, **extra) -> web.Response:
        return web.Response(status=a.status, body=a.body, headers=a.headers | extra)

    async def broadcast(self, request: web.Request, body: bytes | None) -> list[Answer]:
        return await asyncio.gather(*(self.send(i, request, body) for i in range(len(self.upstreams))))

    def failure(self, what: str, answers: list[Answer], bad: list[int]) -> str:
        i = bad[0]
        return (f"proxy: {len(bad)}/{len(answers)} servers failed {what}; first: {self.upstreams[i]} -> "
                f"{answers[i].status} {answers[i].text[:300]}")

    # ---- routes ----
    async def completions(self, request: web.Request):
        raw = await request.read()
        try:
            body = json.loads(raw)
            prompt, model = body.get("prompt", body.get("messages")), str(body.get("model") or "")
        except (ValueError, AttributeError):
            return web.json_response({"error": {"message": "the body is not a JSON object", "type": "BadRequestError",
                                                 "param": None, "code": 400}}, status=400)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]  # a batch of prompts is routed by its first one
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(type(t) is int for t in prompt))):
            prompt = json.dumps(prompt)
        pick, _ = self.router.choose(model, prompt, self.inflight)
        others = sorted((i for i in range(len(self.upstreams)) if i != pick), key=lambda i: self.inflight[i])
        for i in [pick] + others:  # go on to the next replica only when this one cannot be reached at all
            answer = await self.send(i, request, raw)
            if not answer.unreachable:
                break
        self.routed[i] += 1
        return self.reply(answer, **{"X-Proxy-Upstream": str(i)})

    async def load_lora(self, request: web.Request):
        raw = await request.read()
        try:
            name = json.loads(raw).get("lora_name", "?")
        except (ValueError, AttributeError):
            name = "?"  # the replicas will say what is wrong with the body

        async def load(i):  # retry while the replica cannot see the directory yet
            deadline = time.time() + self.cfg.load_timeout_s
            while True:
                a = await self.send(i, request, raw)
                if a.status == 200 or "No adapter found" not in a.text or time.time() > deadline:
                    return a
                await asyncio.sleep(self.cfg.retry_s)

        answers = await asyncio.gather(*(load(i) for i in range(len(self.upstreams))))
        loaded = [i for i, a in enumerate(answers) if a.status == 200]
        already = [i for i, a in enumerate(answers) if a.status == 400 and "already been loaded" in a.text]
        bad = [i for i in range(len(answers)) if i not in loaded and i not in already]
        if not bad:  # everywhere now; if every replica had it already, say so as one server would
            return self.reply(answers[loaded[0]] if loaded else answers[0])
        for i in loaded:  # all or nothing: take it back where it went in
            await self.send(i, request, json.dumps({"lora_name": name}).encode(), path="/v1/unload_lora_adapter")
        status = 504 if "No adapter found" in answers[bad[0]].text else answers[bad[0]].status
        message = self.failure(f"to load {name}; rolled back on the others.", answers, bad)
        return web.Response(status=status, text=message)

    async def unload_lora(self, request: web.Request):
        answers = await self.broadcast(request, await request.read())
        ok = [a for a in answers if a.status == 200]
        bad = [i for i, a in enumerate(answers) if a.status not in (200, 404)]
        if bad:
            return web.Response(status=answers[bad[0]].status, text=self.failure(request.path, answers, bad))
        return self.reply(ok[0] if ok else answers[0])  # 404 only when no replica knew the name

    async def everywhere(self, request: web.Request):
        answers = await self.broadcast(request, await request.read())
        bad = [i for i, a in enumerate(answers) if a.status != 200]
        if bad:
            return web.Response(status=answers[bad[0]].status, text=self.failure(request.path, answers, bad))
        return self.reply(answers[0])

    async def health(self, request: web.Request):
        answers = await self.broadcast(request, None)
        bad = [i for i, a in enumerate(answers) if a.status != 200]
        if bad:
            text = self.failure("health", answers, bad).replace("servers failed health", "servers unhealthy")
            return web.Response(status=answers[bad[0]].status, text=text)
        return web.Response()

    async def stats(self, request: web.Request):
        upstreams = [{"url": u, "inflight": f, "routed": r} for u, f, r in zip(self.upstreams, self.inflight, self.routed)]
        return web.json_response({"upstreams": upstreams, "router": self.router.stats()})

    async def forward(self, request: web.Request):
        i = self.next_rr % len(self.upstreams)
        self.next_rr += 1
        return self.reply(await self.send(i, request, await request.read()))


def make_app(proxy: Proxy, api_key: str) -> web.Application:
    @web.middleware
    async def guard(request, handler):
        if api_key and request.path != "/health":
            if not hmac.compare_digest(request.headers.get("Authorization", "").encode(), f"Bearer {api_key}".encode()):
                return web.json_response({"error": "Unauthorized"}, status=401)
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return web.json_response({"error": {"message": "the request body is too large", "type": "BadRequestError",
                                                "param": None, "code": 413}}, status=413)

    app = web.Application(middlewares=[guard], client_max_size=proxy.cfg.max_body_mb * 2**20)
    app.add_routes([web.post("/v1/completions", proxy.completions), web.post("/v1/chat/completions", proxy.completions),
                    web.post("/v1/load_lora_adapter", proxy.load_lora), web.post("/v1/unload_lora_adapter", proxy.unload_lora),
                    *[web.post(p, proxy.everywhere) for p in ("/pause", "/resume", "/reset_prefix_cache")],
                    web.get("/health", proxy.health), web.get("/ping", proxy.health), web.get("/proxy/stats", proxy.stats),
                    web.route("*", "/{tail:.*}", proxy.forward)])

    async def session(app):
        timeout = aiohttp.ClientTimeout(total=proxy.cfg.request_timeout_s, sock_connect=10)
        proxy.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1024),
                                              auto_decompress=True)
        yield
        await proxy.session.close()
    app.cleanup_ctx.append(session)
    return app


def main():
    cfg, = HfArgumentParser(ProxyConfig).parse_args_into_dataclasses()
    api_key = cfg.api_key or os.environ.get("MINIGRPO_API_KEY", "")
    if not cfg.upstream:
        raise SystemExit("give at least one replica: --upstream http://HOST:PORT (repeat for each)")
    if not api_key and not cfg.no_auth:
        raise SystemExit("set --api_key KEY (or MINIGRPO_API_KEY), or pass --no_auth to run without client auth")
    shown = asdict(cfg) | {"api_key": "***" if api_key else "", "upstream_token": "***" if cfg.upstream_token else ""}
    print(f"proxy on http://{cfg.host}:{cfg.port} -> {len(cfg.upstream)} replicas\n  {shown}", flush=True)
    web.run_app(make_app(Proxy(cfg), api_key), host=cfg.host, port=cfg.port, print=None)


if __name__ == "__main__":
    main()
