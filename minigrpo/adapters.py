"""Versioned adapter publishing: how new weights reach the generators without NCCL.

Version v is the PEFT directory RUN/adapters/policy-<run id>-v<v:06d>/ (v0, with B = 0, is exactly the base
model). It is complete once its weights, written last, exist; then RUN/adapters/LATEST is replaced with its name.
A name always means one set of weights (vLLM keys its prefix cache by adapter name), so names carry the run id
and are never reused, not even after a crash. A directory is deleted one publish after it leaves the window of
max_staleness + 1 versions, since a server may still re-read an evicted adapter from its path. The digest (16 hex
digits of the sha256 of the weights file) lets the trainer check that a sampler used the version it claims.
"""
import contextlib
import re

from minigrpo.lora import adapter_digest, adapter_files


class AdapterStore:
    def __init__(self, storage, run_id: str):
        self.storage, self.run_id, self.digests = storage, run_id, {}
        self.pattern = re.compile(rf"^policy-{re.escape(run_id)}-v(\d{{6,}})$")

    def name(self, version: int) -> str:
        return f"policy-{self.run_id}-v{version:06d}"

    def url(self, version: int) -> str:
        """Where a sampler loads the version from: a local path or a storage URL."""
        return self.storage.url(f"adapters/{self.name(version)}")

    def versions(self) -> list[int]:
        """Versions listed under adapters/ (a listing may lag; next_version() does not rely on it alone)."""
        return sorted(int(m.group(1)) for m in map(self.pattern.match, self.storage.list("adapters")) if m)

    def latest(self) -> int | None:
        """The version named by LATEST, or None before the trainer's first publish."""
        with contextlib.suppress(FileNotFoundError):
            if m := self.pattern.match(self.storage.get("adapters/LATEST").decode().strip()):
                return int(m.group(1))

    def next_version(self, at_least: int = 0) -> int:
        """One past the highest version ever written, so that no name is reused after a restart."""
        v = max([at_least - 1, self.latest() or -1, *self.versions()]) + 1
        while self.storage.exists(f"adapters/{self.name(v)}/adapter_config.json"):  # a listing that lagged
            v += 1
        return v

    def write(self, version: int, state: dict, config: dict):
        """A version's files, the weights last. Nobody loads it until set_latest() names it."""
        files = adapter_files(state, config)
        for file, data in files.items():
            self.storage.put(f"adapters/{self.name(version)}/{file}", data)
        self.digests[version] = adapter_digest(files["adapter_model.safetensors"])

    def set_latest(self, version: int, keep: int):
        """Point LATEST at a written version, then delete versions that left the window one publish ago."""
        self.storage.put("adapters/LATEST", self.name(version) + "\n")
        for old in self.versions():
            if old < version - keep:  # named until version - keep + 1; one publish of grace after that
                self.storage.delete(f"adapters/{self.name(old)}", recursive=True)
                self.digests.pop(old, None)

    def digest(self, version: int) -> str:
        """The digest of a version's weights ("" if it is gone), computed once."""
        if version not in self.digests:
            with contextlib.suppress(FileNotFoundError):
                weights = self.storage.get(f"adapters/{self.name(version)}/adapter_model.safetensors")
                self.digests[version] = adapter_digest(weights)
        return self.digests.get(version, "")
