"""The server's batching scheduler: requests that arrive together share a batch, fairly, one adapter at a time.

A request is cut into one unit per prompt (its n rows). Each round takes one unit from each waiting request in
turn, and again, until the round holds --max_batch_rows rows or --max_loras distinct adapters, then runs one
engine call per adapter; a failed call is run again one request at a time. Switching the LoRA layers is all or
nothing: the weights are checked whole before the first layer is written. An adapter evicted from the LRU cache
(--max_cpu_loras) is read again from its path, as vLLM does, and checked again.
"""
import asyncio
import collections
import threading

from minigrpo.replica.sampling import Choice, ServerParams
from minigrpo.lora import apply_adapter, check_adapter, check_config, read_adapter


Weights = collections.namedtuple("Weights", "r scaling tensors digest")  # an adapter, read and checked whole
Adapter = collections.namedtuple("Adapter", "path created")  # a loaded name's record; a reload makes a new one
BASE = Weights(0, 0.0, {}, "")  # the base model: every LoRA layer zeroed and switched off


class Job:  # one request
    def __init__(self, model: str, prompts: list[list[int]], params: ServerParams, future: asyncio.Future):
        self.model, self.prompts, self.params, self.future = model, prompts, params, future  # model: base or adapter
        self.waiting = collections.deque(range(len(prompts)))  # prompts not yet in a round
        self.results = [None] * len(prompts)  # per prompt, its n Choices once sampled

    def finish(self, i: int, completions: list[Choice]):
        self.results[i] = completions
        if None not in self.results and not self.future.done():
            self.future.set_result(self.results)

    def fail(self, e: Exception):
        self.waiting.clear()
        if not self.future.done():
            self.future.set_exception(e)


class Scheduler:
    def __init__(self, model, engine, base: str, cfg):  # cfg: the server's ServeConfig, for its limits
        self.model, self.engine, self.base, self.cfg = model, engine, base, cfg
        self.adapters: dict[str, Adapter] = {}
        self.cache = collections.OrderedDict()  # name -> Weights, least recently used first
        self.lock = threading.Lock()  # the cache is touched by the event loop (loads) and the sampling thread
        self.active = None  # the Adapter record (or base name) whose weights the LoRA layers hold now
        self.jobs: collections.deque[Job] = collections.deque()
        self.wake, self.resumed = asyncio.Event(), asyncio.Event()
        self.resumed.set()
        self.paused = None  # None, or the pause mode

    def read(self, path: str) -> Weights:
        """Read and check an adapter whole (FileNotFoundError, or ValueError with vLLM's reason); writes nothing."""
        config, tensors, digest = read_adapter(path)
        r, scaling = check_config(config)
        if r > self.cfg.max_lora_rank:
            raise ValueError(f"LoRA rank {r} is greater than max_lora_rank {self.cfg.max_lora_rank}.")
        check_adapter(self.model, tensors, r)
        return Weights(r, scaling, tensors, digest)

    def weights(self, name: str, fresh: Weights | None = None) -> Weights:
        with self.lock:
            w = fresh or self.cache.pop(name, None) or self.read(self.adapters[name].path)
            self.cache[name] = w  # now the most recently used
            while len(self.cache) > self.cfg.max_cpu_loras:
                self.cache.popitem(last=False)
            return w

    def add(self, name: str, adapter: Adapter, weights: Weights):
        self.adapters[name] = adapter  # a new record: an in-place reload is applied on next use
        self.weights(name, weights)

    def remove(self, name: str):
        del self.adapters[name]
        with self.lock:
            self.cache.pop(name, None)

    async def submit(self, model: str, prompts: list[list[int]], params: ServerParams):
        job = Job(model, prompts, params, asyncio.get_running_loop().create_future())
        self.jobs.append(job)
        self.wake.set()
        return await job.future

    def take(self) -> list[tuple[Job, int]]:
        names, units, rows, more = set(), [], 0, True
        while more:
            more = False
            for job in self.jobs:
                rows_after = rows + job.params.n
                if job.waiting and (job.model in names or len(names) < self.cfg.max_loras) and (
                        not units or rows_after <= self.cfg.max_batch_rows):
                    names.add(job.model)
                    units.append((job, job.waiting.popleft()))
                    rows, more = rows_after, True
        self.jobs = collections.deque(j for j in self.jobs if j.waiting)
        return units

    def sample(self, name: str, units: list[tuple[Job, int]]) -> list[list[Choice]]:
        """In the sampling thread: point the LoRA layers at this adapter (or switch them off for the base), sample."""
        target = self.base if name == self.base else self.adapters[name]
        if self.active is not target:
            self.active = None  # until every layer holds the new weights
            w = BASE if name == self.base else self.weights(name)
            apply_adapter(self.model, w.tensors, w.r, w.scaling)
            self.engine.digest, self.active = w.digest, target
        return self.engine.generate([job.prompts[i] for job, i in units], [job.params for job, _ in units])

    async def run(self):
        while True:
            await self.wake.wait()
            self.wake.clear()
            while self.jobs:
                await self.resumed.wait()  # a pause with mode=keep freezes what is queued until /resume
                units = self.take()
                for name in dict.fromkeys(job.model for job, _ in units):
                    await self.run_alone_on_failure(name, [u for u in units if u[0].model == name])

    async def run_alone_on_failure(self, name: str, units: list[tuple[Job, int]]):
        try:
            outs = await asyncio.to_thread(self.sample, name, units)
        except Exception as e:  # noqa: BLE001 -- whatever broke, it is answered as a 500 and the server goes on
            jobs = list(dict.fromkeys(job for job, _ in units))
            if len(jobs) == 1:
                return jobs[0].fail(e)
            for job in jobs:  # find who caused it: each request again, alone
                await self.run_alone_on_failure(name, [u for u in units if u[0] is job])
            return
        for (job, i), out in zip(units, outs):
            job.finish(i, out)

    def pause(self, mode: str):
        self.paused = mode
        if mode == "keep":
            self.resumed.clear()
        elif mode == "abort":  # prompts not yet sampled end now, as aborted
            for job in self.jobs:
                while job.waiting:
                    job.finish(job.waiting.popleft(), [Choice([], [], "abort")] * job.params.n)
            self.jobs.clear()

    def resume(self):
        self.paused = None
        self.resumed.set()
