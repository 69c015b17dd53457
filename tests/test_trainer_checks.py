"""The trainer's own checks: a policy that was not applied is loud, evaluation in chunks is evaluation in one batch,
float16 training is refused by name, and one grader scores a run.

    python -m pytest -q tests/test_trainer_checks.py
"""
import shutil
from functools import partial
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, publish_v0, save_random_adapter, tiny_model, train_records
from test_faults import generated_groups
from test_train_step import sequences

from minigrpo.engine import TorchEngine
from minigrpo.lora import inject_lora, lora_layers, lora_state_dict
from minigrpo.model import load_model, stop_token_ids
from minigrpo.rollouts import Group, Ledger, RolloutBuffer, check_group
from minigrpo.run import RunSettings, create_run, parse_config
from minigrpo.storage import Storage
from minigrpo.tasks import ReverseAddition
from train import TrainConfig, audit, evaluate, policy_tol


def groups_of(samples, G, version):
    return [Group(s[0].ids[:s[0].prompt_len], [x.ids[x.prompt_len:] for x in s], [x.behav for x in s], [0.0] * G,
                  [False] * G, version, 1.0) for s in zip(*[iter(samples)] * G)]


def test_the_audit_catches_the_groups_not_sampled_with_the_weights_of_the_version_they_name():
    sampler, trainer = tiny_model(), tiny_model()
    for model in (sampler, trainer):
        inject_lora(model, 4, 8)
    with torch.no_grad():  # the sampler serves other weights under the trainer's version
        for layer in lora_layers(sampler).values():
            layer.lora_B.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    cfg, run, cpu = TrainConfig(), RunSettings(group_size=4), torch.device("cpu")
    groups = groups_of(sequences(trainer, n=8, G=4) + sequences(sampler, n=8, G=4, seed=1), 4, version=3)
    v3 = {k: v.clone() for k, v in lora_state_dict(trainer).items()}
    with torch.no_grad():  # the trainer has moved on since v3: the audit must score with v3's weights, then restore
        for layer in lora_layers(trainer).values():
            layer.lora_B.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    now = {k: v.clone() for k, v in lora_state_dict(trainer).items()}
    caught = audit(trainer, groups, {3: v3}.get, run, cfg, cpu)
    assert [g for g, *_ in caught] == groups[2:] and all(gap > cfg.policy_check_tol for _, gap, _ in caught)
    assert all(torch.equal(now[k], v) for k, v in lora_state_dict(trainer).items()), "the weights are restored"
    assert audit(trainer, groups, {}.get, run, cfg, cpu) == [], "a version whose weights are gone is not judged"
    assert audit(trainer, groups, {3: v3}.get, run, TrainConfig(policy_check_tol=0.0), cpu) == [], "0 turns it off"


