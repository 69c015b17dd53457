"""The HTTP rules serve.py, proxy.py and remote.py share: vLLM's error body, auth rule and texts, strict input, setup.

Copied from vLLM (v0.27-v0.33 sources): the error body (`ErrorResponse` in vllm/entrypoints/serve/engine/protocol.py),
the auth rule and its 401 {"error": "Unauthorized"} (vllm/entrypoints/serve/middleware/authenticate.py), "has
already been loaded" (vllm/entrypoints/openai/models/serving.py) and "No adapter found" (vllm/exceptions.py)."""
import asyncio
import contextlib
import errno
import hmac
import json
import os
import resource
from dataclasses import asdict, dataclass, field

from aiohttp import web

NO_ADAPTER, LOADED = "No adapter found", "has already been loaded"


@dataclass
class ServerConfig:  # what the server and the proxy both take
    host: str = field(default="127.0.0.1", metadata={"help": "bind address (loopback unless told otherwise)"})
    port: int = field(default=8000, metadata={"help": "port"})
    api_key: str = field(default="", metadata={"help": "require 'Authorization: Bearer KEY' on /v1 routes, as vLLM"})
    max_body_mb: int = field(default=16, metadata={"help": "largest request body"})
    header_timeout_s: float = field(default=30.0, metadata={"help": "close a connection still without a request head"})
    body_timeout_s: float = field(default=30.0, metadata={"help": "answer 408 to a body that takes longer to arrive"})


class BadRequest(Exception):  # raised anywhere in a handler; the middleware answers it as vLLM's error body

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "BadRequestError"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


def already_loaded(name: str) -> str:
    return f"The lora adapter '{name}' {LOADED}. If you want to load the adapter in place, set 'load_inplace' to True."


def error(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": status}}, status=status)


def card_of(models: bytes | str, name: str = "") -> dict:
    """A /v1/models answer's card of `name` ("": the base model's, the one without a parent): {} if there is none.
    Its "root" is the path it is served from, a base model's card also gives max_model_len."""
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        return next((m for m in json.loads(models)["data"] if m.get("id") == name or not (name or m.get("parent"))), {})
    return {}


def parse_json(raw: bytes) -> dict:
    """A request body as a dict, or BadRequest. NaN and Infinity parse as floats, for the field checks to name."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest("the body nests too deeply to parse") from None
    except ValueError as e:  # includes UnicodeDecodeError and ints over Python's digit limit
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def run(cfg: ServerConfig, routes: list, context, banner: str):
    """Serve `routes` behind guard() inside `context` (an aiohttp cleanup context). aiohttp closes a connection that
    has not sent a whole request within its keep-alive timeout (idle ones too): that is the header timeout."""

    @web.middleware
    async def guard(request: web.Request, handler):
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")  # raw bytes, non-UTF-8 too
        if cfg.api_key and request.path.startswith("/v1") and not hmac.compare_digest(given, f"Bearer {cfg.api_key}".encode()):
            return web.json_response({"error": "Unauthorized"}, status=401)
        try:
            await asyncio.wait_for(request.read(), cfg.body_timeout_s)  # aiohttp keeps it for the handler's read()
        except asyncio.TimeoutError:
            return error(408, f"the request body did not arrive within {cfg.body_timeout_s:g}s", "RequestTimeout")
        except web.RequestPayloadError as e:  # e.g. a body that its Content-Encoding cannot decode
            return error(400, f"the body cannot be read: {e}")
        except web.HTTPRequestEntityTooLarge as e:
            return error(413, e.text)
        try:
            return await handler(request)
        except BadRequest as e:
            return error(e.status, str(e), e.kind, e.param)
        except web.HTTPException as e:  # unknown route or method: FastAPI's plain JSON, as vLLM answers
            return web.json_response({"detail": e.reason}, status=e.status)
        except Exception as e:  # noqa: BLE001 -- a failed engine call: a 500 with vLLM's body, and the server goes on
            return error(500, f"{type(e).__name__}: {e}", "InternalServerError")

    app = web.Application(middlewares=[guard], client_max_size=cfg.max_body_mb * 2**20)
    app.add_routes(routes)
    app.cleanup_ctx.append(context)
    shown = {k: "***" if v and k in ("api_key", "upstream_token") else v for k, v in asdict(cfg).items()}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536), hard))
    try:  # the banner once the port is bound; a port in use is one line
        web.run_app(app, host=cfg.host, port=cfg.port, keepalive_timeout=cfg.header_timeout_s,
                    print=lambda _: print(f"{banner} on http://{cfg.host}:{cfg.port}\n  {shown}", flush=True))
    except OSError as e:
        if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        raise SystemExit(f"{banner}: cannot listen on {cfg.host}:{cfg.port} ({os.strerror(e.errno)}): pick another --port") from None
