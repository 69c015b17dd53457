"""The run directory in-process: storage on a local disk and in memory, rollout groups and the trainer's ledger,
quarantine of hostile files, adapter versions, checkpoints, run.json, the lease and the metrics segments.

    python -m pytest -q tests/test_rundir.py
"""
import json
import os
import socket
import subprocess
import time
import uuid

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import save

from minigrpo.adapters import AdapterStore
from minigrpo.checkpoint import load_checkpoint, prune_checkpoints, save_checkpoint
from minigrpo.lora import DEFAULT_TARGETS, adapter_config, adapter_digest, inject_lora, lora_layers, lora_state_dict
from minigrpo.rollouts import (AttributionError, Group, Ledger, RolloutBuffer, check_group, group_key, read_group,
                               to_tensors)
from minigrpo.run import (Lease, Metrics, RunSettings, create_run, join_run, latest_per_step, parse_config,
                          read_records)
from minigrpo.storage import Storage

RUN = {"group_size": 4, "temperature": 1.0, "max_prompt_len": 8, "max_new_tokens": 3}


@pytest.fixture(params=["local", "memory", "s3"])
def storage(request, tmp_path):
    if request.param == "s3":  # a real S3 server (moto) on loopback
        return Storage(request.getfixturevalue("s3_bucket") + "/run")
    return Storage(str(tmp_path / "run") if request.param == "local" else f"memory://{uuid.uuid4().hex}")


def make_group(version=3, G=4, temperature=1.0):
    return Group(prompt_ids=[5, 6, 7], completion_ids=[[1], [2, 3], [4, 5, 1], [9, 9]][:G],
                 behavior_logprobs=[[-0.5], [-0.125, -0.25], [-1.0, -0.375, -0.0625], [-2.0, -0.75]][:G],
                 rewards=[1.0, 0.0, 0.5, 0.0][:G], truncated=[False, True, False, True][:G],
                 policy_version=version, temperature=temperature, started_at=1.5, finished_at=2.5)


# ---- storage ----
def test_storage_puts_gets_lists_and_deletes_whole_objects(storage):
    storage.put("a/x.bin", b"\x00\x01")
    storage.put("a/b/y.txt", "text")
    assert storage.get("a/x.bin") == b"\x00\x01" and storage.list("a") == ["b", "x.bin"]
    assert storage.list("nothing/here") == [] and storage.exists("a/b/y.txt")
    storage.delete("a/b", recursive=True)
    storage.delete("a/gone.bin")  # deleting what is gone is fine
    assert storage.list("a") == ["x.bin"]
    with pytest.raises(FileNotFoundError):
        storage.get("a/gone.bin")
    storage.put("a/z.bin", b"z")
    got = storage.get_many(["a/x.bin", "a/gone.bin", "a/z.bin"])  # concurrently on a bucket
    assert got[0] == b"\x00\x01" and isinstance(got[1], FileNotFoundError) and got[2] == b"z"


def test_local_temp_files_are_invisible_and_swept_when_old(tmp_path):
    storage = Storage(str(tmp_path))
    storage.put("rollouts/g-000000.safetensors", b"x")
    temp = tmp_path / "rollouts" / ".g-000001.safetensors.1234abcd.tmp"
    temp.write_bytes(b"half")
    assert storage.list("rollouts") == ["g-000000.safetensors"]
    storage.sweep_temps("rollouts", max_age_s=60)
    assert temp.exists()
    os.utime(temp, (time.time() - 120, time.time() - 120))
    storage.sweep_temps("rollouts", max_age_s=60)
    assert not temp.exists()


def test_local_storage_never_follows_a_symlink_or_opens_a_fifo(tmp_path):
    storage = Storage(str(tmp_path / "run"))
    (tmp_path / "secret").write_bytes(b"outside the run")
    os.makedirs(tmp_path / "run")
    os.symlink(tmp_path / "secret", tmp_path / "run" / "link")
    os.mkfifo(tmp_path / "run" / "fifo")
    for name in ("link", "fifo"):
        with pytest.raises(ValueError, match="not a regular file"):
            storage.get(name)


