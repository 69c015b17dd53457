"""The rollout record and the file-based rollout buffer: the only data that flows from generators to the trainer.

One group (G completions of one prompt, all sampled with one adapter version) is one safetensors file:
tensors for the ids and log-probs, string metadata for the rest. Its life in RUN/rollouts/:

    ready/     written by a generator (temp name, then os.replace: a reader never sees half a file)
    claimed/   moved here by the trainer when it takes the group (os.rename: two trainers cannot take one file)
    (deleted)  once a checkpoint covers the step that used it; on resume, claimed/ goes back to ready/
    bad/       a file that could not be read or failed validation, with <name>.reason.txt beside it

File names start with the write time in nanoseconds, so sorting them is FIFO.
"""
import math
import os
import time
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from safetensors import safe_open

FORMAT = "minigrpo.group.v1"


@dataclass
class Group:
    """G completions of one prompt. Lists hold one entry per completion, in sampling order."""
    prompt_ids: list[int]
    completion_ids: list[list[int]]  # the stop token included when one was sampled; no padding
    behavior_logprobs: list[list[float]]  # log mu(token), temperature applied, one per completion token
    rewards: list[float]  # the final scalar reward; correctness is the task's business
    truncated: list[bool]  # hit max_new_tokens without a stop token
    policy_version: int  # adapter version the whole group was sampled with, stamped when sampling started
    temperature: float
    group_id: str = ""  # set when written: the file name without .safetensors
    generator_id: str = ""
    started_at: float = 0.0
    finished_at: float = 0.0

    def __len__(self):
        return len(self.completion_ids)


def to_tensors(group: Group) -> tuple[dict, dict]:
    """(tensors, metadata): completions right-padded to the longest, with their lengths alongside."""
    G, T = len(group), max(len(c) for c in group.completion_ids)
    ids, logps = torch.zeros(G, T, dtype=torch.long), torch.zeros(G, T)
    for i, (c, lp) in enumerate(zip(group.completion_ids, group.behavior_logprobs)):
        ids[i, :len(c)], logps[i, :len(lp)] = torch.tensor(c, dtype=torch.long), torch.tensor(lp)
    tensors = {"prompt_ids": torch.tensor(group.prompt_ids, dtype=torch.long), "completion_ids": ids,
               "completion_lens": torch.tensor([len(c) for c in group.completion_ids], dtype=torch.long),
               "behavior_logprobs": logps, "rewards": torch.tensor(group.rewards, dtype=torch.float32),
               "truncated": torch.tensor(group.truncated, dtype=torch.bool)}
    metadata = {"format": FORMAT, "policy_version": str(group.policy_version), "temperature": repr(group.temperature),
                "generator_id": group.generator_id, "started_at": repr(group.started_at),
                "finished_at": repr(group.finished_at)}
    return tensors, metadata


def from_tensors(tensors: dict, metadata: dict, group_id: str) -> Group:
    """Inverse of to_tensors, validating as it goes: any inconsistency is a ValueError that says what is wrong."""
    if metadata.get("format") != FORMAT:
        raise ValueError(f"format is {metadata.get('format')!r}, expected {FORMAT!r}")
    missing = {"prompt_ids", "completion_ids", "completion_lens", "behavior_logprobs", "rewards", "truncated"} - tensors.keys()
    if missing:
        raise ValueError(f"missing tensors {sorted(missing)}")
    ids, lens, logps = tensors["completion_ids"], tensors["completion_lens"], tensors["behavior_logprobs"]
    G = lens.numel()
    if ids.dim() != 2 or ids.shape != logps.shape or ids.shape[0] != G or tensors["rewards"].shape != (G,) \
            or tensors["truncated"].shape != (G,) or tensors["prompt_ids"].dim() != 1:
        raise ValueError(f"inconsistent shapes: completion_ids {tuple(ids.shape)}, behavior_logprobs "
                         f"{tuple(logps.shape)}, completion_lens {tuple(lens.shape)}, rewards {tuple(tensors['rewards'].shape)}")
    if G == 0 or lens.min() < 1 or lens.max() > ids.shape[1]:
        raise ValueError(f"completion lengths {lens.tolist()} do not fit {ids.shape[1]} columns")
    if not torch.isfinite(logps).all() or logps.max() > 1e-4 or not torch.isfinite(tensors["rewards"]).all():
        raise ValueError("behavior_logprobs must be finite and <= 0, rewards finite")
    lens = lens.tolist()
    return Group(prompt_ids=tensors["prompt_ids"].tolist(),
                 completion_ids=[row[:k] for row, k in zip(ids.tolist(), lens)],
                 behavior_logprobs=[row[:k] for row, k in zip(logps.tolist(), lens)],
                 rewards=tensors["rewards"].tolist(), truncated=tensors["truncated"].tolist(),
                 policy_version=int(metadata["policy_version"]), temperature=float(metadata["temperature"]),
                 group_id=group_id, generator_id=metadata.get("generator_id", ""),
                 started_at=float(metadata.get("started_at", 0)), finished_at=float(metadata.get("finished_at", 0)))


