"""The run directory in-process: storage on a local disk, in memory and on S3, rollout groups and the trainer's
ledger, quarantine of hostile files, adapter versions and checkpoints (run.json, the lease and metrics: test_run.py).

    python -m pytest -q tests/test_rundir.py
"""
import io
import json
import os

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import save

from minigrpo.adapters import AdapterStore
from minigrpo.checkpoint import load_checkpoint, prune_checkpoints, save_checkpoint
from minigrpo.lora import DEFAULT_TARGETS, adapter_config, adapter_digest, inject_lora, lora_layers, lora_state_dict
from minigrpo.rollouts import (AttributionError, Group, Ledger, RolloutBuffer, check_group, group_key, read_groups,
                               to_tensors)
from minigrpo.storage import Storage

RUN = {"group_size": 4, "temperature": 1.0, "max_prompt_len": 8, "max_new_tokens": 3, "run_id": "r1"}


def make_group(version=3, G=4, temperature=1.0, **kw):
    return Group(**{"prompt_ids": [5, 6, 7], "completion_ids": [[1], [2, 3], [4, 5, 1], [9, 9]][:G],
                    "behavior_logprobs": [[-0.5], [-0.125, -0.25], [-1.0, -0.375, -0.0625], [-2.0, -0.75]][:G],
                    "rewards": [1.0, 0.0, 0.5, 0.0][:G], "truncated": [False, True, False, True][:G],
                    "policy_version": version, "temperature": temperature, "started_at": 1.5, "finished_at": 2.5,
                    "run_id": "r1", **kw})


# ---- storage ----
def test_storage_puts_gets_lists_and_deletes_whole_objects(storage):
    storage.put("a/x.bin", b"\x00\x01")
    storage.put("a/b/y.txt", "text")
    assert storage.get("a/x.bin") == b"\x00\x01" and storage.list("a") == ["b", "x.bin"]
    assert storage.list("nothing/here") == [] and storage.exists("a/b/y.txt")
    storage.put_many({"a/w-000001": b"1", "a/w-000002": b"2", "a/v-000003": b"3"})  # concurrently on a bucket
    assert storage.list("a") == ["b", "v-000003", "w-000001", "w-000002", "x.bin"]
    storage.delete(["a/w-000001", "a/w-000002", "a/v-000003"])
    storage.delete("a/b", recursive=True)
    storage.delete("a/gone.bin")  # deleting what is gone is fine
    assert storage.list("a") == ["x.bin"]
    with pytest.raises(FileNotFoundError):
        storage.get("a/gone.bin")
    storage.put("a/z.bin", b"z")
    got = storage.get_many(["a/x.bin", "a/gone.bin", "a/z.bin"])  # concurrently on a bucket
    assert got[0] == b"\x00\x01" and isinstance(got[1], FileNotFoundError) and got[2] == b"z"


def test_a_killed_writers_temp_file_is_invisible_and_never_read(tmp_path):
    storage, buffer = Storage(str(tmp_path)), RolloutBuffer(Storage(str(tmp_path)))
    good, = buffer.write([make_group()], "g", seq=0)
    (tmp_path / "rollouts" / ".1234abcd5678.tmp").write_bytes(b"half")  # what a SIGKILL inside put() leaves
    assert storage.list("rollouts") == ["g-000000.safetensors"] and good == "g-000000.0"
    assert [g.group_id for g in buffer.take(5, Ledger())] == [good] and not storage.list("bad")


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
    back, = read_groups(storage.get(group_key("gen-a-1f2e-000000")), "gen-a-1f2e-000000")
    assert gid == back.group_id == "gen-a-1f2e-000000.0" and back == group and back.generator_id == "gen-a-1f2e"


def test_take_is_fifo_records_each_group_in_the_ledger_and_never_moves_a_file(storage):
    buffer, ledger = RolloutBuffer(storage), Ledger()
    ids = buffer.write([make_group(version=v) for v in range(5)], "g", seq=0)  # one object: one request on a bucket
    assert [g.group_id for g in buffer.take(3, ledger)] == ids[:3] and "g-000000" not in ledger.taken  # 2 left in it
    assert [g.group_id for g in buffer.take(5, ledger)] == ids[3:]
    assert ledger.taken == {*ids, "g-000000"} and buffer.listed() == ["g-000000"] and buffer.take(5, ledger) == []


