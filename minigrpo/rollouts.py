"""The rollout record and buffer: the only data that flows from generators to the trainer. A generator's batch of groups
(G completions of one prompt each, sampled with one adapter version) is one safetensors object, written once and never
moved: RUN/rollouts/<writer>-<seq>.safetensors (a bucket bills requests). Group j in it, <writer>-<seq>.<j>, is its
tensors "<j>.<name>" and metadata "<j>.<field>". Also: the Ledger, quarantine, garbage collection (README)."""
import collections
import errno
import hashlib
import json
import math
import re
import time
from dataclasses import dataclass

import torch
from safetensors.torch import load, save
from torch.nn.utils.rnn import pad_sequence

from minigrpo.run import fault

FORMAT = "minigrpo.groups.v1"
INTS = (torch.int64, torch.int32)
DTYPES = {"prompt_ids": INTS, "completion_ids": INTS, "completion_lens": INTS, "behavior_logprobs": (torch.float32,),
          "rewards": (torch.float32,), "truncated": (torch.bool,), "loss_mask": (torch.int8, torch.uint8, *INTS)}
FLAT, PADDED = ("prompt_ids", "rewards", "truncated"), ("completion_ids", "behavior_logprobs", "loss_mask")  # Group's
META = {"policy_version": int, "temperature": float, "adapter_digest": str, "group_id": str, "generator_id": str,
        "started_at": float, "finished_at": float, "grader": str, "run_id": str}  # the Group fields kept as string metadata


@dataclass
class Group:  # G completions of one prompt; lists hold one entry per completion, in sampling order
    prompt_ids: list[int]
    completion_ids: list[list[int]]  # the stop token included when one was sampled; no padding
    behavior_logprobs: list[list[float]]  # log mu(token), temperature applied, one per completion token
    rewards: list[float]  # the final scalar reward; correctness is the task's business
    truncated: list[bool]  # hit max_new_tokens without a stop token
    policy_version: int  # adapter version the whole group was sampled with, stamped when sampling started
    temperature: float
    adapter_digest: str = ""  # digest of the adapter's weights as the sampler reported it ("" if it cannot)
    group_id: str = ""  # set when written: the file name without .safetensors
    generator_id: str = ""
    started_at: float = 0.0
    finished_at: float = 0.0
    grader: str = ""  # the task's grader that scored the rewards (tasks.py)
    run_id: str = ""  # run.json's run_id, set when written: a group copied from another run is refused
    loss_mask: list[list[int]] | None = None  # per token: 1 sampled, 0 the task's reply (log-prob 0, not trained on)

    def __post_init__(self):
        self.loss_mask = self.loss_mask or [[1] * len(c) for c in self.completion_ids]


def to_tensors(groups: list[Group]) -> tuple[dict, dict]:  # completions right-padded to the longest, lengths alongside
    tensors, meta = {}, {"format": FORMAT, "groups": str(len(groups))}
    for j, g in enumerate(groups):
        tensors |= {f"{j}.{k}": torch.tensor(getattr(g, k), dtype=DTYPES[k][0]) for k in FLAT}
        tensors |= {f"{j}.{k}": pad_sequence([torch.tensor(r, dtype=DTYPES[k][0]) for r in getattr(g, k)], True) for k in PADDED}
        tensors[f"{j}.completion_lens"] = torch.tensor([len(c) for c in g.completion_ids], dtype=torch.long)
        meta |= {f"{j}.{k}": str(getattr(g, k)) for k in META}
    return tensors, meta


def read_groups(data: bytes, object_id: str) -> list[Group]:  # to_tensors inverted; a ValueError names any inconsistency
    tensors = load(data)  # safetensors: the header's length in 8 little-endian bytes, then the JSON header
    metadata = json.loads(data[8:8 + int.from_bytes(data[:8], "little")]).get("__metadata__") or {}
    if metadata.get("format") != FORMAT:
        raise ValueError(f"format is {metadata.get('format')!r}, expected {FORMAT!r}")
    return [read_group(tensors, metadata, f"{object_id}.{j}") for j in range(int(metadata.get("groups", 0)))]


