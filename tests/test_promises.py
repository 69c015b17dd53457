"""Promises a hostile tester attacked (issue 34): bounded rewards and no non-finite step, the policy audit of every
version before the gradient, groups tied to their run and their name, create-only group writes, the lease's host
identity, bounded epochs.

    python -m pytest -q tests/test_promises.py
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, publish_v0, tiny_model, train_records
from test_faults import generated_groups
from test_rundir import RUN, make_group
from test_train_step import sequences

from minigrpo.grpo import advantages
from minigrpo.lora import inject_lora, lora_state_dict
from minigrpo.rollouts import Ledger, RolloutBuffer, check_group, group_key, read_groups, to_tensors
from minigrpo.run import Lease, RunSettings, dead_here, here, lease_view
from minigrpo.storage import Storage
from safetensors.torch import save
from train import TrainConfig, finite_weights, train_step

HUGE = [3e38, 3e38, 0.0, 0.0]


def take_with_checks(storage, groups) -> tuple[list, dict]:
    """Write groups into a run whose id is RUN's, take them through the trainer's checks: (taken, stats)."""
    buffer, stats = RolloutBuffer(storage, RUN["run_id"]), {}
    buffer.write(groups, "g", seq=0)
    return buffer.take(len(groups), Ledger(), lambda g: check_group(g, RUN, vocab_size=16, version=3), stats), stats


# ---- bounded rewards, no non-finite step ----
@pytest.mark.parametrize("rewards", [HUGE, [1e30, 0.0, 0.0, 0.0], [-0.5, 0.0, 1.0, 1.0]])
def test_a_group_with_a_reward_outside_the_tasks_range_is_quarantined_by_name(tmp_path, rewards):
    storage = Storage(str(tmp_path / "run"))
    taken, stats = take_with_checks(storage, [make_group(rewards=rewards)])
    assert taken == [] and stats["bad_total"] == 1
    assert "rewards: " in storage.get("bad/g-000000.0.reason.txt").decode() and "outside the task's range [0.0, 1.0]" \
        in storage.get("bad/g-000000.0.reason.txt").decode()


def test_advantages_of_a_huge_finite_reward_are_finite():
    adv = advantages(torch.tensor(HUGE * 2), 8)
    assert torch.isfinite(adv).all() and adv.dtype == torch.float32 and adv[0] > 0 > adv[-1]


def test_a_step_whose_loss_is_not_finite_is_skipped_and_leaves_the_weights_as_they_were():
    model = tiny_model()
    inject_lora(model, 4, 8)
    samples = sequences(model, n=8, G=4)
    samples[0].adv = float("inf")
    before = {k: v.clone() for k, v in lora_state_dict(model).items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    m = train_step(model, opt, samples, RunSettings(group_size=4), TrainConfig(), torch.device("cpu"))
    assert m["train/skipped_nonfinite"] == 1
    assert all(torch.equal(before[k], v) for k, v in lora_state_dict(model).items())
    assert all(p.grad is None for p in model.parameters()), "the gradient is zeroed"
    samples[0].adv = 1.0
    assert train_step(model, opt, samples, RunSettings(group_size=4), TrainConfig(), torch.device("cpu"))[
        "train/skipped_nonfinite"] == 0, "the next finite step trains"


def test_non_finite_weights_are_never_published_or_saved():
    model = tiny_model()
    inject_lora(model, 4, 8)
    finite_weights(model)
    with torch.no_grad():
        next(p for p in model.parameters() if p.requires_grad)[0, 0] = float("nan")
    with pytest.raises(SystemExit, match="the LoRA weights hold NaN or infinite values"):
        finite_weights(model)


def test_when_every_group_is_quarantined_the_stop_line_names_the_reasons_and_counts(tmp_path):
    """Not "is generate.py running?": every group came, and every one was refused."""
    run_dir = str(tmp_path / "run")
    store = publish_v0(run_dir)
    storage, groups = Storage(run_dir), generated_groups(run_dir, 1)
    for i, g in enumerate(groups):
        g.rewards = [3e38, 3e38] + [0.0] * 6 if i % 2 else [1e30] + [0.0] * 7
    RolloutBuffer(storage, store.run_id).write(groups, "huge", 0)
    out = subprocess.run([sys.executable, "train.py", "--run_dir", run_dir, "--max_steps", "1", "--groups_per_step",
                          "4", "--eval_every", "1000", "--eval_size", "8", "--wait_timeout_s", "3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "Consumed: 8 ValueError: rewards {" in out.stderr, out.stderr[-2000:]
    assert "is generate.py running" not in out.stderr and "Traceback" not in out.stderr
    assert not storage.list("checkpoints") and store.versions() == [0, 1], "nothing trained"


# ---- groups tied to their run and their name ----
def test_a_group_of_another_run_is_quarantined(tmp_path):
    storage = Storage(str(tmp_path / "run"))
    buffer, stats = RolloutBuffer(storage, "other-run"), {}
    buffer.write([make_group()], "g", seq=0)
    assert buffer.take(1, Ledger(), lambda g: check_group(g, RUN, vocab_size=16, version=3), stats) == []
    assert "run_id: written for run 'other-run', this run is 'r1'" in storage.get("bad/g-000000.0.reason.txt").decode()


def test_a_group_without_its_group_id_is_refused():
    tensors, meta = to_tensors([make_group(group_id="g-000001.0")])
    del meta["0.group_id"]
    with pytest.raises(ValueError, match="group_id: this group was written as None, found as 'g-000001.0'"):
        read_groups(save(tensors, metadata=meta), "g-000001")


def test_a_group_name_that_is_taken_is_an_error_never_an_overwrite(storage):
    buffer = RolloutBuffer(storage, "r1")
    buffer.write([make_group()], "g", seq=0)
    with pytest.raises(FileExistsError, match="g-000000.safetensors"):
        buffer.write([make_group(rewards=[0.0, 0.0, 0.0, 1.0])], "g", seq=0)
    assert read_groups(storage.get(group_key("g-000000")), "g-000000")[0].rewards == [1.0, 0.0, 0.5, 0.0]


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path):
    if request.param == "s3":  # a real S3 server (moto) on loopback: If-None-Match
        return Storage(request.getfixturevalue("s3_bucket") + "/run")
    return Storage(str(tmp_path / "run"))


# ---- the lease: this host, this boot, this PID namespace; epochs in six digits ----
def test_a_lease_from_another_boot_or_pid_namespace_is_not_dead_here():
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no process holds now
    assert dead_here(lease_view(json.dumps({**here(), "pid": gone.pid})))
    for other in ({"boot": "another-boot"}, {"pidns": 1}):
        assert not dead_here(lease_view(json.dumps({**here(), "pid": gone.pid, **other})))


def test_a_live_trainer_seen_from_another_pid_namespace_is_not_taken_for_dead():
    """Inside a new PID namespace this process's pid does not exist: hostname + kill(pid, 0) alone would say dead."""
    code = (f"from minigrpo.run import dead_here, lease_view; import os, json; "
            f"print(dead_here(lease_view({json.dumps({**here(), 'pid': os.getpid()})!r})))")
    out = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    if out.returncode and "unshare" in out.stderr:
        pytest.skip(f"no PID namespaces here: {out.stderr.strip()}")
    assert out.stdout.strip() == "False", out.stderr