def test_a_resumed_trainer_takes_the_rest_of_a_partly_consumed_object_and_collects_only_whole_ones(storage):
    buffer, ledger = RolloutBuffer(storage), Ledger()
    ids = buffer.write([make_group(version=v) for v in range(5)], "g", seq=0)
    later = buffer.write([make_group()], "g", seq=1)
    assert [g.group_id for g in buffer.take(3, ledger)] == ids[:3]
    saved = json.loads(json.dumps(ledger.state()))  # a checkpoint, then a crash with ids[3:] read but not taken
    resumed, buffer = Ledger(saved), RolloutBuffer(storage)
    assert [g.group_id for g in buffer.take(8, resumed)] == ids[3:] + later  # each group once, across the two lives
    resumed.advance()
    buffer.collect(resumed.collect)  # what the first life consumed: groups of an object not yet whole, nothing to delete
    assert buffer.listed() == ["g-000000", "g-000001"]
    buffer.collect(resumed.consumed)  # both objects, whole now
    assert buffer.listed() == []


def test_the_ledger_deletes_only_what_two_checkpoints_cover():
    ledger = Ledger()
    ledger.taken.add("g-000000")
    first = ledger.state()  # checkpoint 1: nothing to collect yet
    ledger.advance()
    ledger.taken.add("g-000001")
    second = ledger.state()  # checkpoint 2: collect what checkpoint 1 consumed
    ledger.advance()
    assert first == {"collect": [], "consumed": ["g-000000"]} and ledger.collect == {"g-000000"}
    assert second == {"collect": ["g-000000"], "consumed": ["g-000001"]}
    resumed = Ledger(json.loads(json.dumps(second)))  # as a checkpoint's trainer_state.json gives it back
    assert resumed.collect == {"g-000000"} and resumed.skip == {"g-000000", "g-000001"}


def hostile(storage, tmp_path, kind, monkeypatch):
    """Write one hostile rollout entry of the given kind; returns its group id."""
    gid = {"long_name": "evil-" + "x" * 230 + "-000000", "non_utf8_name": "evil-\udcff-000000"}.get(
        kind, f"evil-{kind.replace('_', '')}-000000")
    tensors, meta = to_tensors([make_group(group_id=f"{gid}.0")])
    path = None if not storage.local else os.path.join(storage.root, group_key(gid))
    if kind == "directory":
        os.makedirs(os.path.join(path, "inside"))
        return gid
    if kind == "unreadable":  # as root, mode 000 reads anyway: the kernel's answer to another user, then
        real_open = os.open
        monkeypatch.setattr(os, "open", lambda p, *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied"))
                            if p == path else real_open(p, *a))
    if kind == "copy":
        group = make_group()
        group.group_id = "g-000099.0"
        tensors, meta = to_tensors([group])
    if kind in ("symlink", "fifo"):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        (tmp_path / "outside").write_bytes(save(tensors, metadata=meta))
        os.symlink(tmp_path / "outside", path) if kind == "symlink" else os.mkfifo(path)
        return gid
    if kind in ("garbage", "long_name", "non_utf8_name"):
        data = b"not a safetensors file at all"
    elif kind == "truncated":
        data = save(tensors, metadata=meta)[:100]
    else:
        if kind == "float_lens":
            tensors["0.completion_lens"] = tensors["0.completion_lens"].float()
        elif kind == "float_ids":
            tensors["0.completion_ids"] = tensors["0.completion_ids"].float()
        elif kind == "wrong_shapes":
            tensors["0.rewards"] = torch.zeros(7)
        elif kind == "nan_logprobs":
            tensors["0.behavior_logprobs"][0, 0] = float("nan")
        elif kind == "missing_field":
            del tensors["0.behavior_logprobs"]
        elif kind == "long_completion":
            tensors["0.completion_ids"] = torch.ones(4, 4096, dtype=torch.long)
            tensors["0.behavior_logprobs"] = -torch.ones(4, 4096)
            tensors["0.completion_lens"] = torch.full((4,), 4096)
            tensors["0.loss_mask"] = torch.ones(4, 4096, dtype=torch.int8)
        elif kind == "mask_of_two":
            tensors["0.loss_mask"][0, 0] = 2
        elif kind == "short_mask":  # one column short of the completions'
            tensors["0.loss_mask"] = tensors["0.loss_mask"][:, :-1].contiguous()
        elif kind == "long_prompt":
            tensors["0.prompt_ids"] = torch.ones(20_000, dtype=torch.long)
        data = save(tensors, metadata=meta)
    storage.put(group_key(gid), data)
    return gid


