"""Versioned adapter publishing and discovery: how new weights reach the generators without NCCL.

    RUN/adapters/policy-v000000/   version 0, the untrained adapter (B = 0): exactly the base model
    RUN/adapters/policy-v000001/   ... each a PEFT directory, written once under a temp name and renamed
    RUN/adapters/LATEST            the name of the newest complete version, replaced after the directory exists

A name always means one set of weights (vLLM keys its prefix cache by adapter name), so names are never reused,
not even after a crash: a restarted trainer publishes one past the highest version on disk. The trainer keeps
the newest max_staleness + 1 versions and deletes a directory one publish after it leaves that window, since a
server may still re-read an evicted adapter from its path.
"""
import os
import re
import shutil

from minigrpo.lora import save_adapter
from minigrpo.run import atomic_dir, remove_stale_temps, write_atomic

NAME = re.compile(r"^policy-v(\d{6})$")


def adapter_name(version: int) -> str:
    return f"policy-v{version:06d}"


class AdapterStore:
    def __init__(self, run_dir: str):
        self.root = os.path.abspath(os.path.join(run_dir, "adapters"))  # absolute: servers resolve it as given
        os.makedirs(self.root, exist_ok=True)

    def path(self, version: int) -> str:
        return os.path.join(self.root, adapter_name(version))

    def versions(self) -> list[int]:
        """Complete versions on disk (temp directories of an interrupted publish do not count)."""
        return sorted(int(m.group(1)) for m in map(NAME.match, os.listdir(self.root)) if m)

    def latest(self) -> tuple[int, str] | None:
        """(version, absolute path) named by LATEST, or None before the trainer's first publish."""
        try:
            with open(os.path.join(self.root, "LATEST")) as f:
                m = NAME.match(f.read().strip())
        except FileNotFoundError:
            return None
        return (int(m.group(1)), self.path(int(m.group(1)))) if m else None

    def next_version(self) -> int:
        """One past the highest version ever written, so no name is reused after a restart."""
        remove_stale_temps(self.root)
        return max(self.versions(), default=-1) + 1

    def publish(self, version: int, state: dict, config: dict, keep: int) -> str:
        """Write the adapter directory, then point LATEST at it, then prune versions that left the window."""
        path = self.path(version)
        with atomic_dir(path) as tmp:
            save_adapter(tmp, state, config)
        write_atomic(os.path.join(self.root, "LATEST"), adapter_name(version) + "\n")
        for old in self.versions():
            if old < version - keep:  # named until version - keep + 1; one publish of grace after that
                shutil.rmtree(self.path(old), ignore_errors=True)
        return path
