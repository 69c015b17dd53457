"""The run: the flags (read without torch: --help answers at once), the settings every process must agree on
(RUN/run.json), the trainer's lease (RUN/owner.json), the metrics (RUN/metrics/) and the crash tests' fault points."""
import argparse
import contextlib
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Literal, get_args, get_origin

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # LoRA's layers


@dataclass
class RunSettings:  # shared by the trainer and every generator: written once to RUN/run.json, checked by each joiner
    model: str = field(default="demo", metadata={"help": "base model: 'demo' (built in), a local folder or a hub id"})
    task: str = field(default="reverse_add", metadata={"help": "prompts and reward: reverse_add | math | calculator"})
    task_data: str = field(default="", metadata={"help": "math, calculator: a .jsonl/.parquet file or hf://datasets/..."})
    task_fields: str = field(default="problem,answer", metadata={"help": "math: the problem and answer field names"})
    system_prompt: str = field(default="", metadata={"help": "system message for models with a chat template"})
    reasoning: bool = field(default=False, metadata={"help": "math: grade only after </think> (R1-style models)"})
    answer_format: Literal["boxed", "last_number", "answer_line"] = field(default="boxed", metadata={
        "help": "math: grade the last \\boxed{}, the last number, or what follows the last 'Answer:'"})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank r"})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA alpha; the update is scaled by alpha / r"})
    lora_targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS),
                                    metadata={"help": "names of the linear layers that get a LoRA"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature; the trainer's log-probs use it too"})
    group_size: int = field(default=8, metadata={"help": "G: completions per prompt, normalised together"})
    max_new_tokens: int = field(default=8, metadata={"help": "completion length limit, all turns and replies together "
                                "(also Dr. GRPO's constant)"})
    max_turns: int = field(default=1, metadata={"help": "policy turns per completion: the task's reply comes between "
                           "(reverse_add, math: a second try after a wrong answer; calculator: a tool call)"})
    max_prompt_len: int = field(default=2048, metadata={"help": "longest prompt in tokens; longer groups are refused"})
    max_staleness: int = field(default=4, metadata={"help": "drop groups more than this many adapter versions old"})
    generator_dtype: Literal["float32", "bfloat16", "float16"] = field(default="float32", metadata={"help": "the "
        "generators' weights (vLLM: its --dtype); the trainer's policy check allows for their rounding"})

    def is_fresh(self, trainer_version: int, policy_version: int) -> bool:  # the staleness window (strict >, as TRL does)
        return trainer_version - policy_version <= self.max_staleness


def check_model(run: RunSettings) -> RunSettings:  # a wrong --model: one line before torch loads, not the hub's retries
    import huggingface_hub as hub  # a hub id must be cached, or known to the hub (not asked under HF_HUB_OFFLINE=1)
    try:
        if run.model != "demo" and not os.path.isdir(run.model) and not isinstance(hub.try_to_load_from_cache(run.model, "config.json"), str):
            hub.model_info(run.model, timeout=10)
    except Exception as e:  # not an id (a missing folder's path), an unknown or private one, no network
        raise SystemExit(f"--model {run.model}: no such folder, nor a hub id that is cached or answers ({type(e).__name__})") from None
    return run


@dataclass
class LossConfig:  # the loss's settings (minigrpo/grpo.py); train.py's TrainConfig extends it, so each is a flag of train.py
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = field(default="dapo", metadata={"help": "see minigrpo/grpo.py"})
    eps_low: float = field(default=0.2, metadata={"help": "clip the ratio below at 1 - eps_low"})
    eps_high: float | None = field(default=None, metadata={"help": "clip above at 1 + eps_high (dapo: 0.28, else eps_low)"})
    tis_cap: float | None = field(default=None, metadata={"help": "truncated IS cap on pi_old/mu (2 if --old_logp recompute)"})

    def __post_init__(self):  # eps_high's default: DAPO's clip-higher for dapo, else a symmetric clip; tis_cap's: train.py's
        self.eps_high = (0.28 if self.loss_type == "dapo" else self.eps_low) if self.eps_high is None else self.eps_high
        self.tis_cap = 2.0 if self.tis_cap is None and getattr(self, "old_logp", "") == "recompute" else self.tis_cap


class HelpFormat(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help: the script's docstring (its example commands) as written, then every flag with its default."""


def parse_config(*types, argv=None):  # the flags, one dataclass each; a bad flag or value: one line (exit 2), no usage
    if argv is None:  # a script starting: Ctrl-C stops it even as a shell's background job, which starts with SIGINT ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__, formatter_class=HelpFormat)
    parser.error = lambda message: parser.exit(2, f"{parser.prog}: {message} (--help lists the flags)\n")
    for f in [f for t in types for f in fields(t)]:  # str, int, float, bool, X | None, Literal or list[str]; metadata: help
        kind = get_args(f.type)[0] if type(None) in get_args(f.type) else f.type  # float | None: a float
        how = {"choices": get_args(kind)} if get_origin(kind) is Literal else {"nargs": "+"} if get_origin(kind) is list \
            else {"nargs": "?", "const": True, "type": boolean} if kind is bool else {"type": kind}
        default = f.default if f.default_factory is MISSING else f.default_factory()
        names = dict.fromkeys([f"--{f.name}", f"--{f.name.replace('_', '-')}"])  # --run_dir, or --run-dir as vLLM spells it
        parser.add_argument(*names, **{"required": True} if default is MISSING else {"default": default}, **how, **f.metadata)
    args = parser.parse_args(argv)
    return [t(**{f.name: getattr(args, f.name) for f in fields(t)}) for t in types]


def boolean(text: str) -> bool:  # --flag alone is true; --flag false (or no, n, f, 0), true (yes, y, t, 1); else ValueError
    return ("false", "no", "n", "f", "0", "true", "yes", "y", "t", "1").index(text.lower()) >= 5


FAULTS = [f.split(":") for f in os.environ.get("MINIGRPO_FAULT", "").split(",") if f]  # for the crash tests; read once
WRITING = threading.RLock()  # held by the lease's writes: a pause point never stops the heartbeat inside one
if clock := [float(f[1]) for f in FAULTS if f[0] == "clock"]:  # a wall clock off by that many seconds
    time.time = lambda _time=time.time: _time() + clock[0]


def fault(point: str, step: int):
    """<point>:<step>: os._exit(137) (as SIGKILL) there from that step on; <point>:<step>:pause: SIGSTOP once (a frozen VM)."""
    for f in [f for f in FAULTS if f[0] == point and step >= int(f[1])]:
        print(f"MINIGRPO_FAULT: {'pausing' if f[2:] else 'exiting'} at {point}, step {step}", flush=True)
        if not f[2:]:
            os._exit(137)
        FAULTS.remove(f)
        with WRITING:
            os.kill(os.getpid(), signal.SIGSTOP)


def create_run(storage, settings: RunSettings, grader: str = "") -> dict:  # grader: the one that must score every group
    if not storage.exists("run.json"):
        if storage.list("adapters") or storage.list("checkpoints"):
            raise SystemExit(f"{storage.url('run.json')} is missing but the run has adapters or checkpoints: restore it, or use another --run_dir.")
        run = asdict(settings) | {"run_id": uuid.uuid4().hex[:8], "created": time.time(), "grader": grader}
        storage.put("run.json", json.dumps(run, indent=2))
    return join_run(storage, settings)


def join_run(storage, settings: RunSettings, timeout_s: float = 600.0) -> dict:  # wait for run.json; it must have our settings
    t0, url = time.time(), storage.url("run.json")
    if not storage.exists("run.json"):
        print(f"waiting up to {timeout_s:.0f}s for {url}: train.py creates it", flush=True)
    while not storage.exists("run.json"):
        if time.time() - t0 > timeout_s:
            raise SystemExit(f"no {url} after {timeout_s:.0f}s: is train.py running with this --run_dir? It creates it")
        time.sleep(storage.poll_s)
    try:
        theirs = json.loads(storage.get("run.json"))
    except ValueError as e:  # a damaged run.json is one clear line, not a traceback
        raise SystemExit(f"{url} is damaged (not valid JSON: {e}): restore it or change --run_dir") from e
    if diff := [f"{k}: run.json has {theirs.get(k)!r}, this process has {v!r}"
                for k, v in asdict(settings).items() if theirs.get(k) != v]:
        raise SystemExit(f"{url} was written with other settings; start this process with the same ones (or use "
                         f"another --run_dir):\n  " + "\n  ".join(diff))
    return theirs


def here() -> dict:  # what makes a pid one process: host, boot and PID namespace (two containers share a hostname)
    with open("/proc/sys/kernel/random/boot_id") as f:
        return {"host": socket.gethostname(), "boot": f.read().strip(), "pidns": os.stat("/proc/self/ns/pid").st_ino}


def dead_here(lease: dict) -> bool:  # its trainer died here (host, boot, PID namespace): take the lease at once (a restart)
    try:
        if {k: lease[k] for k in ("host", "boot", "pidns")} == here() and lease["pid"] > 0:
            os.kill(lease["pid"], 0)  # signal 0 only asks whether the process exists
    except (ProcessLookupError, PermissionError, OverflowError) as e:  # gone; another user's process; no usable pid
        return isinstance(e, ProcessLookupError)
    return False


LEASE = {"owner": "", "host": "", "boot": "", "pidns": 0, "pid": 0, "epoch": 0, "timeout_s": 60.0, "checkpoints": None, "waiting": -1,
         "seen": {}, "writers": 0, "groups_per_step": 1, "version": -1}  # the fields readers rely on, and their defaults


def lease_view(raw: bytes | None) -> dict:
    """owner.json's fields with the types readers rely on. Anything else (not JSON, a list, a string heartbeat, an
    infinite timeout) reads as missing, so a hostile lease can at worst look like a dead one."""
    with contextlib.suppress(ValueError, RecursionError):  # not JSON: raw stays bytes, which reads as {} below
        raw = json.loads(raw or b"{}")
    lease = raw if isinstance(raw, dict) else {}
    out = {k: v if type(v := lease.get(k)) is type(d) or type(d) is float and type(v) is int else d for k, d in LEASE.items()}
    listed = isinstance(c := lease.get("checkpoints"), list) and all(isinstance(name, str) for name in c)
    return out | {"seen": {k: v for k, v in out["seen"].items() if type(v) is int}, "checkpoints": c if listed else None,
                  "timeout_s": out["timeout_s"] if 0 < out["timeout_s"] < 1e6 else LEASE["timeout_s"]}


class Lease:
    """owner.json, the trainer's lease and fencing token (README, "The run directory"): each life takes a higher
    epoch, bumps `beat` every timeout_s / 6, and writes owner.json only if it is still its own last write."""

    def __init__(self, storage, timeout_s: float = 60.0, **about):  # about: what generators may read (groups_per_step)
        self.storage, self.timeout_s, self.lock = storage, timeout_s, WRITING
        self.stop, self.wake = threading.Event(), threading.Event()  # the heartbeat's: stop it, write now
        self.info = {"owner": uuid.uuid4().hex[:12], **here(), "pid": os.getpid(), "beat": 0, "timeout_s": timeout_s, **about}

    def acquire(self) -> dict | None:  # take it if absent, if its owner died here or if unchanged for timeout_s; else refuse
        raw, self.token = self.storage.versioned("owner.json")
        theirs, since = lease_view(raw), time.monotonic()  # this process's clock: another's skew cannot fool it
        while raw is not None and not dead_here(theirs) and time.monotonic() - since < self.timeout_s:
            time.sleep(min(1.0, self.timeout_s / 20))
            if self.storage.versioned("owner.json")[0] != raw:
                raise SystemExit(f"{self.storage.url()} is owned by trainer {theirs['owner']} (host {theirs['host']}, "
                                 f"pid {theirs['pid']}, epoch {theirs['epoch']}): its heartbeat moved within "
                                 f"{time.monotonic() - since:.0f}s. One trainer per run: stop it, or start this "
                                 f"one once the lease stays unchanged for {self.timeout_s:.0f}s (--lease_timeout_s).")
        epochs = [int(m[1]) for name in self.storage.list("metrics") if (m := re.match(r"train-e(\d+)-", name))]
        self.info |= {"epoch": max([theirs["epoch"], *epochs]) + 1,  # and metrics/'s epochs: owner.json may be garbage
                      "checkpoints": theirs["checkpoints"] if raw is not None or epochs else []}  # a new run has none
        if self.info["epoch"] > 999_999:  # names carry it in six digits, which must sort as numbers
            raise SystemExit(f"{self.storage.url()}: owner.json or metrics/ claim epoch {self.info['epoch'] - 1}: past 999998")
        self.write()
        self.beat = threading.Thread(target=self._beat, daemon=True)
        self.beat.start()
        return theirs if raw is not None else None

    def write(self, wait=True, **progress):  # beat + 1; wait=False: the heartbeat's thread writes it, the caller goes on
        with self.lock:
            self.info |= progress | {"beat": self.info["beat"] + 1}
            if not wait:
                return self.wake.set()
            try:
                self.token = self.storage.swap("owner.json", data := json.dumps(self.info), self.token)
            except FileExistsError:  # another trainer's write, or a retried request of our own that had landed
                raw, token = self.storage.versioned("owner.json")
                if raw != data.encode():
                    self.lost()  # its token is never taken: a lost lease stays lost
                self.token = token

    def fenced(self, write, *args, **progress):
        """write(*args) only while this trainer holds the lease, as a conditional write of owner.json (progress included)
        proves: under the run's lock on a local disk, right before it elsewhere. A refused write is tried once more."""
        for refused in ((FileExistsError,), ()):  # the second time nothing is suppressed
            with self.lock, self.storage.locked():
                self.write(**progress)
                with contextlib.suppress(*refused):
                    return write(*args)

    def lost(self):
        theirs = lease_view(self.storage.versioned("owner.json")[0])
        print(f"lease lost: {self.storage.url('owner.json')} names trainer {theirs['owner']} (epoch {theirs['epoch']}, "
              f"host {theirs['host']}); exiting without writing", flush=True)
        os._exit(1)

    def _beat(self):  # a write every timeout_s / 6, or when woken; once stopped, not one more
        while (self.wake.wait(self.timeout_s / 6) or True) and not self.stop.is_set():
            self.wake.clear()
            with contextlib.suppress(OSError):  # a full disk or a refused bucket: the main thread meets it too
                self.write()

    def release(self):
        self.stop.set()
        self.wake.set()
        self.beat.join()
        self.fenced(self.storage.delete, "owner.json")


def tracker(report_to: str, project: str, name: str, config: dict):
    """(send(numbers, step), finish) for --report_to's run `name`, created or continued; None for none."""
    if report_to == "none":
        return None
    wandb = {"id": name} if report_to == "wandb" else {}  # wandb continues a run by its id
    try:  # imported here, not at the top: both trackers are optional
        run = __import__(report_to).init(project=project, name=name, config=config, resume="allow", **wandb)
    except ImportError:
        raise SystemExit(f"--report_to {report_to}: not installed; pip install -r requirements-trackers.txt") from None
    except Exception as e:  # not logged in, a project it may not write: the tracker's own words, in one line
        raise SystemExit(f"--report_to {report_to}: {type(e).__name__}: {e}".splitlines()[0]) from None

    def send(numbers: dict, step: int):  # out of this process before it returns: a kill cannot lose it here
        run.log(numbers, step=step, **{"commit": True} if wandb else {})  # wandb: uncommitted, a row waits for a later step
        if not wandb:
            with run._client_lock:  # trackio's own thread writes every 0.5 s; write now, as that thread does
                run._flush_queues_inline()
    return send, run.finish


class Metrics:
    """One JSON record per step: a console line, RUN/metrics/<name>-<life>-<seg>.jsonl (a bucket cannot append: the current
    segment, up to `segment` records, is rewritten whole with a line, there at most each 5 s) and the tracker, past lives' steps."""

    def __init__(self, storage, name: str, tracker=None, lives: str = "", segment: int = 25):
        self.storage, self.segment, self.records, self.flushed = storage, segment, [], 0.0
        self.prefix, self.n = f"metrics/{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}", 0
        self.send, close = tracker or (None, lambda: None)
        self.finish = lambda: (self.flush(), close())  # the records not yet written, then the tracker's end
        earlier = read_records(storage, lives or f"{name}-") if tracker else []  # lives: all lives' names begin so
        self.last = max((r.get("step", i) for i, r in enumerate(earlier)), default=-1)  # a generator's: batches

    def log(self, record: dict, line: str | None):
        if len(self.records) == self.segment:
            self.records, self.n = [], self.n + 1
        self.records.append(json.dumps(record))
        if line is not None and (self.storage.local or time.time() - self.flushed >= 5) or len(self.records) == self.segment:
            self.flush()  # a bucket bills each write: at most one each 5 s (train.py flushes before a checkpoint)
        if line:  # one write, newline included: two processes on one terminal do not merge mid-line
            print(line + "\n", end="", flush=True)
        if self.send and (step := record.get("step", self.last + 1)) > self.last:  # after the record: never sent twice
            self.send({k: v for k, v in record.items() if type(v) in (int, float) and k not in ("step", "time")}, step)
            self.last = step

    def flush(self):
        self.flushed = time.time()  # before the write: a generator's lines, 5 s apart on its clock, are each written
        self.storage.put(f"{self.prefix}-{self.n:05d}.jsonl", "\n".join(self.records) + "\n")


def read_records(storage, name: str, bad: list | None = None) -> list[dict]:
    """Every record of metrics/<name>*.jsonl, in the segments' name order (a trainer's begin with its epoch, so a
    redone step's record from the newest life comes last, whatever the clocks); other lines go to `bad`."""
    records = []
    for f in sorted(f for f in storage.list("metrics") if f.startswith(name) and f.endswith(".jsonl")):
        for line in storage.get(f"metrics/{f}").decode(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                if isinstance(record := json.loads(line), dict):
                    records.append(record)
                    continue
            if line.strip() and bad is not None:
                bad.append(f"{f}: {line[:60]!r}")
    return records