REASONS = {"garbage": "SafetensorError", "truncated": "SafetensorError",
           "float_lens": "completion_lens has dtype torch.float32", "float_ids": "completion_ids has dtype torch.float32",
           "wrong_shapes": "inconsistent shapes", "nan_logprobs": "behavior_logprobs must be finite",
           "missing_field": "missing tensors ['behavior_logprobs']",
           "long_completion": "completion_ids: 4096 tokens, the run's max_new_tokens is 3",
           "long_prompt": "prompt_ids: 20000 tokens, the run allows 1 to 8",
           "mask_of_two": "loss_mask holds [2]: only 0 and 1 are allowed", "short_mask": "inconsistent shapes",
           "symlink": "is not a regular file", "fifo": "is not a regular file", "directory": "is not a regular file",
           "long_name": "SafetensorError", "non_utf8_name": "SafetensorError", "unreadable": "Permission denied",
           "copy": "group_id: this group was written as 'g-000099.0', found as 'evil-copy-000000.0' (a copy)"}
WHOLE = set(REASONS) - {"long_completion", "long_prompt"}  # the object, unreadable; else one group fails the run's bounds


@pytest.mark.parametrize("kind", list(REASONS))
def test_a_hostile_group_is_quarantined_with_a_reason_that_names_it_and_the_trainer_goes_on(tmp_path, kind, monkeypatch):
    storage = Storage(str(tmp_path / "run"))
    buffer, ledger, stats = RolloutBuffer(storage, "r1"), Ledger(), {}
    bad = hostile(storage, tmp_path, kind, monkeypatch)
    good, = buffer.write([make_group()], "g", seq=1)
    check = lambda g: check_group(g, RUN, vocab_size=16, version=3)  # noqa: E731
    assert [g.group_id for g in buffer.take(5, ledger, check, stats)] == [good]
    reason, = [storage.get(f"bad/{n}").decode() for n in storage.list("bad") if n.endswith(".reason.txt")]
    assert REASONS[kind] in reason and repr(bad if kind in WHOLE else f"{bad}.0") in reason, reason
    kept = [] if kind in WHOLE else [f"{bad}.safetensors"]  # a bad group's object stays until garbage collection
    assert stats["bad_total"] == 1 and storage.list("rollouts") == kept + ["g-000001.safetensors"]
    assert kind in WHOLE or bad in ledger.taken  # the ledger holds it: a resumed trainer skips it
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
    weights = lambda: [v for v in store.versions() if storage.exists(f"adapters/{store.name(v)}/adapter_model.safetensors")]
    for v in range(7):
        publish_model(store, v)
    assert weights() == ([3, 4, 5, 6] if storage.local else list(range(7)))  # a bucket deletes four versions' at once
    publish_model(store, 7)
    assert weights() == [4, 5, 6, 7]  # keep=3: v5..v7 are named, v4 left the window one publish ago
    assert store.versions() == list(range(8))  # the configs stay: a name, once claimed, is never written again


def test_names_are_never_reused_after_a_crash_even_if_a_listing_lags(storage, monkeypatch):
    store = AdapterStore(storage, "r")
    for v in range(3):
        publish_model(store, v)
    assert store.write(3, {}, {}) == 3  # killed before LATEST: version 3 exists but is not named
    assert store.latest() == 2 and store.next_version() == 4
    monkeypatch.setattr(store, "versions", lambda: [0, 1])  # a listing that has not seen v3 yet
    assert store.next_version() == 3 and store.write(3, {}, {}) == 4  # the name is claimed: the next one is used
    assert store.write(0, {}, {}) == 5 and store.next_version(at_least=9) == 9  # and so is v0's, whose weights went


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


STATE = {"stats": {"dropped_stale_total": 3}, "version": 7, "config": {}, "ledger": {"collect": [], "consumed": ["g-0"]}}


def test_checkpoint_restores_adapter_optimizer_and_state(storage):
    model, opt = trained_model_and_optimizer()
    name = save_checkpoint(storage, 7, 2, lora_state_dict(model), adapter_config(2, 4, DEFAULT_TARGETS, "tiny"), opt, STATE)
    other, opt2 = fresh_model_and_optimizer()
    state, skipped = load_checkpoint(storage, other, opt2, [name])
    assert name == "step-000007-e000002" and state["step"] == 7 and state["stats"]["dropped_stale_total"] == 3
    assert skipped == [] and state["name"] == name
    for a, b in zip(lora_layers(model).values(), lora_layers(other).values()):
        assert torch.equal(a.lora_B, b.lora_B)
    assert opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