def test_a_storage_failure_names_the_object(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    storage = Storage(str(tmp_path / "file" / "run"))
    with pytest.raises(OSError, match=f"cannot write {tmp_path}/file/run/run.json"):
        storage.put("run.json", "{}")


# ---- groups, the ledger, quarantine ----
def test_group_round_trips_through_storage(storage):
    buffer = RolloutBuffer(storage)
    group = make_group()
    gid, = buffer.write([group], "gen-a-1f2e", seq=0)
    back = read_group(storage.get(group_key(gid)), gid)
    assert gid == "gen-a-1f2e-000000" and back == group and back.generator_id == "gen-a-1f2e"


def test_take_is_fifo_records_each_group_in_the_ledger_and_never_moves_a_file(storage):
    buffer, ledger = RolloutBuffer(storage), Ledger()
    ids = buffer.write([make_group(version=v) for v in range(5)], "g", seq=0)  # together: one round trip on a bucket
    assert [g.group_id for g in buffer.take(3, ledger)] == ids[:3]
    assert [g.group_id for g in buffer.take(5, ledger)] == ids[3:]
    assert ledger.taken == set(ids) and len(buffer.listed()) == 5 and buffer.take(5, ledger) == []


def test_the_ledger_deletes_only_what_two_checkpoints_cover():
    ledger = Ledger()
    ledger.take("g-000000")
    first = ledger.state()  # checkpoint 1: nothing to collect yet
    ledger.advance()
    ledger.take("g-000001")
    second = ledger.state()  # checkpoint 2: collect what checkpoint 1 consumed
    ledger.advance()
    assert first == {"collect": [], "consumed": ["g-000000"]} and ledger.collect == {"g-000000"}
    assert second == {"collect": ["g-000000"], "consumed": ["g-000001"]}
    resumed = Ledger(json.loads(json.dumps(second)))  # as a checkpoint's trainer_state.json gives it back
    assert resumed.collect == {"g-000000"} and resumed.skip == {"g-000000", "g-000001"}


def hostile(storage, tmp_path, kind):
    """Write one hostile rollout entry of the given kind; returns its group id."""
    tensors, meta = to_tensors(make_group())
    gid = f"evil-{kind.replace('_', '')}-000000"
    path = None if not storage.local else os.path.join(storage.root, group_key(gid))
    if kind in ("symlink", "fifo"):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        (tmp_path / "outside").write_bytes(save(tensors, metadata=meta))
        os.symlink(tmp_path / "outside", path) if kind == "symlink" else os.mkfifo(path)
        return gid
    if kind == "garbage":
        data = b"not a safetensors file at all"
    elif kind == "truncated":
        data = save(tensors, metadata=meta)[:100]
    else:
        if kind == "float_lens":
            tensors["completion_lens"] = tensors["completion_lens"].float()
        elif kind == "float_ids":
            tensors["completion_ids"] = tensors["completion_ids"].float()
        elif kind == "wrong_shapes":
            tensors["rewards"] = torch.zeros(7)
        elif kind == "nan_logprobs":
            tensors["behavior_logprobs"][0, 0] = float("nan")
        elif kind == "missing_field":
            del tensors["behavior_logprobs"]
        elif kind == "long_completion":
            tensors["completion_ids"] = torch.ones(4, 4096, dtype=torch.long)
            tensors["behavior_logprobs"] = -torch.ones(4, 4096)
            tensors["completion_lens"] = torch.full((4,), 4096)
        elif kind == "long_prompt":
            tensors["prompt_ids"] = torch.ones(20_000, dtype=torch.long)
        data = save(tensors, metadata=meta)
    storage.put(group_key(gid), data)
    return gid


REASONS = {"garbage": "SafetensorError", "truncated": "SafetensorError",
           "float_lens": "completion_lens has dtype torch.float32", "float_ids": "completion_ids has dtype torch.float32",
           "wrong_shapes": "inconsistent shapes", "nan_logprobs": "behavior_logprobs must be finite",
           "missing_field": "missing tensors ['behavior_logprobs']",
           "long_completion": "completion_ids: 4096 tokens, the run's max_new_tokens is 3",
           "long_prompt": "prompt_ids: 20000 tokens, the run allows 1 to 8",
           "symlink": "is not a regular file", "fifo": "is not a regular file"}


@pytest.mark.parametrize("kind", list(REASONS))
def test_a_hostile_group_is_quarantined_with_a_reason_that_names_it_and_the_trainer_goes_on(tmp_path, kind):
    storage = Storage(str(tmp_path / "run"))
    buffer, ledger, stats = RolloutBuffer(storage), Ledger(), {}
    bad = hostile(storage, tmp_path, kind)
    good, = buffer.write([make_group()], "g", seq=1)
    check = lambda g: check_group(g, RUN, vocab_size=16, version=3)  # noqa: E731
    assert [g.group_id for g in buffer.take(5, ledger, check, stats)] == [good]
    reason = storage.get(f"bad/{bad}.reason.txt").decode()
    assert REASONS[kind] in reason, reason
    assert stats["bad_total"] == 1 and storage.list("rollouts") == [f"{good}.safetensors"]
    assert (tmp_path / "outside").exists() or kind not in ("symlink", "fifo")  # the link's target is untouched


def test_check_group_enforces_the_runs_bounds():
    check_group(make_group(version=3), RUN, vocab_size=16, version=3)
    for group, match in [(make_group(version=4), "future"), (make_group(temperature=0.7), "temperature"),
                         (make_group(G=2), "group_size")]:
        with pytest.raises(ValueError, match=match):
            check_group(group, RUN, vocab_size=16, version=3)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 8\)"):
        check_group(make_group(), RUN, vocab_size=8, version=3)


