"""Trainer checkpoints: RUN/checkpoints/step-NNNNNN-eEEEEEE/ (the step, the writing life's epoch) holds the adapter, optimizer.pt
(AdamW and RNG state), trainer_state.json (step, version, counters, the ledger, the configuration) and, written last, MANIFEST:
each file's sha256. It counts once the lease names it (train.py's conditional write); resume skips and names a damaged one."""
import hashlib
import io
import json
import re

import torch
from safetensors.torch import load

from minigrpo.lora import adapter_files, load_lora_state_dict
from minigrpo.rollouts import Ledger

NAME = re.compile(r"^step-(\d{6,})(-e\d{6,})?$")
STATE = {"step": int, "version": int, "stats": dict, "config": dict, "ledger": dict}  # what a resume reads


def save_checkpoint(storage, step: int, epoch: int, model_state: dict, adapter_config: dict, optimizer, state: dict) -> str:
    """Write checkpoint files, MANIFEST last; returns the checkpoint's name. The name is this life's alone."""
    name, blob = f"step-{step:06d}-e{epoch:06d}", io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()}, blob)
    files = adapter_files(model_state, adapter_config)
    files |= {"optimizer.pt": blob.getvalue(), "trainer_state.json": json.dumps(state | {"step": step}).encode()}
    storage.put_many({f"checkpoints/{name}/{file}": data for file, data in files.items()})
    storage.put(f"checkpoints/{name}/MANIFEST", json.dumps({n: hashlib.sha256(d).hexdigest() for n, d in files.items()}, indent=1))
    return name


def prune_checkpoints(storage, keep: list[str]):  # delete all older than the lease's, those of killed or deposed lives too
    oldest = min(int(NAME.match(s)[1]) for s in keep)
    storage.delete([f"checkpoints/{s}" for s in storage.list("checkpoints") if (m := NAME.match(s)) and int(m[1]) < oldest], recursive=True)


def load_checkpoint(storage, model, optimizer, names: list[str] | None = None) -> tuple[dict | None, list[str]]:
    """Load the newest intact checkpoint of `names` (None: all): (trainer state or None, what was skipped and why)."""
    skipped = []
    for s in sorted(filter(NAME.match, storage.list("checkpoints") if names is None else names), reverse=True):
        if not storage.exists(f"checkpoints/{s}/MANIFEST"):  # written last: without it the checkpoint was cut short
            skipped.append(f"{s}: incomplete (no MANIFEST)")
            continue
        try:
            manifest = json.loads(storage.get(f"checkpoints/{s}/MANIFEST"))
            files = {name: storage.get(f"checkpoints/{s}/{name}") for name in manifest}
            if bad := [name for name, data in files.items() if hashlib.sha256(data).hexdigest() != manifest[name]]:
                raise ValueError(f"{', '.join(bad)} do not match the MANIFEST")
            state = json.loads(files["trainer_state.json"])
            if not isinstance(state, dict) or (wrong := [k for k, t in STATE.items() if type(state.get(k)) is not t]):
                raise ValueError(f"trainer_state.json: {wrong if isinstance(state, dict) else 'not an object'} missing or of another type")
            Ledger(state["ledger"])
            blob = torch.load(io.BytesIO(files["optimizer.pt"]), map_location="cpu", weights_only=True)
            load_lora_state_dict(model, load(files["adapter_model.safetensors"]))
            optimizer.load_state_dict(blob["optimizer"])  # moves the state to the parameters' device
            torch.set_rng_state(blob["rng"])
            return state | {"name": s}, skipped
        except (ValueError, KeyError, TypeError, RuntimeError, FileNotFoundError) as e:
            skipped.append(f"{s}: damaged ({type(e).__name__}: {e})")
    return None, skipped
