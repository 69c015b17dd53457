"""A vLLM-compatible HTTP server over the torch engine: a CPU (or one-GPU) stand-in for `vllm serve`.

    python -m minigrpo.serve --port 8001                                   # the built-in demo model
    python -m minigrpo.serve --model Qwen/Qwen2.5-0.5B --device cuda --port 8001 --api_key KEY

It answers like `vllm serve --enable-lora` with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, VLLM_SERVER_DEV_MODE=1 and
--logprobs-mode processed_logprobs (shared/spec/vllm_protocol.md): /v1/completions with token-id or text
prompts, runtime LoRA load/unload with vLLM's status codes and messages, /v1/models, /health, /pause, /resume,
/is_paused, /reset_prefix_cache, /server_info and /get_world_size. So a proxy or a client cannot tell it from
a real replica. Requests that arrive together share a batch; each batch runs one adapter at a time, and a
scheduling round serves at most --max_loras distinct adapters.

Left out on purpose: streaming, /v1/chat/completions, top_k, prompt logprobs and a prefix cache.
"""
import asyncio
import collections
import hmac
import os
import time
import uuid
from dataclasses import asdict, dataclass, field

import torch
from aiohttp import web
from transformers import HfArgumentParser

from minigrpo.engine import Completion, SamplingParams, TorchEngine
from minigrpo.lora import DEFAULT_TARGETS, apply_adapter, check_adapter, inject_lora, lora_layers, read_adapter
from minigrpo.model import load_model, pick_device, stop_token_ids
from minigrpo.remote import MAX_LORA_RANKS



