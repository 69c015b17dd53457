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
from conftest import ROOT, save_random_adapter, tiny_model, train_records
from test_faults import publish_v0
from test_train_step import sequences

from minigrpo.engine import TorchEngine
from minigrpo.lora import inject_lora, lora_layers
from minigrpo.model import load_model, stop_token_ids
from minigrpo.rollouts import Group, Ledger, RolloutBuffer, check_group, read_group
from minigrpo.run import RunSettings, create_run, parse_config
from minigrpo.storage import Storage
from minigrpo.tasks import ReverseAddition
from train import TrainConfig, evaluate, policy_mismatches, train_step


def groups_of(samples, G, version):
    return [Group(s[0].ids[:s[0].prompt_len], [], [], [], [], version, 1.0) for s in zip(*[iter(samples)] * G)]


def test_only_groups_sampled_with_other_weights_than_they_name_are_flagged():
    sampler, trainer = tiny_model(), tiny_model()
    for model in (sampler, trainer):
        inject_lora(model, 4, 8)
    with torch.no_grad():  # the sampler serves other weights under the trainer's version
        for layer in lora_layers(sampler).values():
            layer.lora_B.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    cfg, run = TrainConfig(), RunSettings(group_size=4)
    own, other = sequences(trainer, n=8, G=4), sequences(sampler, n=8, G=4, seed=1)
    samples = own + other  # groups 0-1 from the trainer's weights, 2-3 from the sampler's
    optimizer = torch.optim.AdamW([p for p in trainer.parameters() if p.requires_grad], lr=0.0)
    train_step(trainer, optimizer, samples, run, cfg, torch.device("cpu"))
    groups = groups_of(samples, 4, version=3)
    assert policy_mismatches(groups, samples, 3, 1, cfg.policy_check_tol) == groups[2:]
    assert policy_mismatches(groups, samples, 4, 1, cfg.policy_check_tol) == [], "other versions are not judged"
    assert policy_mismatches(groups, samples, 3, 1, 0.0) == [], "tol 0 turns it off"
    assert max(s.gap / len(s.behav) for s in own) < 1e-4 < cfg.policy_check_tol


def test_a_sampler_that_served_other_weights_under_the_trainers_version_is_reported_loudly(tmp_path):
    """Groups stamped v0 but sampled with a random adapter and without a digest (as real vLLM sends none): the
    trainer, whose v0 is the base model, counts them and says so on the step line."""
    other, mine = tmp_path / "other", tmp_path / "mine"
    store = publish_v0(str(other))
    save_random_adapter(tmp_path / "random", r=8, alpha=16.0)
    shutil.copy(tmp_path / "random" / "adapter_model.safetensors", f"{store.url(0)}/adapter_model.safetensors")
    subprocess.run([sys.executable, "generate.py", "--run_dir", str(other), "--max_batches", "2"], cwd=ROOT,
                   check=True, capture_output=True, timeout=300)
    storage = Storage(str(other))
    groups = [read_group(storage.get(f"rollouts/{f}"), f.removesuffix(".safetensors")) for f in storage.list("rollouts")]
    for g in groups:
        g.adapter_digest = ""
    RolloutBuffer(Storage(str(mine))).write(groups, "replica", 0)
    out = subprocess.run([sys.executable, "train.py", "--run_dir", str(mine), "--max_steps", "1", "--groups_per_step",
                          "16", "--eval_every", "1000", "--eval_size", "8", "--loss_type", "grpo"],  # every group, zero std too
                         cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "POLICY MISMATCH: 16 groups named v0" in out.stdout
    record = train_records(str(mine))[0]
    assert record["sample/policy_mismatch"] == 16 and record["sample/policy_mismatch_total"] == 16


def test_a_dapo_run_with_nothing_to_learn_from_stops_with_a_clear_line(tmp_path):
    """Every group has equal rewards (a collapsed or saturated policy): dapo drops them all, and after --wait_timeout_s
    without a group to learn from (however many others arrive) the trainer stops, naming why and what it dropped."""
    run_dir = str(tmp_path / "run")
    store = publish_v0(run_dir)
    subprocess.run([sys.executable, "generate.py", "--run_dir", run_dir, "--max_batches", "2"], cwd=ROOT,
                   check=True, capture_output=True, timeout=300)
    storage = Storage(run_dir)
    groups = [read_group(storage.get(f"rollouts/{f}"), f.removesuffix(".safetensors")) for f in storage.list("rollouts")]
    storage.delete([f"rollouts/{f}" for f in storage.list("rollouts")])
    for g in groups:
        g.rewards = [0.0] * len(g.rewards)
    RolloutBuffer(store.storage).write(groups, "flat", 0)
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
    whole = evaluate(engine, tokenizer, task, problems, run, seed=3, batch_size=100)
    assert [evaluate(engine, tokenizer, task, problems, run, seed=3, batch_size=b) for b in (7, 32)] == [whole] * 2
    assert 0 < whole < 1


def test_float16_training_is_refused_naming_bfloat16(capsys):
    with pytest.raises(SystemExit):
        parse_config(RunSettings, TrainConfig, argv=["--dtype", "float16"])
    err = capsys.readouterr().err  # argparse: "invalid choice: 'float16' (choose from float32, bfloat16)"
    assert "--dtype" in err and "invalid choice: 'float16'" in err and "bfloat16" in err

def test_a_generator_that_grades_otherwise_than_the_run_refuses_to_start(tmp_path):
    storage = Storage(str(tmp_path / "run"))
    create_run(storage, RunSettings(), grader="math-verify 0.0")  # run.json records the trainer's grader
    out = subprocess.run([sys.executable, "generate.py", "--run_dir", storage.url(), "--max_batches", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "grades with exact match, the run with math-verify 0.0" in out.stderr
    assert storage.list("rollouts") == []


def test_a_group_scored_by_another_grader_is_quarantined_by_name(tmp_path):
    storage, run = Storage(str(tmp_path / "run")), {"group_size": 2, "temperature": 1.0, "max_prompt_len": 8,
                                                    "max_new_tokens": 4, "grader": "exact match"}
    buffer, stats = RolloutBuffer(storage), {}
    group = Group([1, 2], [[3], [4]], [[-0.5], [-0.7]], [1.0, 0.0], [False, False], 0, 1.0, grader="math-verify 0.0")
    buffer.write([group, Group(**{**group.__dict__, "grader": "exact match"})], "g", seq=0)
    taken = buffer.take(2, Ledger(), partial(check_group, run=run, vocab_size=16, version=0), stats)
    assert [g.grader for g in taken] == ["exact match"] and stats["bad_total"] == 1
    reason = storage.get("bad/g-000000.reason.txt").decode()
    assert "grader: scored by 'math-verify 0.0', the run's is 'exact match'" in reason
