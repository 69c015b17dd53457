"""The run: the settings every process must agree on (RUN/run.json), the trainer's lease (RUN/owner.json), the
metrics records (RUN/metrics/) and the fault points the crash tests use. All of it goes through storage.py.
"""
import contextlib
import dataclasses
import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from minigrpo.lora import DEFAULT_TARGETS


@dataclass
class RunSettings:
    """Settings the trainer and every generator must share. Written once to RUN/run.json, checked by each joiner."""
    model: str = field(default="demo", metadata={"help": "base model: 'demo' (built in), a local folder or a hub id"})
    task: str = field(default="reverse_add", metadata={"help": "prompt set and reward: reverse_add | math (minigrpo/tasks.py)"})
    task_data: str = field(default="", metadata={"help": "math: a .jsonl/.parquet file or hf://datasets/OWNER/NAME/FILE"})
    task_fields: str = field(default="problem,answer", metadata={"help": "math: the problem and answer field names"})
    system_prompt: str = field(default="", metadata={"help": "system message for models with a chat template"})
    reasoning: bool = field(default=False, metadata={"help": "math: grade only after </think> (R1-style models)"})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank r"})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA alpha; the update is scaled by alpha / r"})
    lora_targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS),
                                    metadata={"help": "names of the linear layers that get a LoRA"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature; the trainer's log-probs use it too"})
    group_size: int = field(default=8, metadata={"help": "G: completions per prompt, normalised together"})
    max_new_tokens: int = field(default=8, metadata={"help": "completion length limit (also Dr. GRPO's constant)"})
    max_prompt_len: int = field(default=2048, metadata={"help": "longest prompt in tokens; longer groups are refused"})
    max_staleness: int = field(default=4, metadata={"help": "drop groups more than this many adapter versions old"})

    def is_fresh(self, trainer_version: int, policy_version: int) -> bool:
        """The staleness window: drop a group more than max_staleness versions behind (strict >, as TRL does)."""
        return trainer_version - policy_version <= self.max_staleness


# Recipes as flags (README, "Real models"). Each script applies the flags its own config has; later flags win.
PRESETS = {"qwen-math-1.5b": dict(  # the blog's run: Dr. GRPO with truncated IS at 2 (the oat / "off-policy RL" recipe)
    model="Qwen/Qwen2.5-Math-1.5B", task="math", lora_r=1, lora_alpha=2, group_size=8, max_new_tokens=3000,
    temperature=1.0, lr=4e-5, groups_per_step=16, max_staleness=4, sync_every=4, loss_type="dr_grpo",
    old_logp="recompute", tis_cap=2.0, dtype="bfloat16", micro_batch_tokens=16384, eval_every=50, eval_size=500,
    max_steps=500)}
PRESETS["r1-distill-1.5b"] = PRESETS["qwen-math-1.5b"] | dict(  # the same for a reasoning model: grade after </think>
    model="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", reasoning=True, max_new_tokens=8192)


def parse_config(*types, argv=None):
    """HfArgumentParser over the dataclasses, after expanding --preset NAME into the flags these dataclasses know."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--preset" in argv:
        i = argv.index("--preset")
        name = argv[i + 1] if i + 1 < len(argv) else ""
        if name not in PRESETS:
            raise SystemExit(f"--preset must be one of {sorted(PRESETS)}, got {name!r}")
        known = {f.name for t in types for f in dataclasses.fields(t)}
        flags = [x for k, v in PRESETS[name].items() if k in known for x in (f"--{k}", str(v))]
        argv = flags + argv[:i] + argv[i + 2:]  # flags given on the command line come later, and win
    parser = HfArgumentParser(types, epilog=f"--preset NAME applies a recipe first: {', '.join(sorted(PRESETS))}")
    return parser.parse_args_into_dataclasses(argv)


FAULT = os.environ.get("MINIGRPO_FAULT", "")  # <point>:<step>, for the crash tests; read once


def fault(point: str, step: int):
    """Exit like SIGKILL (os._exit(137)) the first time the trainer reaches that point at or after that step."""
    if FAULT and FAULT.split(":")[0] == point and step >= int(FAULT.split(":")[1]):
        print(f"MINIGRPO_FAULT: exiting at {point}, step {step}", flush=True)
        os._exit(137)


def read_json(storage, key: str):
    """A small JSON object, or None if absent; a damaged one is one clear line, not a traceback."""
    try:
        return json.loads(storage.get(key))
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise SystemExit(f"{storage.url(key)} is damaged (not valid JSON: {e}): restore it or change --run_dir") from e


def create_run(storage, settings: RunSettings) -> dict:
    if read_json(storage, "run.json") is None:
        if storage.list("adapters") or storage.list("checkpoints"):
            raise SystemExit(f"{storage.url('run.json')} is missing but the run has adapters or checkpoints: "
                             f"restore run.json, or start a new run with another --run_dir.")
        run = dataclasses.asdict(settings) | {"run_id": uuid.uuid4().hex[:8], "created": time.time()}
        storage.put("run.json", json.dumps(run, indent=2))
    return join_run(storage, settings)


def join_run(storage, settings: RunSettings, timeout_s: float = 600.0) -> dict:
    """Wait for the trainer to create run.json, then check that it has this process's settings. Returns it."""
    t0 = time.time()
    while (theirs := read_json(storage, "run.json")) is None:
        if time.time() - t0 > timeout_s:
            raise SystemExit(f"no {storage.url('run.json')} after {timeout_s:.0f}s: is train.py running with "
                             f"this --run_dir? (the trainer creates the run)")
        time.sleep(storage.poll_s)
    diff = [f"{k}: run.json has {theirs.get(k)!r}, this process has {v!r}"
            for k, v in dataclasses.asdict(settings).items() if theirs.get(k) != v]
    if diff:
        raise SystemExit(f"{storage.url('run.json')} was written with other settings; start this process with the "
                         f"same ones (or use another --run_dir):\n  " + "\n  ".join(diff))
    return theirs


def dead_here(lease: dict) -> bool:
    """A killed trainer on this same host: its lease can be taken at once (a restart after SIGKILL)."""
    if lease.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(lease.get("pid", 0)), 0)  # signal 0 only asks whether the process exists
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError, TypeError, OverflowError):  # another user's process, or no usable pid
        pass
    return False


