"""A vLLM-compatible HTTP server over the torch engine: a CPU (or one-GPU) stand-in for `vllm serve`.

    python -m minigrpo.replica.serve --port 8001                                   # the built-in demo model
    python -m minigrpo.replica.serve --model Qwen/Qwen2.5-0.5B --device cuda --port 8001 --api_key KEY

It answers like `vllm serve --enable-lora --logprobs-mode processed_logprobs` with VLLM_SERVER_DEV_MODE=1 and
VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (README, "Many replicas", lists what a client gets). A field vLLM would
ignore, or one not implemented here, is refused by name: nothing is silently ignored."""
import asyncio
import json
import math
import os
import time
import uuid
from dataclasses import dataclass, field

import torch
from aiohttp import web

from minigrpo import protocol as P
from minigrpo.lora import DEFAULT_TARGETS, inject_lora
from minigrpo.model import load_model, pick_device, resolve_model, stop_token_ids
from minigrpo.replica.sampling import ServerEngine, ServerParams
from minigrpo.replica.scheduler import Adapter, Scheduler
from minigrpo.run import parse_config

VERSION = "0.33.0+minigrpo"  # the vLLM API this server answers like
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM accepts for --max-lora-rank
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_FACTOR = 1e4  # largest temperature and repetition_penalty: logits are float32, and 1e308 would be inf there
SAMPLING = {"model", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
            "ignore_eos", "min_tokens", "logit_bias", "repetition_penalty", "presence_penalty", "frequency_penalty",
            "skip_special_tokens", "return_token_ids", "stream", "include_stop_str_in_output", "logprobs"}
FIELDS = {"/v1/completions": SAMPLING | {"prompt", "echo", "prompt_logprobs", "return_tokens_as_token_ids"},
          "/v1/chat/completions": SAMPLING | {"messages", "max_completion_tokens", "top_logprobs"}}
# what ServerParams takes as is: (default, low, high, whether low itself is refused)
RANGES = {"temperature": (1.0, 0, MAX_FACTOR, False), "top_p": (1.0, 0, 1, True), "min_p": (0.0, 0, 1, False),
          "repetition_penalty": (1.0, 0, MAX_FACTOR, True), "presence_penalty": (0.0, -2, 2, False),
          "frequency_penalty": (0.0, -2, 2, False)}
OFF = {"stream": (None, False), "echo": (None, False), "prompt_logprobs": (None,), "top_k": (None, 0, -1),
       "include_stop_str_in_output": (None, False)}  # the only values accepted for what is not implemented


