"""The run directory: the settings every process must agree on (run.json), atomic writes, DONE, and metrics.

Every file that crosses between processes is written under a temporary name in the same directory and then
renamed, so a reader sees either nothing or the whole file, on a local disk, NFS or a mounted bucket.
"""
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from minigrpo.lora import DEFAULT_TARGETS


@dataclass
class RunSettings:
    """Settings the trainer and every generator must share. Written once to RUN/run.json, checked by each joiner."""
    model: str = field(default="demo", metadata={"help": "base model: 'demo' (built in), a local folder or a hub id"})
    task: str = field(default="reverse_add", metadata={"help": "prompt set and reward: reverse_add | math (minigrpo/tasks.py)"})
    task_data: str = field(default="", metadata={"help": "math: a .jsonl/.parquet file or hf://datasets/OWNER/NAME/FILE"})
    task_fields: str = field(default="problem,answer", metadata={"help": "math: the problem and answer field names"})
    system_prompt: str = field(default="", metadata={"help": "system message for models with a chat template"})
    reasoning: bool = field(default=False, metadata={"help": "math: grade only after </think> (R1-style models)"})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank r"})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA alpha; the update is scaled by alpha / r"})
    lora_targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS),
                                    metadata={"help": "names of the linear layers that get a LoRA"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature; the trainer's log-probs use it too"})
    group_size: int = field(default=8, metadata={"help": "G: completions per prompt, normalised together"})
    max_new_tokens: int = field(default=8, metadata={"help": "completion length limit (also Dr. GRPO's constant)"})


# Recipes as flags. Each script applies the flags its own config has; flags given on the command line win.
PRESETS = {
    # the blog's run: Qwen2.5-Math-1.5B, rank-1 LoRA on every projection, Dr. GRPO with truncated IS at 2
    # (shared/spec/grpo.md 4.2), 8 completions a prompt, 128 a step, an adapter every 4 steps
    "qwen-math-1.5b": dict(model="Qwen/Qwen2.5-Math-1.5B", task="math", lora_r=1, lora_alpha=2, group_size=8,
                           max_new_tokens=3000, temperature=1.0, lr=4e-5, groups_per_step=16, max_staleness=4,
                           sync_every=4, loss_type="dr_grpo", old_logp="recompute", tis_cap=2.0, dtype="bfloat16",
                           micro_batch_tokens=16384, eval_every=50, eval_size=500, max_steps=500),
}
# the same recipe for a reasoning model: grade after </think>, longer completions
PRESETS["r1-distill-1.5b"] = PRESETS["qwen-math-1.5b"] | dict(model="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
                                                              reasoning=True, max_new_tokens=8192)


def parse_config(*types, argv=None):
    """HfArgumentParser over the dataclasses, after expanding --preset NAME into the flags these dataclasses know."""
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = []
    if "--preset" in argv:
        i = argv.index("--preset")
        name = argv[i + 1] if i + 1 < len(argv) else ""
        if name not in PRESETS:
            raise SystemExit(f"--preset must be one of {sorted(PRESETS)}, got {name!r}")
        del argv[i:i + 2]
        known = {f.name for t in types for f in dataclasses.fields(t)}
        flags = [x for k, v in PRESETS[name].items() if k in known for x in (f"--{k}", str(v))]
    parser = HfArgumentParser(types, epilog=f"--preset NAME applies a recipe first: {', '.join(sorted(PRESETS))}")
    return parser.parse_args_into_dataclasses(flags + argv)


def write_atomic(path: str, text: str):
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_dir(path: str):
    """Yield a temporary sibling directory to fill; on success it is renamed to `path` in one step."""
    parent, name = os.path.split(path)
    tmp = os.path.join(parent, f".{name}.{uuid.uuid4().hex[:8]}.tmp")
    os.makedirs(tmp)
    try:
        yield tmp
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_temps(directory: str):
    """Remove temporary files and directories that a killed process left behind."""
    for name in os.listdir(directory):
        if name.startswith(".") and name.endswith(".tmp"):
            path = os.path.join(directory, name)
            with contextlib.suppress(FileNotFoundError):  # another process (a second rank) got there first
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def join_run(run_dir: str, settings: RunSettings) -> dict:
    """Create run.json if this process is first, else check it matches; returns its contents."""
    try:
        os.makedirs(os.path.join(run_dir, "metrics"), exist_ok=True)
        probe = os.path.join(run_dir, f".write-probe-{uuid.uuid4().hex[:8]}")  # one per process: several join at once
        write_atomic(probe, "")
        os.remove(probe)
    except OSError as e:
        raise SystemExit(f"the run directory {run_dir} is not writable: {e}") from e
    path = os.path.join(run_dir, "run.json")
    mine = dataclasses.asdict(settings)
    if not os.path.exists(path):
        tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "w") as f:
            json.dump(mine | {"run_id": uuid.uuid4().hex[:12], "created": time.time()}, f, indent=2)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)  # create-if-absent in one step: of two processes starting at once, one wins
        os.remove(tmp)
    with open(path) as f:
        theirs = json.load(f)
    diff = [f"{k}: run.json has {theirs.get(k)!r}, this process has {v!r}" for k, v in mine.items() if theirs.get(k) != v]
    if diff:
        raise SystemExit(f"{path} was written with other settings; start this process with the same ones "
                         f"(or use another --run_dir):\n  " + "\n  ".join(diff))
    return theirs


def done_path(run_dir: str) -> str:
    return os.path.join(run_dir, "DONE")


class Metrics:
    """Appends one JSON record per step to RUN/metrics/<name>.jsonl and prints the console line for it."""

    def __init__(self, run_dir: str, name: str):
        self.path = os.path.join(run_dir, "metrics", f"{name}.jsonl")

    def log(self, record: dict, line: str):
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(line, flush=True)
