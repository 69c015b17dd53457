"""Trainer checkpoints, for resuming after preemption: RUN/checkpoints/step-NNNNNN/ holds

    adapter/             the LoRA weights (PEFT format, like a published adapter)
    optimizer.pt         AdamW state and the torch RNG state
    trainer_state.json   step, counters and the resolved configuration

Each checkpoint directory appears whole (temp name, then rename). Groups used by the covered steps are deleted
only after it exists, and groups claimed later go back to ready/ on resume: each group is trained once.
"""
import json
import os
import re
import shutil

import torch

from minigrpo.lora import load_adapter, save_adapter
from minigrpo.run import atomic_dir, remove_stale_temps

NAME = re.compile(r"^step-(\d{6})$")


def checkpoint_dir(run_dir: str) -> str:
    path = os.path.join(run_dir, "checkpoints")
    os.makedirs(path, exist_ok=True)
    return path


def save_checkpoint(run_dir: str, step: int, model_state: dict, adapter_config: dict, optimizer, state: dict,
                    keep: int = 2) -> str:
    root = checkpoint_dir(run_dir)
    path = os.path.join(root, f"step-{step:06d}")
    with atomic_dir(path) as tmp:
        save_adapter(os.path.join(tmp, "adapter"), model_state, adapter_config)
        torch.save({"optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()}, os.path.join(tmp, "optimizer.pt"))
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(state | {"step": step}, f, indent=2)
    for old in sorted(s for s in os.listdir(root) if NAME.match(s))[:-keep]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return path


def latest_checkpoint(run_dir: str) -> str | None:
    root = checkpoint_dir(run_dir)
    remove_stale_temps(root)
    steps = sorted(s for s in os.listdir(root) if NAME.match(s))
    return os.path.join(root, steps[-1]) if steps else None


def load_checkpoint(path: str, model, optimizer) -> dict:
    """Restore the LoRA weights, optimizer and RNG into place; returns the trainer state."""
    load_adapter(model, os.path.join(path, "adapter"))
    blob = torch.load(os.path.join(path, "optimizer.pt"), weights_only=True)
    optimizer.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["rng"])
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)