def test_a_lease_claiming_an_epoch_past_six_digits_is_refused_in_one_line(tmp_path):
    storage = Storage(str(tmp_path / "run"))
    storage.put("owner.json", json.dumps({"owner": "x", "host": "elsewhere", "pid": 1, "epoch": 999_999}))
    with pytest.raises(SystemExit, match="claim epoch 999999: past 999998"):
        Lease(storage, timeout_s=0.2).acquire()
    storage.put("owner.json", json.dumps({"owner": "x", "host": "elsewhere", "pid": 1, "epoch": 999_998}))
    lease = Lease(storage, timeout_s=0.2)
    assert lease.acquire() and lease.info["epoch"] == 999_999
    lease.release()


# ---- the policy audit of every version, end to end ----
LIAR = ("import sys, torch; sys.argv[0] = 'generate.py'; import minigrpo.engine as e, generate; init = e.TorchEngine.__init__; "
        "e.TorchEngine.load_adapter = lambda self, v, path: setattr(self, 'version', v); {}generate.main()")
LIARS = {"liar": LIAR.format(""),  # names each new version, samples with the base model: honest at v0 only
         "impostor": LIAR.format("e.TorchEngine.__init__ = lambda self, m, *a: (init(self, m, *a), torch.manual_seed(1), "
                                 "[p.data.add_(torch.randn_like(p), alpha=0.02) for p in m.parameters()]) and None; ")}