def read_group(tensors: dict, metadata: dict, group_id: str) -> Group:  # group j's entries, named "<j>.<name>"
    j = group_id.rsplit(".", 1)[1]
    tensors, metadata = ({k[len(j) + 1:]: v for k, v in d.items() if k.startswith(f"{j}.")} for d in (tensors, metadata))
    if (named := metadata.pop("group_id", None)) != group_id:  # the same bytes under a second name: trained once
        raise ValueError(f"group_id: this group was written as {named!r}, found as {group_id!r} (a copy)")
    if missing := DTYPES.keys() - tensors.keys():
        raise ValueError(f"missing tensors {sorted(missing)}")
    for name, kinds in DTYPES.items():
        if tensors[name].dtype not in kinds:
            raise ValueError(f"{name} has dtype {tensors[name].dtype}, expected one of {[str(k) for k in kinds]}")
    ids, lens, logps, mask = (tensors[k] for k in ("completion_ids", "completion_lens", "behavior_logprobs", "loss_mask"))
    G = lens.numel()
    if ids.dim() != 2 or not ids.shape == logps.shape == mask.shape or ids.shape[0] != G or tensors["rewards"].shape != (G,) \
            or tensors["truncated"].shape != (G,) or tensors["prompt_ids"].dim() != 1:
        raise ValueError(f"inconsistent shapes: { {name: tuple(tensors[name].shape) for name in DTYPES} }")
    if G == 0 or lens.min() < 1 or lens.max() > ids.shape[1]:
        raise ValueError(f"completion lengths {lens.tolist()} do not fit {ids.shape[1]} columns")
    if not torch.isfinite(logps).all() or logps.max() > 1e-4:
        raise ValueError("behavior_logprobs must be finite and <= 0")
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError(f"loss_mask holds {sorted(set(mask.unique().tolist()) - {0, 1})[:3]}: only 0 and 1 are allowed")
    rows = {k: [row[:n] for row, n in zip(tensors[k].tolist(), lens.tolist())] for k in PADDED}
    return Group(**{k: tensors[k].tolist() for k in FLAT}, **rows, group_id=group_id,
                 **{k: read(metadata[k]) for k, read in META.items() if k in metadata})


def sequence_number(group_id: str) -> tuple[int, str]:  # sort key; -1 for a name without one (read first, like any other)
    return int(tail) if (tail := group_id.rsplit("-", 1)[-1]).isascii() and tail.isdigit() else -1, group_id


def group_key(group_id: str) -> str:
    return f"rollouts/{group_id}.safetensors"


class Ledger:
    """Consumed group ids, and object ids once all their groups are (only those go). A checkpoint saves `collect`, consumed
    before the previous one (deletable once this one is complete), and `consumed`, since; `taken`: this life's, since."""

    def __init__(self, state: dict | None = None):
        state = state or {}
        self.collect, self.consumed = set(state.get("collect") or []), set(state.get("consumed") or [])
        self.taken, self.skip = set(), self.collect | self.consumed

    def state(self) -> dict:  # what the next checkpoint records; after it is complete, call advance()
        return {"collect": sorted(self.consumed), "consumed": sorted(self.taken)}  # the sets as advance() leaves them

    def advance(self):
        self.collect, self.consumed, self.taken = self.consumed, self.taken, set()


