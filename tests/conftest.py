"""Shared fixtures: tiny randomly initialised causal LMs built locally (nothing is downloaded)."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from minigrpo.model import PACKED_SDPA, HeadLogprobs, output_head

torch.set_num_threads(1)

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def tiny_model(arch: str = "qwen2", seed: int = 0, vocab: int = 32):
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(seed)
    config = config_cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        eos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
                        attn_implementation=PACKED_SDPA)  # as load_model sets it
    return model_cls(config).eval()


def sequence_logprobs(model, input_ids, attention_mask, temperature: float):
    """Unpacked model.packed_logprobs, for tests and benches: log pi(x_t | x_<t), t >= 1, in float32 from
    logits / temperature, with gradient, and the entropy without: (B, L-1) each, position t-1 predicting token t.
    input_ids (B, L) are right-padded with attention_mask."""
    head = output_head(model)
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                              use_cache=False).last_hidden_state[:, :-1]  # (B, L-1, H)
    logp, entropy = HeadLogprobs.apply(hidden.flatten(0, 1), head.weight, input_ids[:, 1:].flatten(), temperature)
    return logp.view(hidden.shape[:2]), entropy.view(hidden.shape[:2])


@pytest.fixture(params=list(ARCHS))
def arch(request):
    return request.param


VLLM_FILES = {"test_real_model", "test_vllm", "test_vllm_parity"}  # these need real vLLM (tests/vllm_replicas.py)


def pytest_collection_modifyitems(items):  # the files that need real vLLM first (stable: each file keeps its order)
    items.sort(key=lambda item: item.path.stem not in VLLM_FILES)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's: `-n 2`, as .ci/run runs the suite on CI's two cores
def pytest_xdist_make_scheduler(config, log):
    """A file's tests on one worker (its module fixtures start once), and the files that need real vLLM on one (their
    replicas start once), in collection order: those go first, as they wait for .ci/run's vLLM environment, still
    building, while the other worker starts on the rest. (--dist loadgroup would do it, but pytest-xdist 3.8 names
    a group in a way pytest 9.2 ignores.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Files(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]  # tests/test_vllm.py
            return "vllm" if file.rsplit("/", 1)[-1].removesuffix(".py") in VLLM_FILES else file

    config.option.loadscopereorder = False  # xdist would put the files with the most tests first
    return Files(config, log)


# ---- real processes on loopback: servers, proxies ----
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(method, url, body=None, key=None, content_type="application/json", raw=None):
    """(status, text, parsed JSON or None) of one HTTP request, whatever the status."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", content_type)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, text, headers = r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        status, text, headers = e.code, e.read().decode(), e.headers
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    call.headers = headers
    return status, text, parsed


def start(args, port, wait=True):
    """Start `python args...` from the repo root and wait until http://127.0.0.1:port/health answers."""
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.time() + 120
    while wait:
        assert proc.poll() is None, f"{args} exited with {proc.returncode}"
        try:
            if call("GET", f"http://127.0.0.1:{port}/health")[0] == 200:
                break
        except OSError:
            pass
        assert time.time() < deadline, f"{args} did not become healthy"
        time.sleep(0.2)
    return proc


def save_random_adapter(path, r=2, alpha=4.0, seed=0, targets=None, use_rslora=False):
    """A PEFT adapter for the demo model with non-zero B, so it visibly changes the output."""
    from minigrpo.lora import DEFAULT_TARGETS, adapter_config, adapter_files, inject_lora, lora_layers, lora_state_dict
    from minigrpo.model import load_model
    from minigrpo.storage import Storage
    model, _ = load_model("demo", torch.device("cpu"))
    inject_lora(model, r, alpha, targets or DEFAULT_TARGETS, use_rslora)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * 0.3)
    Storage(str(path)).put_many(adapter_files(lora_state_dict(model), adapter_config(r, alpha, targets or DEFAULT_TARGETS, "demo", use_rslora)))
    return model


def generate_here(*flags: str):
    """`python generate.py FLAGS` run in this process instead, for a test that needs a run's groups before it starts a
    trainer: torch and transformers are loaded here already, where a new process spends 7-9 s of CPU importing them."""
    import unittest.mock

    import generate
    with unittest.mock.patch.object(sys, "argv", ["generate.py", *flags]):
        generate.main()


def publish_v0(run_dir, settings=None):
    """What the trainer does first: run.json and the untrained adapter (B = 0) as version 0. Returns its AdapterStore."""
    from minigrpo.adapters import AdapterStore
    from minigrpo.lora import DEFAULT_TARGETS, adapter_config, inject_lora, lora_state_dict
    from minigrpo.model import load_model
    from minigrpo.run import RunSettings, create_run
    from minigrpo.storage import Storage
    storage = Storage(str(run_dir))
    store = AdapterStore(storage, create_run(storage, settings or RunSettings())["run_id"])
    model, _ = load_model("demo", torch.device("cpu"))
    inject_lora(model, 8, 16.0, DEFAULT_TARGETS)
    store.write(0, lora_state_dict(model), adapter_config(8, 16.0, DEFAULT_TARGETS, "demo"))
    store.set_latest(0, keep=5)
    return store