@dataclass
class ServeConfig(P.ServerConfig):
    model: str = field(default="demo", metadata={"help": "base model: 'demo', a local folder or a hub id"})
    max_lora_rank: int = field(default=16, metadata={"help": f"largest adapter rank served, one of {MAX_LORA_RANKS}"})
    max_loras: int = field(default=6, metadata={"help": "distinct adapters per scheduling round"})
    max_cpu_loras: int = field(default=8, metadata={"help": "adapters kept in memory; others are re-read when used"})
    lora_root: str = field(default="", metadata={"help": "if set, lora_path must lie inside this directory"})
    max_request_rows: int = field(default=256, metadata={"help": "most sequences (prompts x n) in one request"})
    max_batch_rows: int = field(default=512, metadata={"help": "most sequences sampled together"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda | cuda:N | mps"})
    dtype: str = field(default="float32", metadata={"help": "float32 | bfloat16 | float16"})
    threads: int = field(default=1, metadata={"help": "CPU threads for torch"})
    seed: int = field(default=0, metadata={"help": "seed for requests that bring none"})


def checked(body: dict, key: str, default, ok, rule: str):
    """body[key] (default when absent or null) if ok(it), else a 400 naming the field: '{key} must {rule}, got ...'."""
    v = default if body.get(key) is None else body[key]
    if not ok(v):
        raise P.BadRequest(f"{key} must {rule}, got {v!r:.200}", key)
    return v


def number(body: dict, key: str, default, lo=-math.inf, hi=math.inf, open_lo=False, integer=False):
    """A number in [lo, hi], or in (lo, hi] with open_lo; an integer one refuses floats and booleans."""
    kind = "an integer" if integer else "a finite number"
    def ok(v):
        right_type = type(v) is int if integer else (type(v) in (int, float) and math.isfinite(v))
        return right_type and (lo < v if open_lo else lo <= v) and v <= hi
    return checked(body, key, default, ok, f"be {kind} in {'(' if open_lo else '['}{lo}, {hi}]")


def flag(body: dict, key: str) -> bool:
    return bool(checked(body, key, False, lambda v: v in (True, False), "be true or false"))


class Server:
    def __init__(self, cfg: ServeConfig):
        if cfg.max_lora_rank not in MAX_LORA_RANKS:
            raise SystemExit(f"--max_lora_rank must be one of {MAX_LORA_RANKS}, got {cfg.max_lora_rank}")
        self.cfg, self.name = cfg, cfg.model
        self.model, self.tokenizer = load_model(cfg.model, pick_device(cfg.device), cfg.dtype)
        # served at rank <= max; the alpha here is a placeholder, since each adapter brings its own scaling
        inject_lora(self.model, cfg.max_lora_rank, cfg.max_lora_rank, DEFAULT_TARGETS)
        self.decode = lambda ids, skip=True: self.tokenizer.decode(ids, skip_special_tokens=skip)
        engine = ServerEngine(self.model, stop_token_ids(self.model, self.tokenizer), self.tokenizer.pad_token_id,
                              self.decode, cfg.seed)
        self.scheduler = Scheduler(self.model, engine, self.name, cfg)
        self.vocab, self.max_model_len = self.model.config.vocab_size, self.model.config.max_position_embeddings
        # a text longer than this cannot fit in max_model_len tokens: refused before it is tokenized
        self.max_chars = self.max_model_len * max(map(len, self.tokenizer.get_vocab()))

    async def start(self, request: web.Request) -> tuple[dict, str, int]:
        body = P.parse_json(await request.read())
        if unknown := sorted(body.keys() - FIELDS[request.path]):
            raise P.BadRequest(f"{unknown[0]} is not supported by this server", unknown[0])
        for key, allowed in OFF.items():
            if body.get(key) not in allowed:
                raise P.BadRequest(f"{key}={body[key]!r} is not supported by this server", key)
        model = checked(body, "model", self.name, lambda m: isinstance(m, str), "be a string") or self.name
        if model != self.name and model not in self.scheduler.adapters:
            raise P.BadRequest(f"The model `{model}` does not exist. Valid aliases: {self.name}.", "model", 404,
                               "NotFoundError")
        if self.scheduler.paused in ("abort", "wait"):
            raise P.BadRequest("Generation is paused. Please retry after it resumes.", None, 503,
                               "ServiceUnavailableError")
        return body, model, number(body, "n", 1, 1, self.cfg.max_request_rows, integer=True)

    async def tokenize(self, texts: list[str], key: str, chat: bool = False) -> list[list[int]]:
        if long := [len(t) for t in texts if len(t) > self.max_chars]:
            raise P.BadRequest(f"This model's maximum context length is {self.max_model_len} tokens, and {long[0]} "
                               f"characters are more than that many tokens can hold.", key)
        try:
            encode = lambda t: self.tokenizer(t, add_special_tokens=not chat)["input_ids"]
            return await asyncio.to_thread(lambda: [encode(t) for t in texts])
        except Exception as e:  # noqa: BLE001 -- whatever a tokenizer raises on odd text
            raise P.BadRequest(f"{key} could not be tokenized: {type(e).__name__}: {e}", key) from None

    async def prompts(self, body: dict, n: int) -> list[list[int]]:
        one = lambda p: isinstance(p, str) or isinstance(p, list) and p and all(type(t) is int for t in p)
        prompt = [body["prompt"]] if one(body.get("prompt")) else body.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(map(one, prompt))):
            raise P.BadRequest("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if len(prompt) * n > self.cfg.max_request_rows:
            raise P.BadRequest(f"{len(prompt)} prompts x n={n} is {len(prompt) * n} sequences, more than this "
                               f"server's --max_request_rows {self.cfg.max_request_rows}", "prompt")
        tokens = iter(await self.tokenize([p for p in prompt if isinstance(p, str)], "prompt"))
        return [next(tokens) if isinstance(p, str) else p for p in prompt]

    async def chat_prompt(self, body: dict) -> list[list[int]]:
        messages = checked(body, "messages", None, lambda ms: isinstance(ms, list) and ms and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            and m.keys() <= {"role", "content", "name"} for m in ms), "be a non-empty list of {role, content}")
        if self.tokenizer.chat_template is None:
            raise P.BadRequest("As of transformers v4.44, default chat template is no longer allowed, so you must "
                               "provide a chat template if the tokenizer does not define one.")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 -- a template may raise anything on odd messages
            raise P.BadRequest(f"the chat template failed on these messages: {e}", "messages") from None
        return await self.tokenize([text], "messages", chat=True)

    def sampling(self, body: dict, prompts: list[list[int]], n: int, logprobs: int) -> ServerParams:
        for p in prompts:
            if not p:
                raise P.BadRequest("The decoder prompt cannot be empty", "prompt")  # a text of no tokens
            if bad := [t for t in p if not 0 <= t < self.vocab]:
                raise P.BadRequest(f"Token id {bad[0]} is out of vocabulary (size {self.vocab}).", "prompt")
            if len(p) >= self.max_model_len:
                raise P.BadRequest(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                   f"your request has {len(p)} input tokens. Please reduce the length of the input "
                                   "messages.", "prompt")
        seed = checked(body, "seed", None, lambda s: s is None or type(s) is int and -2**63 <= s < 2**63, "be an int64")
        stop = checked(body, "stop", [], lambda s: isinstance(s, (str, list)) and all(
            isinstance(x, str) and x for x in ([s] if isinstance(s, str) else s)),
            "be a non-empty string or a list of them")
        stop_ids = checked(body, "stop_token_ids", [], lambda ids: isinstance(ids, list) and all(
            type(t) is int and 0 <= t < self.vocab for t in ids), f"be a list of token ids in [0, {self.vocab})")
        for key in ("skip_special_tokens", "return_token_ids", "return_tokens_as_token_ids"):
            flag(body, key)
        max_tokens = number(body, "max_completion_tokens", number(body, "max_tokens", 16, 1, integer=True), 1,
                            integer=True)
        if max_tokens > self.max_model_len:
            key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
            raise P.BadRequest(f"{key}={max_tokens} cannot be greater than max_model_len={self.max_model_len}. "
                               f"Please request fewer output tokens.", key)
        if n > 1 and body.get("temperature", 1) == 0:
            raise P.BadRequest(f"n must be 1 when using greedy sampling, got {n}.")
        return ServerParams(
            n=n, seed=seed, logprobs=logprobs, stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(stop_ids), max_tokens=min(max_tokens, self.max_model_len - max(map(len, prompts))),
            ignore_eos=flag(body, "ignore_eos"), min_tokens=number(body, "min_tokens", 0, 0, max_tokens, integer=True),
            logit_bias=self.logit_bias(body), **{key: number(body, key, *r) for key, r in RANGES.items()})

    def logit_bias(self, body: dict) -> dict:
        """{token id: bias}, clamped to [-100, 100] as vLLM does; keys are JSON strings of ids, as OpenAI sends."""
        bias = checked(body, "logit_bias", {}, lambda b: isinstance(b, dict) and all(
            k.isascii() and k.isdigit() and len(k) < 10 and type(v) in (int, float) and math.isfinite(v)
            for k, v in b.items()), "map token ids to finite numbers")
        if bad := sorted(int(k) for k in bias if int(k) >= self.vocab):
            raise P.BadRequest(f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. "
                               f"Vocabulary size: {self.vocab}", "logit_bias")
        return {int(k): min(100.0, max(-100.0, float(v))) for k, v in bias.items()}

    async def completions(self, request: web.Request):
        body, model, n = await self.start(request)
        logprobs = number(body, "logprobs", 0, 0, min(MAX_LOGPROBS, self.vocab), integer=True)
        prompts = await self.prompts(body, n)
        out = await self.scheduler.submit(model, prompts, self.sampling(body, prompts, n, logprobs))
        name = lambda t: f"token_id:{t}" if body.get("return_tokens_as_token_ids") else self.decode([t], False)
        choices = [self.choice(c, body, model) | {
            "logprobs": self.completion_logprobs(c, name, logprobs) if body.get("logprobs") is not None else None,
            "prompt_logprobs": None, "routed_experts": None,
            "prompt_token_ids": prompt if body.get("return_token_ids") else None}
            for prompt, group in zip(prompts, out) for c in group]
        return self.respond(out, prompts, model, {"object": "text_completion", "choices": choices,
                                                  "ec_transfer_params": None, "metrics": None}, "cmpl")

    async def chat(self, request: web.Request):
        body, model, n = await self.start(request)
        logprobs = flag(body, "logprobs")
        top = number(body, "top_logprobs", 0, 0, min(MAX_LOGPROBS, self.vocab), integer=True)
        if top and not logprobs:
            raise P.BadRequest("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        prompts = await self.chat_prompt(body)
        out = await self.scheduler.submit(model, prompts, self.sampling(body, prompts, n, top))
        choices = [self.choice(c, body, model, chat=True) | {
            "logprobs": self.chat_logprobs(c, top) if logprobs else None} for c in out[0]]
        return self.respond(out, prompts, model, {"object": "chat.completion", "choices": choices,
                                                  "prompt_logprobs": None, "prompt_token_ids": None}, "chatcmpl")

    def choice(self, c, body: dict, model: str, chat: bool = False) -> dict:
        """A choice of either route. The text ends before a stop token or stop string, as in vLLM."""
        ids = c.token_ids[:-1] if c.finish_reason == "stop" and c.text is None else c.token_ids
        text = c.text if c.text is not None else self.decode(ids, body.get("skip_special_tokens") in (None, True))
        said = {"message": {"role": "assistant", "content": text, "tool_calls": []}} if chat else {"text": text}
        return said | {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                       "token_ids": c.token_ids if body.get("return_token_ids") else None,
                       "adapter": model, "adapter_digest": c.adapter_digest}

    def completion_logprobs(self, c, name, k: int) -> dict:
        """The sampled token and its k best alternatives (a batch-mate may have asked the engine for more)."""
        tokens, clamp = [name(t) for t in c.token_ids], lambda lp: max(lp, -9999.0)  # -inf is sent as -9999.0
        tops = [{name(t): clamp(lp)} | {name(a): clamp(b) for a, b in list((top or {}).items())[:k]}
                for t, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs or [None] * len(c.token_ids))]
        return {"text_offset": [sum(len(x) for x in tokens[:i]) for i in range(len(tokens))],
                "token_logprobs": [clamp(lp) for lp in c.logprobs], "tokens": tokens, "top_logprobs": tops}

    def chat_logprobs(self, c, top: int) -> dict:
        entry = lambda t, lp: {"token": self.decode([t], False), "logprob": max(lp, -9999.0),
                               "bytes": list(self.decode([t], False).encode())}
        alternatives = c.top_logprobs or [{}] * len(c.token_ids)
        return {"content": [entry(t, lp) | {"top_logprobs": [entry(a, b) for a, b in list(alts.items())[:top]]}
                            for t, lp, alts in zip(c.token_ids, c.logprobs, alternatives)]}

    def respond(self, out, prompts: list[list[int]], model: str, body: dict, prefix: str) -> web.Response:
        completion = sum(len(c.token_ids) for group in out for c in group)
        prompt_tokens = sum(map(len, prompts))  # once per prompt, whatever n is
        digest = ",".join(dict.fromkeys(c.adapter_digest for g in out for c in g if c.finish_reason != "abort"))
        return web.json_response({
            "id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model, **body,
            "choices": [{"index": i} | c for i, c in enumerate(body["choices"])],
            "service_tier": None, "system_fingerprint": None, "kv_transfer_params": None,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion,
                      "completion_tokens": completion, "prompt_tokens_details": None,
                      "completion_tokens_details": None}},
            headers={"X-Adapter-Name": model, "X-Adapter-Digest": digest},
            dumps=lambda data: json.dumps(data, allow_nan=False))  # a NaN or infinity is a bug: a 500 says so

    async def load_lora(self, request: web.Request):
        body = P.parse_json(await request.read())
        name, path = body.get("lora_name"), body.get("lora_path")
        invalid = lambda message, param=None: P.error(400, message, "InvalidUserInput", param)
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            return invalid("Both 'lora_name' and 'lora_path' must be provided.")
        for key, value in (("lora_name", name), ("lora_path", path)):
            if not value.isprintable():  # it goes into headers and texts: no NUL, newline or lone surrogate
                return invalid(f"{key} must be printable text", key)
        if name == self.name:
            return invalid(f"The lora adapter '{name}' conflicts with a served base model.")
        if name in self.scheduler.adapters and not body.get("load_inplace"):
            return invalid(P.already_loaded(name))
        url = "://" in path  # read by lora.read_adapter, wherever it lives
        if not url and not os.path.isabs(path):
            return invalid("lora_path must be an absolute path: this server does not download adapters", "lora_path")
        root = os.path.realpath(self.cfg.lora_root) if self.cfg.lora_root else None
        if root and (url or os.path.commonpath([root, os.path.realpath(path)]) != root):
            return invalid("lora_path lies outside the directory this server may read (--lora_root)", "lora_path")
        try:
            weights = await asyncio.to_thread(self.scheduler.read, path)
        except FileNotFoundError:
            return P.error(404, f"Loading lora {name} failed: {P.NO_ADAPTER} for {path}", "NotFoundError")
        except (ValueError, OSError) as e:
            return P.error(500, f"Call to add_lora method failed: {e}", "InternalServerError")
        if name in self.scheduler.adapters and not body.get("load_inplace"):  # another load won while we read
            return invalid(P.already_loaded(name))
        self.scheduler.add(name, Adapter(path, int(time.time())), weights)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: web.Request):
        name = P.parse_json(await request.read()).get("lora_name")
        if not name or not isinstance(name, str):
            return P.error(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if name not in self.scheduler.adapters:
            return P.error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        self.scheduler.remove(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def models(self, request):
        def card(id_, root, parent, max_len, created):
            return {"id": id_, "object": "model", "created": created, "owned_by": "vllm", "root": root,
                    "parent": parent, "max_model_len": max_len, "permission": []}
        data = [card(self.name, resolve_model(self.cfg.model), None, self.max_model_len, int(time.time()))]
        data += [card(n, a.path, self.name, None, a.created) for n, a in self.scheduler.adapters.items()]
        return web.json_response({"object": "list", "data": data})

    async def pause(self, request):
        if (mode := request.query.get("mode", "abort")) not in ("abort", "wait", "keep"):
            raise P.BadRequest("Input should be 'abort', 'wait' or 'keep'", "query.mode", kind="Bad Request")
        self.scheduler.pause(mode)
        return web.json_response({"status": "paused"})

    async def resume(self, request):
        self.scheduler.resume()
        return web.json_response({"status": "resumed"})

    async def server_info(self, request):
        config = {"model_config": {"model": self.cfg.model, "dtype": str(self.model.dtype),  # "torch.float32", as vLLM
                                   "max_model_len": self.max_model_len, "max_logprobs": MAX_LOGPROBS,
                                   "logprobs_mode": "processed_logprobs"},
                  "parallel_config": {"tensor_parallel_size": 1, "data_parallel_size": 1},
                  "lora_config": {k: getattr(self.cfg, k) for k in ("max_lora_rank", "max_loras", "max_cpu_loras")}}
        as_json = request.query.get("config_format") == "json"
        return web.json_response({"vllm_config": config if as_json else str(config), "system_env": {},
                                  "vllm_env": {"VLLM_SERVER_DEV_MODE": True, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": True}})

    async def fixed(self, request):  # the routes whose answer needs no work
        answers = {"/version": {"version": VERSION}, "/is_paused": {"is_paused": self.scheduler.paused is not None},
                   "/reset_prefix_cache": {"success": True}, "/get_world_size": {"world_size": 1}}
        return web.json_response(answers[request.path]) if request.path in answers else web.Response()  # /health, /ping

    def routes(self) -> list:
        return [
            web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat),
            web.get("/v1/models", self.models), web.post("/v1/load_lora_adapter", self.load_lora),
            web.post("/v1/unload_lora_adapter", self.unload_lora), web.post("/pause", self.pause),
            web.post("/resume", self.resume), web.get("/server_info", self.server_info),
            web.route("*", "/ping", self.fixed), web.post("/reset_prefix_cache", self.fixed),
            *[web.get(path, self.fixed) for path in ("/health", "/version", "/is_paused", "/get_world_size")]]


def main():
    cfg, = parse_config(ServeConfig)
    torch.set_num_threads(cfg.threads)
    server = Server(cfg)

    async def worker(app):  # the scheduler's loop runs beside the routes
        task = asyncio.create_task(server.scheduler.run())
        yield
        task.cancel()
    P.run(cfg, server.routes(), worker, f"minigrpo.replica.serve: {server.name}")


if __name__ == "__main__":
    main()