def test_a_group_sampled_with_other_weights_than_its_version_is_refused():
    group = make_group()
    group.adapter_digest = "0123456789abcdef"
    check_group(group, RUN, 16, 3, digest_of={3: "0123456789abcdef"}.get)
    with pytest.raises(AttributionError, match="adapter_digest: sampled with weights 0123456789abcdef, but version 3 is ffff"):
        check_group(group, RUN, 16, 3, digest_of={3: "ffff"}.get)


# ---- adapter versions ----
def publish_model(store, version, r=2, keep=3):
    model = tiny_model()
    inject_lora(model, r=r, alpha=4)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.fill_(version)
    store.write(version, lora_state_dict(model), adapter_config(r, 4, DEFAULT_TARGETS, "tiny"))
    store.set_latest(version, keep=keep)


def test_publish_writes_a_peft_dir_named_with_the_run_id_and_points_latest_at_it(storage):
    store = AdapterStore(storage, "run1")
    assert store.latest() is None and store.next_version() == 0
    publish_model(store, 0)
    assert store.latest() == 0 and store.url(0) == storage.url("adapters/policy-run1-v000000")
    assert storage.list("adapters/policy-run1-v000000") == ["adapter_config.json", "adapter_model.safetensors"]
    assert store.digest(0) == adapter_digest(storage.get("adapters/policy-run1-v000000/adapter_model.safetensors"))


def test_retention_keeps_the_window_plus_one_publish_of_grace(storage):
    store = AdapterStore(storage, "r")
    for v in range(8):
        publish_model(store, v)
    assert store.versions() == [4, 5, 6, 7]  # keep=3: v5..v7 are named, v4 left the window one publish ago