def run_fleet(run_dir, generators, train_flags, dtype="float32") -> tuple[list[dict], str]:
    """train.py with generators beside it (LIARS: samples with other weights than it names): (records, out)."""
    procs = [subprocess.Popen([sys.executable, *(["-c", LIARS[g]] if g in LIARS else ["generate.py"]), "--run_dir", run_dir,
                               "--generator_id", f"{g}{i}", "--generator_dtype", dtype, "--max_ready", "16"], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i, g in enumerate(generators)]
    try:
        out = subprocess.run([sys.executable, "train.py", "--run_dir", run_dir, "--eval_every", "1000", "--eval_size",
                              "8", "--generator_dtype", dtype, "--dtype", dtype, "--wait_timeout_s", "20", *train_flags],
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
    finally:
        for p in procs:
            p.kill()
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    return train_records(run_dir), out.stdout + out.stderr


def caught_writers(run_dir) -> set:
    storage = Storage(run_dir)
    return {n.split("-")[0] for n in storage.list("bad") if n.endswith(".reason.txt")
            and "PolicyMismatch" in storage.get(f"bad/{n}").decode()}


def test_a_base_model_generator_running_ahead_of_the_trainer_is_caught_within_3_steps(tmp_path):
    """Its v0 groups are honest (v0 is the base model); from v1 on nearly all are caught, so a lone liar starves the
    trainer, which then stops naming why: on a step line (POLICY MISMATCH), or, when the starved step never
    completes, on its stop line (a run here caught 35 groups in the step after step 2, which never completed)."""
    run_dir = str(tmp_path / "run")
    records, out = run_fleet(run_dir, ["liar"], ["--max_steps", "3", "--groups_per_step", "8"])
    assert caught_writers(run_dir) == {"liar0"} and len(records) <= 3, out[-3000:]
    assert (any(r["sample/policy_mismatch"] for r in records) and "POLICY MISMATCH" in out
            or "no fresh group to learn from" in out and "PolicyMismatch: policy_version" in out.splitlines()[-1]), out[-3000:]
    assert max(r["sample/staleness_max"] for r in records) > 0, "it ran ahead"


def test_one_lying_generator_among_three_is_caught_and_only_it(tmp_path):
    """The impostor samples with other weights from v0 on. A base-model liar is honest at v0, and the trainer takes a
    round's objects in writer-name order, so on a loaded machine 4 steps could end before its first lie is taken."""
    run_dir = str(tmp_path / "run")
    records, out = run_fleet(run_dir, ["honest", "honest", "impostor"], ["--max_steps", "4", "--groups_per_step", "16"])
    assert sum(r["sample/policy_mismatch"] for r in records) > 0 and caught_writers(run_dir) == {"impostor2"}, out[-3000:]


def test_a_healthy_bfloat16_run_has_no_policy_mismatch(tmp_path):
    """bf16 rounds more than float32 (policy_tol: 10x); float32's healthy runs are test_e2e's demo (100 steps) and the
    honest generators beside test_one_lying_generator_among_three_is_caught_and_only_it's impostor."""
    records, out = run_fleet(str(tmp_path / "run"), ["honest"], ["--max_steps", "8", "--groups_per_step", "8"], "bfloat16")
    assert "POLICY MISMATCH" not in out and all(r["sample/policy_mismatch"] == 0 for r in records)
    assert all(len(g.rsplit("-", 2)[1]) == 16 for r in records for g in r["group_ids"]), "64-bit life suffixes"
