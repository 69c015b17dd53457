"""End to end: generate.py and train.py as two real processes sharing only a run directory, on the demo model.

    python -m pytest -q tests/test_e2e.py        # about a minute and a half on a 2-core CPU
"""
import json
import os
import subprocess
import sys

import pytest
from conftest import eval_records, gen_records, rollout_groups, train_records, unconsumed

from minigrpo.storage import Storage
from train import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 100  # of the default 32 groups




@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("e2e") / "run")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = f"{run_dir}.generate.log"  # a file: a pipe nobody reads fills up and stops the generator mid-print
    with open(log, "w") as out:
        gen = subprocess.Popen([sys.executable, "generate.py", "--run_dir", run_dir, "--generator_id", "g0"], cwd=ROOT,
                               env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        train = subprocess.run([sys.executable, "train.py", "--run_dir", run_dir, "--max_steps", str(STEPS),
                                "--eval_every", "50", "--save_every", "25"], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=600)
        gen.wait(timeout=60)  # the generator must exit by itself once DONE appears
    finally:
        gen.kill()
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert gen.returncode == 0, open(log).read()[-3000:]
    return run_dir


def test_accuracy_rises(demo_run):
    evals = eval_records(demo_run)
    assert evals[0]["step"] == 0 and evals[-1]["step"] == STEPS
    assert evals[-1]["eval/accuracy"] >= evals[0]["eval/accuracy"] + 0.08, evals
    # evaluation's time is its own metric, inside perf/step_s and not inside perf/fwd_bwd_s
    assert all(0 < r["perf/eval_s"] < r["perf/step_s"] - r["perf/fwd_bwd_s"] + 1e-3 for r in evals[1:])


def test_the_policy_audit_has_a_time_of_its_own(demo_run):
    """The audit's no-grad pass is compute, not waiting for rollouts: perf/audit_s, apart from perf/rollout_wait_s,
    and the parts of a step add up to no more than the step."""
    steps = train_records(demo_run)
    assert all(r["perf/audit_s"] > 0 for r in steps)  # every step audits its fresh groups (--policy_check_tol > 0)
    parts = ("perf/audit_s", "perf/rollout_wait_s", "perf/fwd_bwd_s", "perf/weight_sync_s", "perf/eval_s")
    assert all(sum(r.get(k, 0.0) for k in parts) <= r["perf/step_s"] + 1e-3 for r in steps)


def test_every_group_was_trained_exactly_once(demo_run):
    steps = train_records(demo_run)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    ids = [g for r in steps for g in r["group_ids"]]
    assert len(ids) == len(set(ids)) == STEPS * TrainConfig().groups_per_step


def test_first_step_is_on_policy(demo_run):
    first = train_records(demo_run)[0]
    assert first["step"] == 1 and abs(first["ratio/mean"] - 1) < 1e-3 and first["sample/staleness_max"] == 0


def test_a_healthy_run_reports_no_policy_mismatch(demo_run):
    """Groups sampled at the trainer's own version match its log-probs to float32 rounding, far inside the check."""
    assert sum(r["sample/policy_mismatch"] for r in train_records(demo_run)) == 0


def test_generator_followed_the_adapter_versions(demo_run):
    gen = gen_records(demo_run, "g0")
    assert len({r["policy_version"] for r in gen}) >= 3
    last = train_records(demo_run)[-1]
    for key in ("perf/rollout_wait_s", "sample/staleness_mean", "sample/dropped_stale_total", "clip_ratio/low",
                "clip_ratio/high", "perf/weight_sync_s", "perf/step_s", "reward/mean", "sample/rollout_queue_size"):
        assert key in last, key
    assert all(k in gen[-1] for k in ("rollout/backpressure_s", "rollout/generated_tok_s", "policy_version"))


def test_run_directory_is_left_consistent(demo_run):
    storage = Storage(demo_run)
    assert storage.exists("DONE") and not storage.exists("owner.json")
    latest = storage.get("adapters/LATEST").decode().strip()
    assert storage.exists(f"adapters/{latest}/adapter_model.safetensors")
    names = [d for d in storage.list("adapters") if d.startswith("policy-")]
    assert len(names) == STEPS + 1, "every version's name stays claimed (its config), so none is ever written twice"
    assert sum(storage.exists(f"adapters/{d}/adapter_model.safetensors") for d in names) <= 4 + 2, "old weights go"
    trained = {g for r in train_records(demo_run) for g in r["group_ids"]}
    assert trained and all(unconsumed(storage).values()), "an object whose groups were all consumed was not collected"
    assert storage.list("checkpoints") == [f"step-{STEPS - 25:06d}-e000001", f"step-{STEPS:06d}-e000001"]


def test_starting_a_finished_run_again_says_so(demo_run):
    procs = [subprocess.Popen([sys.executable, script, "--run_dir", demo_run], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for script in ("train.py", "generate.py")]  # side by side
    for p in procs:
        err = p.communicate(timeout=300)[1]
        assert p.returncode != 0 and "finished run" in err, err[-2000:]


@pytest.mark.parametrize("script", ["train.py", "generate.py"])
def test_help_documents_every_flag_with_its_help_text(script):
    import dataclasses
    import generate
    import train
    from minigrpo.run import RunSettings
    out = " ".join(subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True).stdout.split())
    config = train.TrainConfig if script == "train.py" else generate.GenerateConfig
    for f in dataclasses.fields(RunSettings) + dataclasses.fields(config):
        assert f"--{f.name}" in out and " ".join(f.metadata["help"].split())[:30] in out, f.name


def test_trainer_two_replicas_proxy_and_http_generator_learn_together(tmp_path):
    from conftest import call, free_port, start
    run_dir, ports = str(tmp_path / "run"), [free_port() for _ in range(3)]
    replicas = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    procs = [start(["-m", "minigrpo.replica.serve", "--port", str(p), "--lora_root", str(tmp_path)], p, wait=False) for p in ports[:2]]
    procs.append(start(["proxy.py", "--upstream", replicas[0], "--upstream", replicas[1], "--port", str(ports[2]),
                        "--api_key", "k"], ports[2]))
    proxy = f"http://127.0.0.1:{ports[2]}"
    try:
        gen = subprocess.Popen([sys.executable, "generate.py", "--run_dir", run_dir, "--generator_id", "h0", "--engine",
                                "http", "--url", proxy, "--api_key", "k", "--prompts_per_batch", "32"], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        procs.append(gen)
        train = subprocess.run([sys.executable, "train.py", "--run_dir", run_dir, "--max_steps", "48", "--eval_every",
                                "48", "--save_every", "48"], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
        assert gen.wait(timeout=60) == 0
        evals = eval_records(run_dir)  # 0.27 -> 0.3675 and 0.345 at step 40 (8 prompts a batch), 0.3675 at 48 (32: 45 s, not 57)
        assert evals[-1]["eval/accuracy"] >= evals[0]["eval/accuracy"] + 0.05, evals
        used = [r["policy_version"] for r in gen_records(run_dir, "h0")]
        assert len(set(used)) >= 3
        # a version is requested only after the proxy loaded it on every replica; both end with the same names
        names = [{m["id"] for m in call("GET", r + "/v1/models")[2]["data"][1:]} for r in replicas]
        run_id = json.loads(Storage(run_dir).get("run.json"))["run_id"]
        assert names[0] == names[1] and f"policy-{run_id}-v{used[-1]:06d}" in names[0]
        seen = set()
        for a in range(10, 16):  # new prompts: each is unmatched and goes to the next equally idle replica
            assert call("POST", proxy + "/v1/completions", {"prompt": f"{a}+{a}=", "max_tokens": 2}, key="k")[0] == 200
            seen.add(call.headers["X-Proxy-Upstream"])
        assert seen == {"0", "1"}
    finally:
        for p in procs:
            p.kill()


def test_two_runs_on_one_pair_of_replicas_each_sample_with_their_own_weights(tmp_path):
    """Adapter names carry the run id: a second run on the same replicas never gets the first run's weights."""
    import torch
    from conftest import call, free_port, start

    from minigrpo.lora import inject_lora, load_adapter
    from conftest import sequence_logprobs
    from minigrpo.model import load_model
    ports = [free_port() for _ in range(3)]
    replicas = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    procs = [start(["-m", "minigrpo.replica.serve", "--port", str(p)], p, wait=False) for p in ports[:2]]
    procs.append(start(["proxy.py", "--upstream", replicas[0], "--upstream", replicas[1], "--port", str(ports[2]),
                        "--no_auth"], ports[2]))
    model, _ = load_model("demo", torch.device("cpu"))
    inject_lora(model, 8, 16.0)
    try:
        for run, seed in (("a", 1), ("b", 2)):  # one after the other, on the same replicas
            run_dir = str(tmp_path / run)
            gen = subprocess.Popen([sys.executable, "generate.py", "--run_dir", run_dir, "--engine", "http", "--url",
                                    f"http://127.0.0.1:{ports[2]}", "--generator_id", run], cwd=ROOT,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            procs.append(gen)
            train = subprocess.run([sys.executable, "train.py", "--run_dir", run_dir, "--max_steps", "8", "--seed",
                                    str(seed), "--lr", "0.03", "--groups_per_step", "4", "--eval_every", "100",
                                    "--eval_size", "20", "--loss_type", "grpo"],  # lr 0.03 may collapse the policy,
                                   cwd=ROOT, capture_output=True, text=True, timeout=300)  # dapo would then wait
            assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
            assert gen.wait(timeout=60) == 0
            assert train_records(run_dir)[-1]["sample/attribution_mismatch"] == 0  # every digest matched its version
            storage, near, far = Storage(run_dir), [], []
            for group in rollout_groups(storage).values():  # groups sampled after the last step: recompute log-probs
                adapter = f"{run_dir}/adapters/policy-{json.loads(storage.get('run.json'))['run_id']}-v{group.policy_version:06d}"
                if group.policy_version == 0 or not os.path.isdir(adapter):
                    continue
                assert load_adapter(model, adapter) == group.adapter_digest  # the replica said which weights it used
                ids = torch.tensor([group.prompt_ids + group.completion_ids[0]])
                logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), 1.0)
                gap = lambda lp: max(abs(a - b) for a, b in zip(lp[0, len(group.prompt_ids) - 1:].tolist(),  # noqa: E731
                                                                group.behavior_logprobs[0]))
                near.append(gap(logp))
                earlier = adapter.replace(f"-v{group.policy_version:06d}", f"-v{group.policy_version - 1:06d}")
                if os.path.isfile(f"{earlier}/adapter_model.safetensors"):  # retention deletes weights, not names
                    load_adapter(model, earlier)
                    far.append(gap(sequence_logprobs(model, ids, torch.ones_like(ids), 1.0)[0]))
            # float32 rounding in a replica's batched decode stays under 5e-5 on this machine but reached 9e-4 on
            # another CPU (CI, 2026-12-03); the weights one version earlier must be beyond that tolerance
            assert near and max(near) < 1e-2, (run, near)
            assert far and max(far) > max(1e-2, 10 * max(near)), (run, far)
        names = [{m["id"] for m in call("GET", r + "/v1/models")[2]["data"][1:]} for r in replicas]
        ids = [json.loads(Storage(str(tmp_path / run)).get("run.json"))["run_id"] for run in "ab"]
        assert all(any(ids[1] in n for n in names[i]) for i in (0, 1)) and ids[0] != ids[1]
    finally:
        for p in procs:
            p.kill()