@dataclass
class ServeConfig:
    model: str = field(default="demo", metadata={"help": "base model: 'demo', a local folder or a hub id"})
    served_model_name: str = field(default="", metadata={"help": "the base model's name in the API (default: --model)"})
    host: str = field(default="127.0.0.1", metadata={"help": "bind address (loopback unless told otherwise)"})
    port: int = field(default=8000, metadata={"help": "port"})
    api_key: str = field(default="", metadata={"help": "require 'Authorization: Bearer KEY' on all routes but /health"})
    max_lora_rank: int = field(default=16, metadata={"help": f"largest adapter rank served, one of {MAX_LORA_RANKS}"})
    max_loras: int = field(default=6, metadata={"help": "distinct adapters per scheduling round"})
    max_cpu_loras: int = field(default=8, metadata={"help": "adapters kept in memory; others are re-read from their path"})
    lora_root: str = field(default="", metadata={"help": "if set, lora_path must lie inside this directory"})
    max_n: int = field(default=256, metadata={"help": "largest n accepted in one request"})
    max_batch_rows: int = field(default=512, metadata={"help": "most sequences sampled together"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda | cuda:N | mps"})
    dtype: str = field(default="float32", metadata={"help": "float32 | bfloat16 | float16"})
    threads: int = field(default=1, metadata={"help": "CPU threads for torch"})
    seed: int = field(default=0, metadata={"help": "seed for requests that bring none"})


def error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    """vLLM's error body: {"error": {"message", "type", "param", "code"}}."""
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status)


class BadRequest(Exception):
    pass


@dataclass
class Adapter:
    path: str
    r: int
    alpha: float
    created: int


@dataclass
class Job:
    model: str  # the served name, base or adapter
    prompts: list
    params: SamplingParams
    future: asyncio.Future


class Server:
    def __init__(self, cfg: ServeConfig):
        if cfg.max_lora_rank not in MAX_LORA_RANKS:
            raise SystemExit(f"--max_lora_rank must be one of {MAX_LORA_RANKS}, got {cfg.max_lora_rank}")
        self.cfg, self.name = cfg, cfg.served_model_name or cfg.model
        self.model, self.tokenizer = load_model(cfg.model, pick_device(cfg.device), cfg.dtype)
        inject_lora(self.model, cfg.max_lora_rank, cfg.max_lora_rank, DEFAULT_TARGETS)  # served at rank <= max
        self.targets = sorted({n.rsplit(".", 1)[-1] for n in lora_layers(self.model)})
        self.engine = TorchEngine(self.model, stop_token_ids(self.model, self.tokenizer), self.tokenizer.pad_token_id, cfg.seed)
        self.vocab = self.model.config.vocab_size
        self.max_model_len = self.model.config.max_position_embeddings
        self.adapters: dict[str, Adapter] = {}
        self.cache = collections.OrderedDict()  # name -> tensors, LRU, at most max_cpu_loras
        self.active = None  # the adapter name the LoRA layers hold now
        self.pending: collections.deque[Job] = collections.deque()
        self.paused = None  # None, or the pause mode

    # ---- scheduling: gather what is pending, one engine call per adapter ----
    async def worker(self, wake: asyncio.Event, resumed: asyncio.Event):
        while True:
            await wake.wait()
            await resumed.wait()
            wake.clear()
            while self.pending:
                await resumed.wait()  # a pause with mode=keep freezes what is queued until /resume
                names, jobs, rows, keep = [], [], 0, collections.deque()
                while self.pending:
                    job = self.pending.popleft()
                    fits = job.model in names or len(names) < self.cfg.max_loras
                    if fits and (not jobs or rows + len(job.prompts) * job.params.n <= self.cfg.max_batch_rows):
                        names += [] if job.model in names else [job.model]
                        jobs.append(job)
                        rows += len(job.prompts) * job.params.n
                    else:
                        keep.append(job)
                self.pending.extendleft(reversed(keep))
                for name in names:
                    group = [j for j in jobs if j.model == name]
                    try:
                        outs = await asyncio.to_thread(self.run, name, group)
                    except Exception as e:  # noqa: BLE001 -- answer 500 and keep serving, whatever broke
                        outs = [e] * len(group)
                    for job, out in zip(group, outs):
                        if not job.future.done():
                            job.future.set_result(out)

    def run(self, name: str, jobs: list[Job]):
        """In a worker thread: switch the LoRA layers to this adapter, then sample every job in one batch."""
        if self.active != name:
            if name == self.name:
                for layer in lora_layers(self.model).values():
                    layer.scaling = 0.0
            else:
                a = self.adapters[name]
                apply_adapter(self.model, self.tensors(name), a.r, a.alpha)
            self.active = name
        prompts = [p for j in jobs for p in j.prompts]
        out = self.engine.generate(prompts, [j.params for j in jobs for _ in j.prompts])
        result, i = [], 0
        for j in jobs:
            result.append(out[i:i + len(j.prompts)])
            i += len(j.prompts)
        return result

    def tensors(self, name: str):
        """An adapter's tensors from the LRU cache, or re-read from its path (as vLLM does after eviction)."""
        if name not in self.cache:
            self.cache[name] = read_adapter(self.adapters[name].path)[1]
            while len(self.cache) > self.cfg.max_cpu_loras:
                self.cache.popitem(last=False)
        self.cache.move_to_end(name)
        return self.cache[name]

    # ---- /v1/completions ----
    def parse_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [self.tokenizer(prompt)["input_ids"]]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompt = [self.tokenizer(p)["input_ids"] for p in prompt]
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            prompt = [prompt]
        if not (isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(type(t) is int for t in p)
                                                           for p in prompt)):
            raise BadRequest("Either prompt or prompt_embeds must be provided and non-empty.")
        for p in prompt:
            bad = [t for t in p if not 0 <= t < self.vocab]
            if bad:
                raise BadRequest(f"Token id {bad[0]} is out of vocabulary (size {self.vocab}).")
            if len(p) >= self.max_model_len:
                raise BadRequest(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                                 f"request has {len(p)} input tokens. Please reduce the length of the input messages.")
        return prompt

    def sampling(self, body: dict, prompt_len: int) -> SamplingParams:
        def number(key, default, kind=(int, float), lo=None, hi=None):
            v = body.get(key)
            v = default if v is None else v
            if type(v) not in (kind if isinstance(kind, tuple) else (kind,)) or (lo is not None and v < lo) or (hi is not None and v > hi):
                raise BadRequest(f"{key} must be a number in [{lo}, {hi}], got {body.get(key)!r}")
            return v
        if body.get("stream"):
            raise BadRequest("stream is not supported by this server")
        if body.get("top_k") not in (None, 0, -1):
            raise BadRequest("top_k is not supported by this server (use 0 or -1)")
        stops = body.get("stop_token_ids") or []
        if not (isinstance(stops, list) and all(type(t) is int and t >= 0 for t in stops)):
            raise BadRequest("stop_token_ids must be a list of non-negative ints")
        seed = body.get("seed")
        if seed is not None and (type(seed) is not int or not -2**63 <= seed < 2**63):
            raise BadRequest("seed must be an int64")
        max_tokens = number("max_tokens", 16, int, 1)
        return SamplingParams(n=number("n", 1, int, 1, self.cfg.max_n), temperature=number("temperature", 1.0, lo=0),
                              top_p=number("top_p", 1.0, lo=1e-9, hi=1), seed=seed, stop_token_ids=tuple(stops),
                              max_tokens=min(max_tokens, self.max_model_len - prompt_len),
                              logprobs=number("logprobs", 0, int, 0, 20))

    def choice(self, index, c, body, prompt):
        as_ids, stops = body.get("return_tokens_as_token_ids"), set(body.get("stop_token_ids") or [])
        stop_reason = c.token_ids[-1] if c.finish_reason == "stop" and c.token_ids[-1] in stops else None
        text_ids = c.token_ids[:-1] if stop_reason is not None else c.token_ids
        name = (lambda t: f"token_id:{t}") if as_ids else (lambda t: self.tokenizer.decode([t]))
        logprobs = None
        if body.get("logprobs") is not None:
            tokens = [name(t) for t in c.token_ids]
            tops = [{name(t): max(lp, -9999.0)} | {name(a): max(b, -9999.0) for a, b in (top or {}).items()}
                    for t, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs or [None] * len(c.token_ids))]
            offsets = [sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
            logprobs = {"text_offset": offsets, "token_logprobs": [max(lp, -9999.0) for lp in c.logprobs],
                        "tokens": tokens, "top_logprobs": tops}
        ids = body.get("return_token_ids")
        return {"index": index, "text": self.tokenizer.decode(text_ids, skip_special_tokens=True), "logprobs": logprobs,
                "finish_reason": c.finish_reason, "stop_reason": stop_reason, "token_ids": c.token_ids if ids else None,
                "prompt_logprobs": None, "prompt_token_ids": prompt if ids else None, "routed_experts": None}

    async def completions(self, request: web.Request):
        body = await read_json(request)
        model = body.get("model") or self.name
        if model != self.name and model not in self.adapters:
            return error(404, f"The model `{model}` does not exist. Valid aliases: {self.name}.", "NotFoundError")
        if self.paused in ("abort", "wait"):
            return error(503, "Generation is paused. Please retry after it resumes.", "ServiceUnavailableError")
        prompts = self.parse_prompts(body.get("prompt"))
        params = self.sampling(body, max(map(len, prompts)))
        job = Job(model, prompts, params, asyncio.get_running_loop().create_future())
        self.pending.append(job)
        request.app["wake"].set()
        out = await job.future
        if isinstance(out, Exception):
            return error(500, f"{type(out).__name__}: {out}", "InternalServerError")
        choices = [self.choice(i * params.n + j, c, body, p) for i, (p, group) in enumerate(zip(prompts, out))
                   for j, c in enumerate(group)]
        completion = sum(len(c.token_ids) for group in out for c in group)
        prompt_tokens = sum(len(p) for p in prompts)
        return web.json_response({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "service_tier": None, "system_fingerprint": None, "kv_transfer_params": None,
            "ec_transfer_params": None, "metrics": None,
            "usage": {"prompt_tokens": prompt_tokens * params.n, "total_tokens": prompt_tokens * params.n + completion,
                      "completion_tokens": completion, "prompt_tokens_details": None, "completion_tokens_details": None}})

    # ---- runtime LoRA ----
    async def load_lora(self, request: web.Request):
        if request.content_type != "application/json":
            return error(400, "Unsupported Media Type: Only 'application/json' is allowed")
        body = await read_json(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            return error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name == self.name:
            return error(400, f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput")
        if name in self.adapters and not body.get("load_inplace"):
            return error(400, f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                              "in place, set 'load_inplace' to True.", "InvalidUserInput")
        if not os.path.isabs(path):
            return error(400, "lora_path must be an absolute path: this server does not download adapters", "InvalidUserInput")
        root = os.path.realpath(self.cfg.lora_root) if self.cfg.lora_root else None
        if root and os.path.commonpath([root, os.path.realpath(path)]) != root:
            return error(400, "lora_path lies outside the directory this server may read (--lora_root)", "InvalidUserInput")
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            return error(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
        try:
            config, tensors = read_adapter(path)
            r, alpha = int(config["r"]), float(config["lora_alpha"])
            if r > self.cfg.max_lora_rank:
                raise ValueError(f"LoRA rank {r} is greater than max_lora_rank {self.cfg.max_lora_rank}.")
            check_adapter(self.model, tensors, r)
        except FileNotFoundError:
            return error(500, f"Call to add_lora method failed: {path} doesn't contain tensors", "InternalServerError")
        except (ValueError, KeyError, OSError) as e:
            return error(500, f"Call to add_lora method failed: {e}", "InternalServerError")
        if self.active == name:
            self.active = None  # reloaded in place: apply the new weights on next use
        self.adapters[name] = Adapter(path, r, alpha, int(time.time()))
        self.cache[name] = tensors
        self.tensors(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: web.Request):
        body = await read_json(request)
        name = body.get("lora_name")
        if not name:
            return error(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if name not in self.adapters:
            return error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.adapters[name]
        self.cache.pop(name, None)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    # ---- models, health, dev mode ----
    async def models(self, request):
        def card(id_, root, parent, max_len, created):
            return {"id": id_, "object": "model", "created": created, "owned_by": "vllm", "root": root,
                    "parent": parent, "max_model_len": max_len, "permission": []}
        now = int(time.time())
        data = [card(self.name, self.cfg.model, None, self.max_model_len, now)]
        data += [card(n, a.path, self.name, None, a.created) for n, a in self.adapters.items()]
        return web.json_response({"object": "list", "data": data})

    async def pause(self, request):
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return web.json_response({"error": f"Invalid mode: {mode!r}; expected abort, wait or keep"}, status=400)
        self.paused = mode
        if mode == "keep":
            request.app["resumed"].clear()
        elif mode == "abort":  # queued requests that have not started end now, as aborted
            while self.pending:
                job = self.pending.popleft()
                job.future.set_result([[Completion([], [], "abort")] * job.params.n for _ in job.prompts])
        return web.json_response({"status": "paused"})

    async def resume(self, request):
        self.paused = None
        request.app["resumed"].set()
        return web.json_response({"status": "resumed"})

    def info(self) -> dict:
        return {"model_config": {"model": self.cfg.model, "served_model_name": self.name, "dtype": f"torch.{self.cfg.dtype}",
                                 "max_model_len": self.max_model_len, "logprobs_mode": "processed_logprobs"},
                "cache_config": {"block_size": 16, "enable_prefix_caching": False},
                "parallel_config": {"tensor_parallel_size": 1, "data_parallel_size": 1},
                "lora_config": {"max_lora_rank": self.cfg.max_lora_rank, "max_loras": self.cfg.max_loras,
                                "max_cpu_loras": self.cfg.max_cpu_loras, "lora_dtype": "torch.float32",
                                "fully_sharded_loras": False, "target_modules": self.targets}}

    async def server_info(self, request):
        config = self.info() if request.query.get("config_format", "text") == "json" else str(self.info())
        return web.json_response({"vllm_config": config, "vllm_env": {"VLLM_SERVER_DEV_MODE": True,
                                  "VLLM_ALLOW_RUNTIME_LORA_UPDATING": True}, "system_env": {}})


async def read_json(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the body is not valid JSON")
    except web.HTTPRequestEntityTooLarge:
        raise
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def make_app(server: Server, api_key: str = "") -> web.Application:
    @web.middleware
    async def guard(request, handler):
        if api_key and request.path != "/health":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return web.json_response({"error": "Unauthorized"}, status=401)
        try:
            return await handler(request)
        except BadRequest as e:
            return error(400, str(e))
        except web.HTTPRequestEntityTooLarge:
            return error(413, "the request body is too large")
        except web.HTTPException as e:  # unknown route or method: FastAPI's plain JSON
            return web.json_response({"detail": e.reason}, status=e.status)

    app = web.Application(middlewares=[guard], client_max_size=8 * 2**20)
    app["wake"], app["resumed"] = asyncio.Event(), asyncio.Event()
    app["resumed"].set()
    def fixed(make):  # a route whose answer needs no work
        async def handler(request):
            return make()
        return handler

    app.add_routes([
        web.post("/v1/completions", server.completions), web.post("/v1/load_lora_adapter", server.load_lora),
        web.post("/v1/unload_lora_adapter", server.unload_lora), web.get("/v1/models", server.models),
        web.get("/health", fixed(web.Response)),
        web.post("/pause", server.pause), web.post("/resume", server.resume),
        web.get("/is_paused", fixed(lambda: web.json_response({"is_paused": server.paused is not None}))),
        web.post("/reset_prefix_cache", fixed(lambda: web.json_response({"success": True}))),
        web.get("/server_info", server.server_info),
        web.get("/get_world_size", fixed(lambda: web.json_response({"world_size": 1})))])

    async def start_worker(app):
        app["worker"] = asyncio.create_task(server.worker(app["wake"], app["resumed"]))
    app.on_startup.append(start_worker)
    return app


def main():
    cfg, = HfArgumentParser(ServeConfig).parse_args_into_dataclasses()
    torch.set_num_threads(cfg.threads)
    server = Server(cfg)
    print(f"minigrpo.serve: {server.name} on http://{cfg.host}:{cfg.port} (max_lora_rank {cfg.max_lora_rank}, "
          f"max_loras {cfg.max_loras})\n  {asdict(cfg) | {'api_key': '***' if cfg.api_key else ''}}", flush=True)
    web.run_app(make_app(server, cfg.api_key), host=cfg.host, port=cfg.port, print=None)


if __name__ == "__main__":
    main()
