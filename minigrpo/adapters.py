"""Versioned adapter publishing: how new weights reach the generators without NCCL.

Version v is the PEFT directory RUN/adapters/policy-<run id>-v<v:06d>/ (v0, with B = 0, is exactly the base model),
named by RUN/adapters/LATEST once its weights, written last, exist. A name always means one set of weights (vLLM
keys its prefix cache by adapter name), so names carry the run id and are never reused, not even after a crash.
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
        return self.storage.url(f"adapters/{self.name(version)}")

    def versions(self) -> list[int]:
        return sorted(int(m.group(1)) for m in map(self.pattern.match, self.storage.list("adapters")) if m)

    def latest(self) -> int | None:
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
            if old < version - keep:  # grace of one publish: a server may re-read an evicted adapter from its path
                self.storage.delete(f"adapters/{self.name(old)}", recursive=True)
                self.digests.pop(old, None)

    def digest(self, version: int) -> str:
        """The digest of a version's weights ("" if it is gone), computed once."""
        if version not in self.digests:
            with contextlib.suppress(FileNotFoundError):
                weights = self.storage.get(f"adapters/{self.name(version)}/adapter_model.safetensors")
                self.digests[version] = adapter_digest(weights)
        return self.digests.get(version, "")
