"""What crosses between processes: rollout files, the buffer's ready/claimed/bad life cycle, adapter versions,
checkpoints and run.json. Each wire format is round-tripped.

    python -m pytest -q tests/test_rundir.py
"""
import json
import os

import pytest
import torch
from conftest import tiny_model

from minigrpo.adapters import AdapterStore, adapter_name
from minigrpo.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from minigrpo.lora import DEFAULT_TARGETS, adapter_config, inject_lora, lora_layers, lora_state_dict
from minigrpo.rollouts import Group, RolloutBuffer, read_group, validator
from minigrpo.run import RunSettings, join_run


def make_group(version=3, G=4, temperature=1.0):
    return Group(prompt_ids=[5, 6, 7], completion_ids=[[1], [2, 3], [4, 5, 1], [9, 9]][:G],
                 behavior_logprobs=[[-0.5], [-0.125, -0.25], [-1.0, -0.375, -0.0625], [-2.0, -0.75]][:G],
                 rewards=[1.0, 0.0, 0.5, 0.0][:G], truncated=[False, True, False, True][:G],
                 policy_version=version, temperature=temperature, started_at=1.5, finished_at=2.5)


def test_group_round_trips_through_a_file(tmp_path):
    buffer = RolloutBuffer(str(tmp_path))
    group = make_group()
    gid = buffer.write(group, "gen-a", seq=0)
    back = read_group(os.path.join(buffer.ready, gid + ".safetensors"))
    assert back == group and back.group_id == gid and back.generator_id == "gen-a"


def test_take_is_fifo_and_moves_files_to_claimed(tmp_path):
    buffer = RolloutBuffer(str(tmp_path))
    ids = [buffer.write(make_group(version=v), "g", seq=v) for v in range(5)]
    taken = buffer.take(3)
    assert [g.group_id for g in taken] == ids[:3]
    assert buffer.count_ready() == 2 and len(os.listdir(buffer.claimed)) == 3


def test_claimed_groups_return_on_resume_and_vanish_after_a_checkpoint(tmp_path):
    buffer = RolloutBuffer(str(tmp_path))
    for v in range(4):
        buffer.write(make_group(version=v), "g", seq=v)
    buffer.take(2)
    assert buffer.restore_claimed() == 2 and buffer.count_ready() == 4
    buffer.take(3)
    buffer.delete_claimed()
    assert os.listdir(buffer.claimed) == [] and buffer.count_ready() == 1