# ---- run directories ----
def rollout_groups(storage) -> dict:
    """{group id: group} of every object in RUN/rollouts/, each read whole (a ValueError if one does not read)."""
    from minigrpo.rollouts import read_groups
    groups = {}
    for name in storage.list("rollouts"):
        for group in read_groups(storage.get(f"rollouts/{name}"), name.removesuffix(".safetensors")):
            groups[group.group_id] = group
    return groups


def unconsumed(storage) -> dict:
    """{object id: its groups that no checkpoint's ledger holds as consumed}, for each object left in RUN/rollouts/."""
    consumed, left = set(), {}
    for name in storage.list("checkpoints"):
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
            ledger = json.loads(storage.get(f"checkpoints/{name}/trainer_state.json"))["ledger"]
            consumed |= {*ledger["collect"], *ledger["consumed"]}
    for gid in rollout_groups(storage):
        left.setdefault(gid.rsplit(".", 1)[0], set()).add(gid)
    return {oid: gids - consumed for oid, gids in left.items()}


def train_records(run_dir: str) -> list[dict]:
    """The trainer's step records that stand (a step redone after a crash: its last record), steps 1.."""
    from minigrpo.tools.plot import latest_per_step
    from minigrpo.run import read_records
    from minigrpo.storage import Storage
    by_step = latest_per_step(read_records(Storage(run_dir), "train"))
    return [by_step[s] for s in sorted(by_step) if s > 0]


def eval_records(run_dir: str) -> list[dict]:
    from minigrpo.tools.plot import latest_per_step
    from minigrpo.run import read_records
    from minigrpo.storage import Storage
    by_step = latest_per_step(read_records(Storage(run_dir), "train"))
    return [by_step[s] for s in sorted(by_step) if "eval/accuracy" in by_step[s]]


def gen_records(run_dir: str, generator: str) -> list[dict]:
    from minigrpo.run import read_records
    from minigrpo.storage import Storage
    return [r for r in read_records(Storage(run_dir), "generate-") if r["generator"] == generator]


# ---- a real S3 server on loopback: moto's server mode, what s3fs's own tests use ----
@pytest.fixture(scope="session")
def s3_endpoint():
    """Start `moto.server` on a free loopback port and point the standard AWS variables at it."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # child processes (train.py, generate.py) inherit them
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
            break
        except urllib.error.HTTPError:
            break  # it answers
        except OSError:
            assert proc.poll() is None and time.time() < deadline, "moto.server did not start"
            time.sleep(0.2)
    yield env["AWS_ENDPOINT_URL"]
    proc.kill()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh, empty bucket; returns its s3:// URL."""
    import uuid

    import boto3
    name = f"minigrpo-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return f"s3://{name}"


@pytest.fixture(params=["local", "memory", "s3"])
def storage(request, tmp_path):
    """A run directory on a local disk, in memory, and on a real S3 server (moto) on loopback."""
    import uuid

    from minigrpo.storage import Storage
    if request.param == "s3":  # a real S3 server (moto) on loopback
        return Storage(request.getfixturevalue("s3_bucket") + "/run")
    return Storage(str(tmp_path / "run") if request.param == "local" else f"memory://{uuid.uuid4().hex}")


def file_digest(path) -> str:
    """What the trainer recomputes: sha256 of the adapter's weights file, 16 hex digits."""
    import hashlib
    return hashlib.sha256(open(os.path.join(path, "adapter_model.safetensors"), "rb").read()).hexdigest()[:16]


def raw_authorization(url: str, value: bytes):
    """(status, parsed JSON) of a GET whose Authorization header carries these exact bytes."""
    import http.client
    import urllib.parse
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.putrequest("GET", u.path)
    conn.putheader("Authorization", value)
    conn.endheaders()
    r = conn.getresponse()
    status, text = r.status, r.read().decode()
    conn.close()
    return status, json.loads(text)


# ---- real vLLM (tests/vllm_replicas.py): replicas, the proxy in front of them, and minigrpo's server beside them ----
@pytest.fixture(scope="session")
def replicas(tmp_path_factory):
    """Two real replicas, started together (about 40 s on a quiet 2-core machine), stopped at the end."""
    from vllm_replicas import Replica, vllm_python
    python, logs, fleet = vllm_python(), tmp_path_factory.mktemp("vllm-logs"), []
    try:
        fleet = [Replica(python, logs / f"replica{i}.log") for i in range(2)]
        for r in fleet:
            r.wait()
        yield fleet
    finally:
        for r in fleet:
            r.stop()


@pytest.fixture(scope="session")
def proxy(replicas):
    from vllm_replicas import KEY
    port = free_port()
    proc = start(["proxy.py", "--upstream", replicas[0].url, "--upstream", replicas[1].url, "--port", str(port),
                  "--api_key", KEY, "--retry_s", "0.2", "--load_timeout_s", "3"], port)
    yield f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait()


@pytest.fixture(scope="session")
def pair(replicas):
    """(vLLM, minigrpo): replica 0 asked directly, and minigrpo's server on the same model with the same LoRA flags."""
    from vllm_replicas import MODEL
    port = free_port()
    proc = start(["-m", "minigrpo.replica.serve", "--model", MODEL, "--port", str(port), "--max_lora_rank", "8",
                  "--max_loras", "6", "--max_cpu_loras", "8"], port)
    yield replicas[0].url, f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait()