def test_names_are_never_reused_after_a_crash_even_if_a_listing_lags(storage, monkeypatch):
    store = AdapterStore(storage, "r")
    for v in range(3):
        publish_model(store, v)
    store.write(3, {}, {})  # killed before LATEST: version 3 exists but is not named
    assert store.latest() == 2 and store.next_version() == 4
    monkeypatch.setattr(store, "versions", lambda: [0, 1])  # a listing that has not seen v2 and v3 yet
    assert store.next_version() == 4 and store.next_version(at_least=9) == 9


# ---- checkpoints ----
def trained_model_and_optimizer():
    model = tiny_model()
    inject_lora(model, r=2, alpha=4)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    return model, opt


def fresh_model_and_optimizer():
    other = tiny_model()
    inject_lora(other, r=2, alpha=4)
    return other, torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=0.1)


def test_checkpoint_restores_adapter_optimizer_and_state(storage):
    model, opt = trained_model_and_optimizer()
    save_checkpoint(storage, 7, lora_state_dict(model), adapter_config(2, 4, DEFAULT_TARGETS, "tiny"), opt,
                    {"stats": {"dropped_stale_total": 3}})
    other, opt2 = fresh_model_and_optimizer()
    state, skipped = load_checkpoint(storage, other, opt2)
    assert state["step"] == 7 and state["stats"]["dropped_stale_total"] == 3 and skipped == []
    for a, b in zip(lora_layers(model).values(), lora_layers(other).values()):
        assert torch.equal(a.lora_B, b.lora_B)
    assert opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