def test_a_damaged_or_incomplete_newest_checkpoint_falls_back_to_the_one_before(storage):
    model, opt = trained_model_and_optimizer()
    config = adapter_config(2, 4, DEFAULT_TARGETS, "tiny")
    names = [save_checkpoint(storage, step, 1, lora_state_dict(model), config, opt, STATE) for step in (5, 10, 15)]
    storage.put("checkpoints/step-000004-e000009/MANIFEST", "{}")  # what another life left, older
    storage.put("checkpoints/step-000012-e000009/MANIFEST", "{}")  # newer: a deposed life's, never named
    prune_checkpoints(storage, names[1:])
    assert storage.list("checkpoints") == ["step-000010-e000001", "step-000012-e000009", "step-000015-e000001"]
    storage.delete("checkpoints/step-000012-e000009", recursive=True)
    assert storage.list("checkpoints") == ["step-000010-e000001", "step-000015-e000001"]
    blob = storage.get("checkpoints/step-000015-e000001/optimizer.pt")
    storage.put("checkpoints/step-000015-e000001/optimizer.pt", blob[: len(blob) // 2])  # cut in half
    storage.put("checkpoints/step-000020-e000001/trainer_state.json", "{}")  # a checkpoint killed before its MANIFEST
    state, skipped = load_checkpoint(storage, *fresh_model_and_optimizer())  # no lease: every checkpoint there is
    assert state["step"] == 10
    assert skipped == ["step-000020-e000001: incomplete (no MANIFEST)",
                       "step-000015-e000001: damaged (ValueError: optimizer.pt do not match the MANIFEST)"]


def test_conditional_writes_refuse_a_writer_that_came_second(storage):
    token = storage.swap("adapters/LATEST", "a", None)
    with pytest.raises(FileExistsError):
        storage.swap("adapters/LATEST", "b", None)  # create-only, and it exists
    assert storage.versioned("adapters/LATEST") == (b"a", token)
    storage.swap("adapters/LATEST", "c", token)
    with pytest.raises(FileExistsError):
        storage.swap("adapters/LATEST", "d", token)  # that token is stale now
    storage.put("x/claim", "1", create=True)
    with pytest.raises(FileExistsError):
        storage.put("x/claim", "2", create=True)
    assert storage.get("adapters/LATEST") == b"c" and storage.get("x/claim") == b"1"


def test_a_group_whose_name_has_no_sequence_number_is_read_like_any_other(tmp_path):
    storage = Storage(str(tmp_path / "run"))
    buffer, ledger = RolloutBuffer(storage), Ledger()
    for name in ("copied-by-hand", "g-\u00b2"):  # no number at all, and a digit int() cannot read
        storage.put(group_key(name), save(*to_tensors([make_group(group_id=f"{name}.0")])))
    good, = buffer.write([make_group()], "g", seq=1)
    assert [g.group_id for g in buffer.take(5, ledger)] == ["copied-by-hand.0", "g-\u00b2.0", good]


def test_a_hostile_trainer_state_falls_back_to_the_checkpoint_before(tmp_path):
    storage = Storage(str(tmp_path / "run"))
    model, opt = trained_model_and_optimizer()
    config = adapter_config(2, 4, DEFAULT_TARGETS, "tiny")
    names = [save_checkpoint(storage, step, 1, lora_state_dict(model), config, opt, state) for step, state in
             [(5, STATE), (10, STATE | {"ledger": {"collect": [{"a": 1}]}}), (15, {"version": "7", "stats": []})]]
    state, skipped = load_checkpoint(storage, *fresh_model_and_optimizer(), names)  # each with a matching MANIFEST
    assert state["step"] == 5 and skipped == [
        "step-000015-e000001: damaged (ValueError: trainer_state.json: ['version', 'stats', 'config', 'ledger'] "
        "missing or of another type)", "step-000010-e000001: damaged (TypeError: unhashable type: 'dict')"]


def test_a_checkpoint_saved_on_a_gpu_resumes_on_a_cpu(tmp_path, monkeypatch):
    storage = Storage(str(tmp_path / "run"))
    model, opt = trained_model_and_optimizer()
    monkeypatch.setattr(torch.serialization, "location_tag", lambda s: "cuda:0")  # what torch.save writes on a GPU
    name = save_checkpoint(storage, 5, 1, lora_state_dict(model), adapter_config(2, 4, DEFAULT_TARGETS, "tiny"), opt, STATE)
    monkeypatch.undo()
    blob = io.BytesIO(storage.get(f"checkpoints/{name}/optimizer.pt"))
    if not torch.cuda.is_available():  # where no GPU is, a plain load fails
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(blob, weights_only=True)
    other, opt2 = fresh_model_and_optimizer()
    state, skipped = load_checkpoint(storage, other, opt2, [name])
    assert state["step"] == 5 and skipped == []
    assert all(t.device.type == "cpu" for s in opt2.state_dict()["state"].values() for t in s.values())