class Lease:
    """owner.json, the trainer's lease (README, "The run directory"); generators read its progress for backpressure."""

    def __init__(self, storage, timeout_s: float = 60.0, **about):  # about: what generators may read (groups_per_step)
        self.storage, self.timeout_s, self.lock, self.stop = storage, timeout_s, threading.Lock(), threading.Event()
        self.info = {"owner": uuid.uuid4().hex[:12], "host": socket.gethostname(), "pid": os.getpid(),
                     "timeout_s": timeout_s, **about}

    def acquire(self):
        theirs = read_json(self.storage, "owner.json")
        age = time.time() - theirs.get("heartbeat", 0) if theirs else 0
        if theirs and age < self.timeout_s and not dead_here(theirs):
            raise SystemExit(f"{self.storage.url()} is owned by trainer {theirs.get('owner')} (host {theirs.get('host')}, "
                             f"pid {theirs.get('pid')}), heartbeat {age:.0f}s ago. One trainer per run: stop it, or "
                             f"wait until its lease is {self.timeout_s:.0f}s old (--lease_timeout_s) to take over.")
        self.write()
        time.sleep(min(1.0, self.timeout_s / 10))  # two trainers that start together: the last write wins
        self.check()
        threading.Thread(target=self._beat, daemon=True).start()
        return theirs  # the previous owner's lease, if this is a takeover

    def write(self, **progress):
        with self.lock:
            self.info |= progress | {"heartbeat": time.time()}
            self.storage.put("owner.json", json.dumps(self.info))

    def check(self):
        theirs = read_json(self.storage, "owner.json") or {}
        if theirs.get("owner") != self.info["owner"]:
            print(f"lease lost: {self.storage.url('owner.json')} now names trainer {theirs.get('owner')} "
                  f"(host {theirs.get('host')}, pid {theirs.get('pid')}); exiting without writing", flush=True)
            os._exit(1)

    def _beat(self):
        while not self.stop.wait(self.timeout_s / 6):
            with contextlib.suppress(OSError):  # a full disk or a refused bucket: the main thread meets it too
                self.check()
                self.write()

    def release(self):
        self.stop.set()
        with self.lock:
            self.storage.delete("owner.json")


class Metrics:
    """One JSON record per step: printed as one console line and kept in RUN/metrics/<name>-<life>-<seg>.jsonl.
    Object stores cannot append, so the current segment (at most `segment` records) is rewritten whole."""

    def __init__(self, storage, name: str, segment: int = 25):
        self.storage, self.segment, self.records = storage, segment, []
        self.prefix, self.n = f"metrics/{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}", 0

    def log(self, record: dict, line: str):
        if len(self.records) == self.segment:
            self.records, self.n = [], self.n + 1
        self.records.append(json.dumps(record))
        self.storage.put(f"{self.prefix}-{self.n:05d}.jsonl", "\n".join(self.records) + "\n")
        print(line, flush=True)


def read_records(storage, name: str) -> list[dict]:
    """Every record of metrics/<name>*.jsonl in time order (a redone step has several: see latest_per_step)."""
    files = [f for f in storage.list("metrics") if f.startswith(name) and f.endswith(".jsonl")]
    lines = [line for f in files for line in storage.get(f"metrics/{f}").decode().splitlines() if line]
    return sorted(map(json.loads, lines), key=lambda r: r.get("time", 0))


def latest_per_step(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records}  # records are in time order: the last one of a step wins