def test_a_damaged_or_incomplete_newest_checkpoint_falls_back_to_the_one_before(storage):
    model, opt = trained_model_and_optimizer()
    config = adapter_config(2, 4, DEFAULT_TARGETS, "tiny")
    for step in (5, 10, 15):
        save_checkpoint(storage, step, lora_state_dict(model), config, opt, {})
    prune_checkpoints(storage)
    assert storage.list("checkpoints") == ["step-000010", "step-000015"]
    blob = storage.get("checkpoints/step-000015/optimizer.pt")
    storage.put("checkpoints/step-000015/optimizer.pt", blob[: len(blob) // 2])  # cut in half
    storage.put("checkpoints/step-000020/trainer_state.json", "{}")  # a checkpoint killed before its MANIFEST
    state, skipped = load_checkpoint(storage, *fresh_model_and_optimizer())
    assert state["step"] == 10
    assert skipped == ["step-000020: incomplete (no MANIFEST)",
                       "step-000015: damaged (ValueError: optimizer.pt do not match the MANIFEST)"]


# ---- run.json, the lease, metrics ----
def test_create_run_writes_once_and_a_joiner_names_the_field_that_differs(storage):
    first = create_run(storage, RunSettings())
    assert create_run(storage, RunSettings())["run_id"] == first["run_id"] == join_run(storage, RunSettings())["run_id"]
    for settings, field in [(RunSettings(temperature=0.7), "temperature"), (RunSettings(max_staleness=2), "max_staleness")]:
        with pytest.raises(SystemExit, match=f"{field}: run.json has"):
            join_run(storage, settings)
    assert json.loads(storage.get("run.json"))["temperature"] == 1.0


def test_a_damaged_or_missing_run_json_is_one_clear_line(storage):
    storage.put("run.json", '{"model": "demo", "tempera')
    with pytest.raises(SystemExit, match="run.json is damaged \\(not valid JSON"):
        create_run(storage, RunSettings())
    storage.delete("run.json")
    storage.put("adapters/LATEST", "policy-x-v000001")
    with pytest.raises(SystemExit, match="run.json is missing but the run has adapters or checkpoints"):
        create_run(storage, RunSettings())
    with pytest.raises(SystemExit, match="no .*run.json after 0s: is train.py running"):
        join_run(storage, RunSettings(), timeout_s=0)


def test_a_second_trainer_is_refused_and_an_expired_lease_is_taken_over(storage):
    Lease(storage, timeout_s=5).write()  # a live owner elsewhere, just now
    owner = json.loads(storage.get("owner.json"))
    with pytest.raises(SystemExit, match=f"owned by trainer {owner['owner']} .*heartbeat [0-9]s ago"):
        Lease(storage, timeout_s=5).acquire()
    storage.put("owner.json", json.dumps(owner | {"host": "elsewhere", "heartbeat": time.time() - 10}))
    lease = Lease(storage, timeout_s=5)
    assert lease.acquire()["owner"] == owner["owner"]  # taken over: the old owner is returned
    assert json.loads(storage.get("owner.json"))["owner"] == lease.info["owner"]
    lease.release()


def test_a_dead_trainer_on_this_host_is_taken_over_at_once(storage):
    Lease(storage, timeout_s=600).write(pid=2**22 + 12345)  # beyond pid_max: no such process
    assert Lease(storage, timeout_s=600).acquire() is not None


def test_metrics_are_written_in_segments_and_the_last_record_of_a_step_stands(storage):
    m = Metrics(storage, "train", segment=2)
    for step, t in [(1, 1.0), (2, 2.0), (3, 3.0), (2, 4.0)]:  # step 2 redone after a crash
        m.log({"step": step, "time": t}, f"step {step}")
    assert len(storage.list("metrics")) == 2
    assert {s: r["time"] for s, r in latest_per_step(read_records(storage, "train")).items()} == {1: 1.0, 2: 4.0, 3: 3.0}


def test_presets_give_both_scripts_the_same_run_settings_and_flags_still_win():
    from generate import GenerateConfig
    from train import TrainConfig
    run_t, cfg = parse_config(RunSettings, TrainConfig, argv=["--preset", "qwen-math-1.5b", "--lr", "1e-5"])
    run_g, gen = parse_config(RunSettings, GenerateConfig, argv=["--preset", "qwen-math-1.5b", "--engine", "vllm"])
    assert run_t == run_g and (run_t.lora_r, run_t.lora_alpha, run_t.group_size, run_t.max_new_tokens) == (1, 2, 8, 3000)
    assert (cfg.lr, cfg.loss_type, cfg.tis_cap, cfg.sync_every, cfg.groups_per_step * run_t.group_size) == (1e-5, "dr_grpo", 2.0, 4, 128)
    assert gen.engine == "vllm" and parse_config(RunSettings, TrainConfig, argv=["--preset", "r1-distill-1.5b"])[0].reasoning
    with pytest.raises(SystemExit, match="preset"):
        parse_config(RunSettings, TrainConfig, argv=["--preset", "nope"])


def test_a_group_whose_name_has_no_sequence_number_is_read_like_any_other(tmp_path):
    storage = Storage(str(tmp_path / "run"))
    buffer, ledger = RolloutBuffer(storage), Ledger()
    for name in ("copied-by-hand", "g-\u00b2"):  # no number at all, and a digit int() cannot read
        storage.put(group_key(name), save(*to_tensors(make_group())))
    good, = buffer.write([make_group()], "g", seq=1)
    assert [g.group_id for g in buffer.take(5, ledger)] == ["copied-by-hand", "g-\u00b2", good]


def test_a_ledger_in_the_older_range_format_is_refused_not_misread():
    with pytest.raises(SystemExit, match="older minigrpo"):
        Ledger({"collect": {"g": [[0, 3]]}, "consumed": {}})
    assert Ledger({"collect": None, "consumed": {}}).skip == set()  # nothing recorded, in either format


def test_a_lease_is_free_at_once_only_when_its_owner_died_on_this_host():
    from minigrpo.run import dead_here
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no process holds now
    here = socket.gethostname()
    assert dead_here({"host": here, "pid": gone.pid})
    assert not dead_here({"host": here, "pid": os.getpid()}) and not dead_here({"host": "elsewhere", "pid": gone.pid})
    assert not any(dead_here({"host": here, "pid": bad}) for bad in ("x", None, 10**30, [1]))
