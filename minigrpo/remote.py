"""HttpEngine: TorchEngine's interface on `vllm serve`, minigrpo.replica.serve or proxy.py. A version is loaded under
its directory's (never reused) name, requested as model = that name, unloaded once it leaves the staleness window."""
import asyncio
import atexit
import itertools
import json
import os

import aiohttp

from minigrpo import protocol as P
from minigrpo.engine import Completion, SamplingParams


class ServerError(RuntimeError):
    pass


class HttpEngine:
    def __init__(self, url: str, api_key="", max_inflight: int = 64, keep: int = 5, retry_s: float = 300.0, model=""):
        self.url, self.keep, self.retry_s, self.inflight = url.rstrip("/"), keep, retry_s, asyncio.Semaphore(max_inflight)
        self.version, self.loaded, self.loop = None, {}, asyncio.new_event_loop()  # loaded[version] = (name, path)

        async def session():  # made in the engine's own loop (generate() is a plain blocking call); a request may take 600 s
            return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(600, sock_connect=10), headers=P.bearer(api_key))
        self.session = self.loop.run_until_complete(session())
        atexit.register(self.close)  # however the process ends: an open session prints "Unclosed client session"
        # vLLM serves an adapter made for another model, and cuts a completion short at max_model_len: both silently
        base = P.card_of(self.loop.run_until_complete(self._call("GET", "/v1/models"))[1]) if model else {}
        if (root := base.get("root")) and os.path.basename(root.rstrip("/")) != os.path.basename(model.rstrip("/")):
            raise ServerError(f"{self.url} serves {root}, but this run trains {model}, and its adapters fit only that model")
        self.max_len = base.get("max_model_len") or float("inf")

    async def _call(self, method: str, path: str, body=None) -> tuple[int, str]:
        """(status, text), retrying transport errors and 5xx for up to retry_s: a starting or restarting server."""
        deadline, last = self.loop.time() + self.retry_s, None
        for attempt in itertools.count():
            try:
                async with self.session.request(method, self.url + path, json=body) as resp:
                    text = await resp.text()
                    if resp.status == 401:  # the same key would be refused again: no retry
                        raise ServerError(f"{self.url} refused the key (401): pass --api_key KEY or MINIGRPO_API_KEY")
                    if resp.status not in (500, 502, 503, 504):
                        return resp.status, text
                    last = f"{resp.status} {text[:300]}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
            if self.loop.time() > deadline:
                raise ServerError(f"{method} {self.url}{path} failed for {self.retry_s:.0f}s; last: {last}")
            if attempt == 3:
                print(f"{method} {self.url}{path}: {last}; retrying for up to {self.retry_s:.0f}s", flush=True)
            await asyncio.sleep(min(0.5 * 2 ** attempt, 8.0))

    async def _load(self, name: str, path: str):
        status, text = await self._call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if status == 400 and P.LOADED in text:  # another generator was first: fine if /v1/models shows this path
            if (there := P.card_of((await self._call("GET", "/v1/models"))[1], name).get("root")) != path:
                raise ServerError(f"{self.url} already serves {name} from {there}, not from {path}")
        elif status != 200:
            raise ServerError(f"{self.url} refused to load {name} from {path}: {status} {text[:300]}")

    def load_adapter(self, version: int, path: str):
        path = path if "://" in path else os.path.abspath(path)  # as the server will find it
        self.loop.run_until_complete(self._load(name := path.rstrip("/").rsplit("/", 1)[-1], path))  # the directory's name
        self.loaded[version], self.version = (name, path), version
        for old in [v for v in self.loaded if v <= version - self.keep]:  # left the staleness window; 404 is fine
            self.loop.run_until_complete(self._call("POST", "/v1/unload_lora_adapter", {"lora_name": self.loaded.pop(old)[0]}))

    async def _complete(self, prompt: list[int], sp: SamplingParams) -> list[Completion]:
        name, path = self.loaded[self.version]
        if len(prompt) + sp.max_tokens > self.max_len:
            raise ServerError(f"{self.url} takes at most {self.max_len} tokens (its max_model_len), fewer than a prompt of "
                              f"{len(prompt)} + max_new_tokens {sp.max_tokens}: start the replicas with a larger --max-model-len")
        body = {"model": name, "prompt": prompt, "n": sp.n, "max_tokens": sp.max_tokens, "temperature": sp.temperature,
                "top_p": 1.0, "top_k": 0, "logprobs": 0, "return_token_ids": True, "seed": sp.seed}
        async with self.inflight:
            status, text = await self._call("POST", "/v1/completions", body)
            if status == 404 and "does not exist" in text:  # a replica restarted and forgot the adapter
                await self._load(name, path)
                status, text = await self._call("POST", "/v1/completions", body)
        if status != 200:
            raise ServerError(f"{self.url}/v1/completions answered {status}: {text[:300]}")
        return [Completion(c["token_ids"], c["logprobs"]["token_logprobs"], "stop" if c["finish_reason"] == "stop" else "length",
                           c.get("adapter_digest") or "") for c in sorted(json.loads(text)["choices"], key=lambda c: c["index"])]

    def generate(self, prompts: list[list[int]], params) -> list[list[Completion]]:  # params: one, or one per prompt
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else params

        async def run():
            return await asyncio.gather(*(self._complete(p, sp) for p, sp in zip(prompts, params)))
        return list(self.loop.run_until_complete(run()))

    def close(self):
        self.loop.run_until_complete(self.session.close())