def test_no_partial_file_is_visible_and_temp_files_are_ignored(tmp_path):
    buffer = RolloutBuffer(str(tmp_path))
    with open(os.path.join(buffer.ready, ".half-written.tmp"), "wb") as f:
        f.write(b"\x00" * 10)
    assert buffer.count_ready() == 0 and buffer.take(5) == []


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong_shapes", "missing_field"])
def test_unreadable_or_invalid_files_are_quarantined_with_a_reason(tmp_path, damage):
    buffer = RolloutBuffer(str(tmp_path))
    good = buffer.write(make_group(), "g", seq=0)
    path = os.path.join(buffer.ready, "00000000000000000001-bad-000000.safetensors")
    if damage == "garbage":
        open(path, "wb").write(b"not a safetensors file at all")
    elif damage == "truncated":
        data = open(os.path.join(buffer.ready, good + ".safetensors"), "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    else:
        from safetensors.torch import save_file
        from minigrpo.rollouts import to_tensors
        tensors, meta = to_tensors(make_group())
        if damage == "wrong_shapes":
            tensors["rewards"] = torch.zeros(7)
        else:
            del tensors["behavior_logprobs"]
        save_file(tensors, path, metadata=meta)
    taken = buffer.take(5)
    assert [g.group_id for g in taken] == [good]
    assert buffer.count_bad() == 1
    reason = open(os.path.join(buffer.bad, os.path.basename(path) + ".reason.txt")).read()
    assert reason.strip()


def test_validator_rejects_future_versions_other_temperatures_and_group_sizes(tmp_path):
    check = validator(vocab_size=16, temperature=1.0, G=4, version_now=lambda: 3)
    check(make_group(version=3))
    for bad, match in [(make_group(version=4), "future"), (make_group(temperature=0.7), "temperature"),
                       (make_group(G=2), "group_size")]:
        with pytest.raises(ValueError, match=match):
            check(bad)
    with pytest.raises(ValueError, match="token ids"):
        validator(vocab_size=8, temperature=1.0, G=4, version_now=lambda: 3)(make_group())


def publish_model(store, version, r=2):
    model = tiny_model()
    inject_lora(model, r=r, alpha=4)
    return store.publish(version, lora_state_dict(model), adapter_config(r, 4, DEFAULT_TARGETS, "tiny"), keep=3)


def test_publish_writes_a_peft_dir_and_points_latest_at_it(tmp_path):
    store = AdapterStore(str(tmp_path))
    assert store.latest() is None and store.next_version() == 0
    path = publish_model(store, 0)
    assert store.latest() == (0, path) and os.path.isabs(path)
    assert sorted(os.listdir(path)) == ["adapter_config.json", "adapter_model.safetensors"]


def test_retention_keeps_the_window_plus_one_publish_of_grace(tmp_path):
    store = AdapterStore(str(tmp_path))
    for v in range(8):
        publish_model(store, v)
    assert store.versions() == [4, 5, 6, 7]  # keep=3: v5..v7 are named, v4 left the window one publish ago


def test_names_are_never_reused_after_a_crash(tmp_path):
    store = AdapterStore(str(tmp_path))
    for v in range(3):
        publish_model(store, v)
    os.makedirs(os.path.join(store.root, f".{adapter_name(3)}.abcd1234.tmp"))  # a publish killed half-way
    os.makedirs(os.path.join(store.root, adapter_name(3)))  # renamed, but LATEST not yet replaced
    assert store.latest()[0] == 2
    assert store.next_version() == 4
    assert not any(n.endswith(".tmp") for n in os.listdir(store.root))


def test_checkpoint_restores_adapter_optimizer_and_state(tmp_path):
    model = tiny_model()
    inject_lora(model, r=2, alpha=4)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.1)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    save_checkpoint(str(tmp_path), 7, lora_state_dict(model), adapter_config(2, 4, DEFAULT_TARGETS, "tiny"), opt,
                    {"stats": {"dropped_stale_total": 3}})
    other = tiny_model()
    inject_lora(other, r=2, alpha=4)
    opt2 = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=0.1)
    state = load_checkpoint(latest_checkpoint(str(tmp_path)), other, opt2)
    assert state["step"] == 7 and state["stats"]["dropped_stale_total"] == 3
    for a, b in zip(lora_layers(model).values(), lora_layers(other).values()):
        assert torch.equal(a.lora_B, b.lora_B)
    assert opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


def test_join_run_writes_once_and_names_the_field_that_differs(tmp_path):
    run = str(tmp_path / "run")
    first = join_run(run, RunSettings())
    assert join_run(run, RunSettings())["run_id"] == first["run_id"]
    with pytest.raises(SystemExit, match="temperature"):
        join_run(run, RunSettings(temperature=0.7))
    with pytest.raises(SystemExit, match="group_size"):
        join_run(run, RunSettings(group_size=4))
    assert json.load(open(os.path.join(run, "run.json")))["temperature"] == 1.0


def test_presets_give_both_scripts_the_same_run_settings_and_flags_still_win():
    from minigrpo.run import parse_config
    from generate import GenerateConfig
    from train import TrainConfig
    run_t, cfg = parse_config(RunSettings, TrainConfig, argv=["--preset", "qwen-math-1.5b", "--lr", "1e-5"])
    run_g, gen = parse_config(RunSettings, GenerateConfig, argv=["--preset", "qwen-math-1.5b", "--engine", "vllm"])
    assert run_t == run_g and (run_t.lora_r, run_t.lora_alpha, run_t.group_size, run_t.max_new_tokens) == (1, 2, 8, 3000)
    assert (cfg.lr, cfg.loss_type, cfg.tis_cap, cfg.sync_every, cfg.groups_per_step * run_t.group_size) == (1e-5, "dr_grpo", 2.0, 4, 128)
    assert gen.engine == "vllm" and parse_config(RunSettings, TrainConfig, argv=["--preset", "r1-distill-1.5b"])[0].reasoning
    with pytest.raises(SystemExit, match="preset"):
        parse_config(RunSettings, TrainConfig, argv=["--preset", "nope"])


def test_many_processes_can_join_a_run_at_once(tmp_path):
    import threading
    run, errors = str(tmp_path / "run"), []

    def join():
        try:
            for _ in range(50):
                join_run(run, RunSettings())
        except SystemExit as e:  # e.g. a probe file another joiner removed first
            errors.append(str(e))
    threads = [threading.Thread(target=join) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
