"""Versioned adapter publishing, how new weights reach the generators without NCCL: version v is the PEFT directory
RUN/adapters/policy-<run id>-v<v:06d>/ (v0, B = 0, is the base model exactly), named by RUN/adapters/LATEST once its weights,
written last, exist. A name means one set of weights (vLLM keys its prefix cache by it): names carry the run id, and
adapter_config.json claims a name create-only and outlives the weights, so no restart or deposed trainer writes a name twice."""
import contextlib
import re

from safetensors.torch import load

from minigrpo.lora import adapter_digest, adapter_files


class AdapterStore:
    def __init__(self, storage, run_id: str):
        self.storage, self.run_id, self.kept, self.token, self.kept_from = storage, run_id, {}, None, None
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
        """One past the highest version named or listed (write() skips any name a lagging listing hid)."""
        return max([at_least - 1, self.latest() or -1, *self.versions()]) + 1

    def write(self, version: int, state: dict, config: dict) -> int:
        """A version's files under the first unclaimed name from `version` on, weights last; returns that version."""
        files = adapter_files(state, config)
        while True:
            with contextlib.suppress(FileExistsError):
                self.storage.put(f"adapters/{self.name(version)}/adapter_config.json", files["adapter_config.json"], create=True)
                break
            version += 1
        self.storage.put(f"adapters/{self.name(version)}/adapter_model.safetensors", files["adapter_model.safetensors"])
        self.kept[version] = load(files["adapter_model.safetensors"]), adapter_digest(files["adapter_model.safetensors"])
        return version

    def set_latest(self, version: int, keep: int):
        """Point LATEST at a version if it still holds this store's last write (after a refusal and the fence: what it holds
        now), then delete weights that left the window a publish ago (a server may re-read an evicted one; a bucket: 4 a time)."""
        token, self.token = self.token or self.storage.versioned("adapters/LATEST", read=False)[1], None  # None until it lands
        self.token = self.storage.swap("adapters/LATEST", self.name(version) + "\n", token)
        old = range(max(0, version - keep - 1) if self.kept_from is None else self.kept_from, version - keep)
        if gone := len(old) >= (1 if self.storage.local else 4):
            self.storage.delete([f"adapters/{self.name(v)}/adapter_model.safetensors" for v in old])
        self.kept_from, self.kept = old.stop if gone else old.start, {v: w for v, w in self.kept.items() if v >= version - keep}

    def weights(self, version: int) -> tuple[dict | None, str]:
        """(a version's LoRA tensors, their digest), or (None, "") once they are gone; read once, kept in the window."""
        if version not in self.kept:
            with contextlib.suppress(FileNotFoundError):
                data = self.storage.get(f"adapters/{self.name(version)}/adapter_model.safetensors")
                self.kept[version] = load(data), adapter_digest(data)
        return self.kept.get(version, (None, ""))

    def digest(self, version: int) -> str:  # "" if the weights are gone
        return self.weights(version)[1]