def test_the_audits_tolerance_grows_with_bf16_on_either_side():
    tol = [policy_tol(TrainConfig(dtype=mine), RunSettings(generator_dtype=gen)) for gen, mine in
           [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float16", "bfloat16")]]
    assert tol == pytest.approx([0.01, 0.1, 0.3, 0.3])


def test_a_sampler_that_served_other_weights_than_the_version_it_names_is_quarantined_before_the_gradient(tmp_path):
    """16 groups stamped v0 but sampled with a random adapter and without a digest (as real vLLM sends none), then
    16 honest ones: the trainer, whose v0 is the base model, quarantines the first 16, trains the others, says so."""
    other, honest, mine = str(tmp_path / "other"), str(tmp_path / "honest"), str(tmp_path / "mine")
    store = publish_v0(other)
    save_random_adapter(tmp_path / "random", r=8, alpha=16.0)
    shutil.copy(tmp_path / "random" / "adapter_model.safetensors", f"{store.url(0)}/adapter_model.safetensors")
    publish_v0(honest)
    run_id = publish_v0(mine).run_id
    for seq, run_dir in ((0, other), (16, honest)):
        groups = generated_groups(run_dir, 2)
        for g in groups:
            g.adapter_digest = ""
        RolloutBuffer(Storage(mine), run_id).write(groups, "replica", seq)
    out = subprocess.run([sys.executable, "train.py", "--run_dir", mine, "--max_steps", "1", "--groups_per_step",
                          "16", "--eval_every", "1000", "--eval_size", "8", "--loss_type", "grpo"],  # every group, zero std too
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "POLICY MISMATCH: 16 groups quarantined, not sampled with the weights they name (v[0]" in out.stdout
    record = train_records(mine)[0]
    assert record["sample/policy_mismatch"] == 16 and record["sample/policy_mismatch_total"] == 16
    assert sorted(record["group_ids"]) == sorted(f"replica-000016.{i}" for i in range(16)), "only the honest ones trained"
    assert len([f for f in Storage(mine).list("bad") if f.endswith(".reason.txt")]) == 16


def test_a_dapo_run_with_nothing_to_learn_from_stops_with_a_clear_line(tmp_path):
    """Every group has equal rewards (a collapsed or saturated policy): dapo drops them all, and after --wait_timeout_s
    without a group to learn from (however many others arrive) the trainer stops, naming why and what it dropped."""
    run_dir = str(tmp_path / "run")
    store = publish_v0(run_dir)
    groups = generated_groups(run_dir, 2)
    for g in groups:
        g.rewards = [0.0] * len(g.rewards)
    RolloutBuffer(store.storage, store.run_id).write(groups, "flat", 0)
    out = subprocess.run([sys.executable, "train.py", "--run_dir", run_dir, "--max_steps", "1", "--groups_per_step",
                          "4", "--eval_every", "1000", "--eval_size", "8", "--wait_timeout_s", "3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "no fresh group to learn from (dapo: unequal rewards)" in out.stderr, out.stderr[-2000:]
    assert "'dropped_zero_std_total': 16" in out.stderr and "Traceback" not in out.stderr


def test_chunked_evaluation_is_one_batch_to_the_bit():
    model, tokenizer = load_model("demo", torch.device("cpu"))
    engine = TorchEngine(model, stop_token_ids(model, tokenizer), tokenizer.pad_token_id)
    task, run = ReverseAddition(), RunSettings()
    problems = task.eval_problems(100)
    row = max(len(tokenizer(p.prompt)["input_ids"]) for p in problems) + run.max_new_tokens  # KV tokens a row
    sizes, generate = [], engine.generate
    engine.generate = lambda prompts, params: sizes.append(len(prompts)) or generate(prompts, params)
    whole = evaluate(engine, tokenizer, task, problems, run, seed=3, batch_tokens=100 * row)
    chunked = [evaluate(engine, tokenizer, task, problems, run, seed=3, batch_tokens=b * row + row - 1) for b in (7, 32)]
    assert chunked == [whole] * 2 and 0 < whole < 1
    assert sizes == [100] + [7] * 14 + [2] + [32] * 3 + [4], sizes  # rows = tokens // (longest prompt + new tokens)


def test_float16_training_is_refused_naming_bfloat16(capsys):
    with pytest.raises(SystemExit):
        parse_config(RunSettings, TrainConfig, argv=["--dtype", "float16"])
    err = capsys.readouterr().err  # argparse: "invalid choice: 'float16' (choose from float32, bfloat16)"
    assert "--dtype" in err and "invalid choice: 'float16'" in err and "bfloat16" in err


@pytest.mark.parametrize("device,dtype", [("cuda", "float32"), ("cuda", "bfloat16"), ("cpu", "float32")])
def test_float32_weights_on_a_gpu_are_named_before_the_model_loads(monkeypatch, capsys, tmp_path, device, dtype):
    import train

    def stop(*args):
        raise SystemExit("stopped before loading the model")
    monkeypatch.setattr(train, "distributed", lambda *args: (0, 1, torch.device(device), None))  # a GPU: as torchrun's
    monkeypatch.setattr(train, "load_model", stop)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # this pytest process keeps its threads
    monkeypatch.setattr(sys, "argv", ["train.py", "--run_dir", str(tmp_path / "run"), "--dtype", dtype])
    with pytest.raises(SystemExit, match="stopped before loading"):
        train.main()
    said = "float32 base weights on a GPU take twice the memory of --dtype bfloat16, and run slower" in capsys.readouterr().out
    assert said == (device == "cuda" and dtype == "float32")


def test_a_generator_that_grades_otherwise_than_the_run_refuses_to_start(tmp_path):
    storage = Storage(str(tmp_path / "run"))
    create_run(storage, RunSettings(), grader="math-verify 0.0")  # run.json records the trainer's grader
    out = subprocess.run([sys.executable, "generate.py", "--run_dir", storage.url(), "--max_batches", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "grades with exact match, the run with math-verify 0.0" in out.stderr
    assert storage.list("rollouts") == []


def test_a_group_scored_by_another_grader_is_quarantined_by_name(tmp_path):
    storage, run = Storage(str(tmp_path / "run")), {"group_size": 2, "temperature": 1.0, "max_prompt_len": 8,
                                                    "max_new_tokens": 4, "grader": "exact match", "run_id": ""}
    buffer, stats = RolloutBuffer(storage), {}
    group = Group([1, 2], [[3], [4]], [[-0.5], [-0.7]], [1.0, 0.0], [False, False], 0, 1.0, grader="math-verify 0.0")
    buffer.write([group, Group(**{**group.__dict__, "grader": "exact match"})], "g", seq=0)
    taken = buffer.take(2, Ledger(), partial(check_group, run=run, vocab_size=16, version=0), stats)
    assert [g.grader for g in taken] == ["exact match"] and stats["bad_total"] == 1
    reason = storage.get("bad/g-000000.0.reason.txt").decode()
    assert "grader: scored by 'math-verify 0.0', the run's is 'exact match'" in reason