def read_group(path: str) -> Group:
    with safe_open(path, "pt") as f:
        metadata = f.metadata() or {}
    return from_tensors(load_file(path), metadata, os.path.basename(path).removesuffix(".safetensors"))


def is_fresh(trainer_version: int, policy_version: int, max_staleness: int) -> bool:
    """Keep a group unless it is more than max_staleness versions behind (strict >, as TRL drops)."""
    return trainer_version - policy_version <= max_staleness


class RolloutBuffer:
    def __init__(self, run_dir: str):
        self.root = os.path.join(run_dir, "rollouts")
        self.ready, self.claimed, self.bad = (os.path.join(self.root, d) for d in ("ready", "claimed", "bad"))
        for d in (self.ready, self.claimed, self.bad):
            os.makedirs(d, exist_ok=True)

    # ---- generator side ----
    def write(self, group: Group, generator_id: str, seq: int) -> str:
        """Atomically add one finished group to ready/; returns its group id."""
        group_id = f"{time.time_ns():020d}-{generator_id}-{seq:06d}"
        group.group_id, group.generator_id = group_id, generator_id
        tensors, metadata = to_tensors(group)
        final = os.path.join(self.ready, group_id + ".safetensors")
        tmp = os.path.join(self.ready, f".{group_id}.tmp")
        try:
            save_file(tensors, tmp, metadata=metadata)
            os.replace(tmp, final)
        except OSError as e:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise OSError(e.errno, f"cannot write a rollout group into {self.ready}: {e.strerror or e}") from e
        return group_id

    def sweep_temps(self, max_age_s: float):
        """Delete temp files older than max_age_s: left by generators killed mid-write (younger ones may be live)."""
        now = time.time()
        for name in os.listdir(self.ready):
            path = os.path.join(self.ready, name)
            if name.startswith(".") and name.endswith(".tmp") and now - os.path.getmtime(path) > max_age_s:
                os.remove(path)

    def count_ready(self) -> int:
        return sum(1 for n in os.listdir(self.ready) if n.endswith(".safetensors"))

    # ---- trainer side ----
    def take(self, n: int, validate=None) -> list[Group]:
        """Claim up to n of the oldest ready groups (FIFO). Unreadable or invalid ones go to bad/ instead."""
        groups = []
        for name in sorted(f for f in os.listdir(self.ready) if f.endswith(".safetensors")):
            if len(groups) == n:
                break
            path = os.path.join(self.claimed, name)
            try:
                os.rename(os.path.join(self.ready, name), path)
            except FileNotFoundError:  # another trainer took it first
                continue
            try:
                group = read_group(path)
                if validate:
                    validate(group)
            except (OSError, ValueError, KeyError, SafetensorError) as e:
                self.quarantine(path, f"{type(e).__name__}: {e}")
                continue
            groups.append(group)
        return groups

    def quarantine(self, path: str, reason: str):
        name = os.path.basename(path)
        os.replace(path, os.path.join(self.bad, name))
        with open(os.path.join(self.bad, name + ".reason.txt"), "w") as f:
            f.write(reason + "\n")
        print(f"[rollouts] quarantined {name}: {reason}", flush=True)

    def count_bad(self) -> int:
        return sum(1 for n in os.listdir(self.bad) if n.endswith(".reason.txt"))

    def delete_claimed(self):
        """Called after a checkpoint: every claimed group was used by a step that the checkpoint now covers."""
        for name in os.listdir(self.claimed):
            os.remove(os.path.join(self.claimed, name))

    def restore_claimed(self) -> int:
        """Called on resume: groups taken after the last checkpoint were never covered, so they are ready again."""
        names = os.listdir(self.claimed)
        for name in names:
            os.replace(os.path.join(self.claimed, name), os.path.join(self.ready, name))
        return len(names)


def validator(vocab_size: int, temperature: float, G: int, version_now):
    """What the trainer checks on every group it takes; version_now() is the trainer's current version."""
    def check(group: Group):
        if len(group) != G:
            raise ValueError(f"group has {len(group)} completions, the run's group_size is {G}")
        if not math.isclose(group.temperature, temperature, rel_tol=0, abs_tol=1e-6):
            raise ValueError(f"sampled at temperature {group.temperature}, the run uses {temperature}")
        if group.policy_version > version_now():
            raise ValueError(f"policy_version {group.policy_version} is from the future (trainer at {version_now()})")
        ids = group.prompt_ids + [t for c in group.completion_ids for t in c]
        if not group.prompt_ids or min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"token ids must lie in [0, {vocab_size}) and the prompt must not be empty")
    return check
