"""End to end: generate.py and train.py as two real processes sharing only a run directory, on the demo model.

    python -m pytest -q tests/test_e2e.py        # about a minute and a half on a 2-core CPU
"""
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 200


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("e2e") / "run")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    gen = subprocess.Popen([sys.executable, "generate.py", "--run_dir", run_dir, "--generator_id", "g0"], cwd=ROOT,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        train = subprocess.run([sys.executable, "train.py", "--run_dir", run_dir, "--max_steps", str(STEPS),
                                "--eval_every", "100", "--save_every", "50"], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=600)
        gen_out, _ = gen.communicate(timeout=60)  # the generator must exit by itself once DONE appears
    finally:
        gen.kill()
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert gen.returncode == 0, gen_out[-3000:]
    return run_dir


def test_accuracy_rises(demo_run):
    evals = [r for r in records(os.path.join(demo_run, "metrics", "train.jsonl")) if "eval/accuracy" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == STEPS
    assert evals[-1]["eval/accuracy"] >= evals[0]["eval/accuracy"] + 0.08, evals


def test_every_group_was_trained_at_most_once(demo_run):
    steps = [r for r in records(os.path.join(demo_run, "metrics", "train.jsonl")) if r["step"] > 0]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    ids = [g for r in steps for g in r["group_ids"]]
    assert len(ids) == len(set(ids)) == STEPS * 16


def test_first_step_is_on_policy(demo_run):
    first = next(r for r in records(os.path.join(demo_run, "metrics", "train.jsonl")) if r["step"] == 1)
    assert abs(first["ratio/mean"] - 1) < 1e-3 and first["sample/staleness_max"] == 0


def test_generator_followed_the_adapter_versions(demo_run):
    gen = records(os.path.join(demo_run, "metrics", "generate-g0.jsonl"))
    assert len({r["policy_version"] for r in gen}) >= 3
    train = records(os.path.join(demo_run, "metrics", "train.jsonl"))
    for key in ("perf/rollout_wait_s", "sample/staleness_mean", "sample/dropped_stale_total", "clip_ratio/low",
                "clip_ratio/high", "perf/weight_sync_s", "perf/step_s", "reward/mean"):
        assert key in train[-1], key
    assert all(k in gen[-1] for k in ("rollout/backpressure_s", "rollout/generated_tok_s", "policy_version"))


def test_run_directory_is_left_consistent(demo_run):
    assert os.path.exists(os.path.join(demo_run, "DONE"))
    adapters = os.path.join(demo_run, "adapters")
    latest = open(os.path.join(adapters, "LATEST")).read().strip()
    assert os.path.isfile(os.path.join(adapters, latest, "adapter_model.safetensors"))
    assert len([d for d in os.listdir(adapters) if d.startswith("policy-v")]) <= 4 + 2
    assert os.listdir(os.path.join(demo_run, "rollouts", "claimed")) == []


def latest_records(path):
    """The records that stand: after a resume, a re-run step supersedes the record of the same step number."""
    by_step = {}
    for r in records(path):
        by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def test_trainer_killed_mid_run_resumes_without_training_a_group_twice(tmp_path):
    run_dir, env = str(tmp_path / "run"), dict(os.environ, PYTHONUNBUFFERED="1")
    train_cmd = [sys.executable, "train.py", "--run_dir", run_dir, "--max_steps", "30", "--save_every", "10",
                 "--eval_every", "1000", "--groups_per_step", "4"]
    gen = subprocess.Popen([sys.executable, "generate.py", "--run_dir", run_dir, "--generator_id", "g0",
                            "--max_ready", "8"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        first = subprocess.Popen(train_cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        log = os.path.join(run_dir, "metrics", "train.jsonl")
        deadline = time.time() + 300
        while not (os.path.exists(log) and any(r["step"] >= 15 for r in records(log))):
            assert time.time() < deadline and first.poll() is None, "the first trainer did not reach step 15"
            time.sleep(0.05)
        first.kill()  # SIGKILL: no chance to clean up
        first.wait()
        before = records(log)
        second = subprocess.run(train_cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
        assert "resumed from" in second.stdout and "step-000010" in second.stdout
        assert gen.wait(timeout=60) == 0
    finally:
        gen.kill()
    steps = [r for r in latest_records(log) if r["step"] > 0]
    assert [r["step"] for r in steps] == list(range(1, 31))
    ids = [g for r in steps for g in r["group_ids"]]
    assert len(ids) == len(set(ids)) == 30 * 4, "a group was trained twice"
    resumed = [r for r in records(log)[len(before):] if r["step"] > 0]
    assert resumed[0]["step"] == 11
    assert resumed[0]["version"] > max(r["version"] for r in before), "an adapter name was reused after the resume"


def test_starting_a_finished_run_again_says_so(demo_run):
    again = subprocess.run([sys.executable, "train.py", "--run_dir", demo_run], cwd=ROOT, capture_output=True, text=True)
    assert again.returncode != 0 and "finished run" in again.stderr
    gen = subprocess.run([sys.executable, "generate.py", "--run_dir", demo_run], cwd=ROOT, capture_output=True, text=True)
    assert gen.returncode != 0 and "finished run" in gen.stderr


def test_help_documents_every_flag():
    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True).stdout
    for flag in ("--run_dir", "--max_steps", "--loss_type", "--max_staleness", "--lora_r", "--temperature"):
        assert flag in out
    assert "optimizer steps in the whole run" in out


def test_trainer_two_replicas_proxy_and_http_generator_learn_together(tmp_path):
    from conftest import call, free_port, start
    run_dir, ports = str(tmp_path / "run"), [free_port() for _ in range(3)]
    replicas = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    procs = [start(["-m", "minigrpo.serve", "--port", str(p), "--lora_root", str(tmp_path)], p, wait=False) for p in ports[:2]]
    procs.append(start(["proxy.py", "--upstream", replicas[0], "--upstream", replicas[1], "--port", str(ports[2]),
                        "--api_key", "k"], ports[2]))
    proxy = f"http://127.0.0.1:{ports[2]}"
    try:
        gen = subprocess.Popen([sys.executable, "generate.py", "--run_dir", run_dir, "--generator_id", "h0", "--engine",
                                "http", "--url", proxy, "--api_key", "k"], cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
        procs.append(gen)
        train = subprocess.run([sys.executable, "train.py", "--run_dir", run_dir, "--max_steps", "120", "--eval_every",
                                "60", "--save_every", "60"], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
        assert gen.wait(timeout=60) == 0
        evals = [r for r in records(os.path.join(run_dir, "metrics", "train.jsonl")) if "eval/accuracy" in r]
        assert evals[-1]["eval/accuracy"] >= evals[0]["eval/accuracy"] + 0.08, evals
        used = [r["policy_version"] for r in records(os.path.join(run_dir, "metrics", "generate-h0.jsonl"))]
        assert len(set(used)) >= 3
        # a version is requested only after the proxy loaded it on every replica; both end with the same names
        names = [{m["id"] for m in call("GET", r + "/v1/models")[2]["data"][1:]} for r in replicas]
        assert names[0] == names[1] and f"policy-v{used[-1]:06d}" in names[0]
        stats = call("GET", proxy + "/proxy/stats", key="k")[2]
        assert all(u["routed"] > 0 for u in stats["upstreams"]) and stats["router"]["routed"] >= len(used) * 8
    finally:
        for p in procs:
            p.kill()
