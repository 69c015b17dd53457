"""Trainer checkpoints: RUN/checkpoints/step-NNNNNN/ holds the adapter, optimizer.pt (AdamW and RNG state),
trainer_state.json (step, version, counters, the ledger, the configuration) and, written last, MANIFEST: each
file's sha256. A checkpoint without its MANIFEST does not exist; resume skips a damaged one and names it.
"""
import hashlib
import io
import json
import re

import torch
from safetensors.torch import load

from minigrpo.lora import adapter_files, load_lora_state_dict

NAME = re.compile(r"^step-(\d{6,})$")


def save_checkpoint(storage, step: int, model_state: dict, adapter_config: dict, optimizer, state: dict):
    key = f"checkpoints/step-{step:06d}"
    storage.delete(key, recursive=True)  # what an earlier life left without a MANIFEST
    blob = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()}, blob)
    files = adapter_files(model_state, adapter_config)
    files |= {"optimizer.pt": blob.getvalue(), "trainer_state.json": json.dumps(state | {"step": step}).encode()}
    storage.put_many({f"{key}/{name}": data for name, data in files.items()})
    storage.put(f"{key}/MANIFEST", json.dumps({n: hashlib.sha256(d).hexdigest() for n, d in files.items()}, indent=1))


def prune_checkpoints(storage):
    """Keep the newest two complete checkpoints (and anything newer, e.g. one being written)."""
    steps = [s for s in storage.list("checkpoints") if NAME.match(s)]
    complete = [s for s in steps if storage.exists(f"checkpoints/{s}/MANIFEST")]
    oldest_kept = complete[-2:][0] if complete else ""  # names are zero-padded: they sort by step
    storage.delete([f"checkpoints/{s}" for s in steps if s < oldest_kept], recursive=True)


def load_checkpoint(storage, model, optimizer) -> tuple[dict | None, list[str]]:
    """Restore the newest intact checkpoint into place: (trainer state or None, what was skipped and why)."""
    skipped = []
    for s in sorted((s for s in storage.list("checkpoints") if NAME.match(s)), reverse=True):
        if not storage.exists(f"checkpoints/{s}/MANIFEST"):
            skipped.append(f"{s}: incomplete (no MANIFEST)")
            continue
        try:
            manifest = json.loads(storage.get(f"checkpoints/{s}/MANIFEST"))
            files = {name: storage.get(f"checkpoints/{s}/{name}") for name in manifest}
            if bad := [name for name, data in files.items() if hashlib.sha256(data).hexdigest() != manifest[name]]:
                raise ValueError(f"{', '.join(bad)} do not match the MANIFEST")
            blob = torch.load(io.BytesIO(files["optimizer.pt"]), weights_only=True)
            state = json.loads(files["trainer_state.json"])
            load_lora_state_dict(model, load(files["adapter_model.safetensors"]))
            optimizer.load_state_dict(blob["optimizer"])
            torch.set_rng_state(blob["rng"])
            return state, skipped
        except (ValueError, KeyError, RuntimeError, FileNotFoundError) as e:
            skipped.append(f"{s}: damaged ({type(e).__name__}: {e})")
    return None, skipped