class RolloutBuffer:
    def __init__(self, storage, run_id: str = ""):
        self.storage, self.run_id, self.ready = storage, run_id, []  # (object id, group): read, not yet taken, oldest first
        self.next, self.active, self.found = {}, {}, collections.Counter()  # a writer's next sequence number, last growth, finds
        self.full_at = 0.0  # when rollouts/ was last listed whole
        self.reasons = collections.Counter()  # quarantines by kind ("ValueError: rewards"), for the trainer's stop line

    def write(self, groups: list[Group], writer: str, seq: int) -> list[str]:
        """Add a batch of finished groups as one object, <writer>-<seq>, create-only: a name taken is a FileExistsError."""
        for j, group in enumerate(groups):
            group.group_id, group.generator_id, group.run_id = f"{writer}-{seq:06d}.{j}", writer, self.run_id
        self.storage.put(group_key(f"{writer}-{seq:06d}"), save(*to_tensors(groups)), create=True)
        return [g.group_id for g in groups]

    def listed(self) -> list[str]:  # object ids in rollouts/, consumed or not
        return [n.removesuffix(".safetensors") for n in self.storage.list("rollouts") if n.endswith(".safetensors")]

    def take(self, n: int, ledger: Ledger, validate=lambda group: None, stats=None) -> list[Group]:
        """Up to n of the oldest groups the ledger has not seen, recorded in it; one that fails is quarantined."""
        stats, now = {} if stats is None else stats, time.monotonic()
        if len(self.ready) < n:  # look if fewer than n wait. A bucket: by name (a listing grows with what is consumed), each
            # writer that grew within a minute, one more than its last look found, up to 8; all at first, then every 30 s (5 s if idle)
            quiet = now - max(self.active.values(), default=0.0) > 5
            if full := self.storage.local or not self.next or now - self.full_at > (5 if quiet else 30):
                self.full_at = now
            ids = sorted(self.listed() if full else [f"{w}-{s:06d}" for w, i in self.next.items() if now - self.active[w] < 60
                         for s in range(i, i + min(8, 1 + self.found[w]))], key=sequence_number)  # oldest first, all writers
            self.read([i for i in ids if i not in ledger.skip], ledger, stats)
            self.found = collections.Counter(i.rsplit("-", 1)[0] for i in ids if i in ledger.skip)  # read, now or before
            for w, seq in ((i.rsplit("-", 1)[0], sequence_number(i)[0] + 1) for i in ids if i in ledger.skip):
                if seq > self.next.get(w, 0):
                    self.next[w], self.active[w] = seq, now
        groups = []
        while len(groups) < n and self.ready:
            oid, group = self.ready.pop(0)  # recorded, and so is its object once this was the last of it (then it may go)
            ledger.taken |= {group.group_id} | ({oid} if all(o != oid for o, _ in self.ready) else set())
            try:
                validate(group)
            except Exception as e:  # noqa: BLE001 - nothing in a group may stop the trainer
                self.quarantine(group.group_id, group, f"{type(e).__name__}: {e}", stats)
                stats["attribution_mismatch"] = stats.get("attribution_mismatch", 0) + isinstance(e, AttributionError)
                continue
            groups.append(group)
        return groups

    def read(self, oids: list[str], ledger: Ledger, stats: dict):  # together; one unreadable is quarantined whole
        for oid, data in zip(oids, self.storage.get_many([group_key(i) for i in oids])):
            if isinstance(data, FileNotFoundError):  # not written yet (a look by name), a listing that lags a delete
                continue
            ledger.skip.add(oid)  # read once, whatever comes of it
            if isinstance(data, OSError) and not (self.storage.local and data.errno == errno.EACCES):
                raise data  # the store failed, not the object (a local file this user cannot read is the object's)
            try:
                if isinstance(data, Exception):  # not a regular file, or one this user cannot read
                    raise data
                groups = read_groups(data, oid)
            except Exception as e:  # noqa: BLE001 - nothing in a rollout object may stop the trainer
                self.quarantine(oid, data, f"{type(e).__name__}: {e}", stats)
                self.storage.delete(group_key(oid))
                continue
            self.ready += [(oid, g) for g in groups if g.group_id not in ledger.skip]  # skip: what a resumed trainer's took

    def progress(self, window_s: float) -> dict:  # backpressure: groups waiting, each writer's last object seen, writers
        return {"waiting": len(self.ready), "seen": {w: i - 1 for w, i in self.next.items()},
                "writers": sum(time.monotonic() - t < window_s for t in self.active.values())}

    def quarantine(self, group_id: str, data: "bytes | Exception | Group", reason: str, stats: dict):
        """Keep the evidence in bad/ (under a name any store takes); a group's object stays (the ledger holds it)."""
        data = save(*to_tensors([data])) if isinstance(data, Group) else data
        stats["bad_total"] = stats.get("bad_total", 0) + 1
        self.reasons[re.match(r"[\w ]*(: \w+)?", reason)[0]] += 1
        safe = group_id if re.fullmatch(r"[\w.-]{1,100}", group_id, re.ASCII) else re.sub(r"[^\w.-]", "_", group_id[:80], flags=re.ASCII) \
            + "-" + hashlib.sha256(group_id.encode(errors="surrogateescape")).hexdigest()[:12]
        self.storage.put(f"bad/{safe}.reason.txt", f"{group_id!r}: {reason}\n")
        if isinstance(data, bytes):
            self.storage.put(f"bad/{safe}.safetensors", data)
        print(f"[rollouts] quarantined {group_id!r}: {reason!r}", flush=True)

    def collect(self, ids, fenced=lambda write, *args: write(*args), fault_step: int | None = None):
        """Delete consumed objects (garbage collection; repeating it is harmless), each half behind the fence."""
        keys = [group_key(i) for i in sorted(ids) if not re.search(r"\.\d+$", i)]  # objects, not the groups in them
        fenced(self.storage.delete, keys[:len(keys) // 2])
        if keys and fault_step is not None:
            fault("mid_gc", fault_step)
        fenced(self.storage.delete, keys[len(keys) // 2:])


def check_group(group: Group, run: dict, vocab_size: int, version: int, digest_of=None, reward_range=(0.0, 1.0)):
    """The trainer's checks against run.json and the task's reward range; digest_of(v): version v's digest or ""."""
    if group.run_id != run["run_id"]:
        raise ValueError(f"run_id: written for run {group.run_id!r}, this run is {run['run_id']!r} (a copy)")
    if (G := len(group.completion_ids)) != run["group_size"]:
        raise ValueError(f"group_size: the group has {G} completions, the run's is {run['group_size']}")
    if not math.isclose(group.temperature, run["temperature"], rel_tol=0, abs_tol=1e-6):
        raise ValueError(f"temperature: sampled at {group.temperature}, the run uses {run['temperature']}")
    if run.get("grader") and group.grader != run["grader"]:  # rewards from another grader would mix in
        raise ValueError(f"grader: scored by {group.grader or 'an unnamed grader'!r}, the run's is {run['grader']!r}")
    if outside := [r for r in group.rewards if not reward_range[0] <= r <= reward_range[1]]:
        raise ValueError(f"rewards: {outside[:3]} outside the task's range {list(reward_range)}")
    if group.policy_version > version:
        raise ValueError(f"policy_version {group.policy_version} is from the future (trainer at {version})")
    if not 1 <= len(group.prompt_ids) <= run["max_prompt_len"]:
        raise ValueError(f"prompt_ids: {len(group.prompt_ids)} tokens, the run allows 1 to {run['max_prompt_len']}")
    if (longest := max(map(len, group.completion_ids))) > run["max_new_tokens"]:
        raise ValueError(f"completion_ids: {longest} tokens, the run's max_new_tokens is {run['max_new_tokens']}")
    ids = group.prompt_ids + [t for c in group.completion_ids for t in c]
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}): found {min(ids)}..{max(ids)}")
    expected = digest_of(group.policy_version) if group.adapter_digest and digest_of else ""
    if expected and group.adapter_digest != expected:
        raise AttributionError(f"adapter_digest: sampled with weights {group.adapter_digest}, but version "
                               f"{group.policy_version} is {expected} (a replica served other weights)")


class AttributionError(ValueError):  # a group whose adapter digest is not the one of the version it names
    pass
