"""--report_to trackio | wandb, for real and offline: the demo trainer and a generator report to trackio's local
database and to wandb's offline run files, the trainer is killed after a step's record and before the checkpoint
that covers it, and what the tracker holds is read back from its own storage: every step once, the first life's
values, the run's config, one tracker run for both lives.

    pip install -r requirements-trackers.txt && python -m pytest -q tests/test_trackers.py
"""
import glob
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, gen_records

from minigrpo.run import Metrics, read_records, tracker
from minigrpo.storage import Storage

STEPS = 4
TRAIN = ["train.py", "--max_steps", str(STEPS), "--save_every", "2", "--eval_every", "100", "--eval_size", "8",
         "--groups_per_step", "2", "--lease_timeout_s", "5", "--tracker_project", "trk"]  # no checkpoint before step 2


def py(args, env, log):
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=open(log, "a"), stderr=subprocess.STDOUT)


def first_records(run_dir: str) -> dict[int, dict]:
    """Each step's record from the first life that wrote one: what the tracker got (later lives do not send it)."""
    first = {}
    for r in read_records(Storage(run_dir), "train"):
        first.setdefault(r["step"], r)
    return first


def numbers(record: dict) -> dict:
    return {k: v for k, v in record.items() if type(v) in (int, float) and k not in ("step", "time")}


def crash_and_resume(tmp_path, report_to, env, fault, kill_when=None):
    """The demo trainer beside one generator, both with --report_to. The first trainer life meets `fault`; a pausing
    one is SIGKILLed once kill_when(run_dir) holds. The same command then finishes the run."""
    run_dir, log = str(tmp_path / "run"), str(tmp_path / "log")
    env, flags = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", **env), ["--report_to", report_to]
    gen = py(["generate.py", "--run_dir", run_dir, "--generator_id", "g0", "--max_ready", "4", "--prompts_per_batch",
              "2", "--tracker_project", "trk", *flags], env, log)
    try:
        first = py([*TRAIN, "--run_dir", run_dir, *flags], env | {"MINIGRPO_FAULT": fault}, log)
        deadline = time.time() + 300  # the machine may be shared
        while kill_when and not ("MINIGRPO_FAULT: pausing" in open(log).read() and kill_when(run_dir)):
            assert time.time() < deadline and first.poll() is None, open(log).read()[-3000:]
            time.sleep(0.2)
        if kill_when:
            first.send_signal(signal.SIGKILL)
        assert first.wait(timeout=300) in (137, -9), open(log).read()[-3000:]
        assert "MINIGRPO_FAULT" in open(log).read()
        second = py([*TRAIN, "--run_dir", run_dir, *flags], env, log)
        assert second.wait(timeout=300) == 0, open(log).read()[-3000:]
        assert gen.wait(timeout=120) == 0, open(log).read()[-3000:]
    finally:
        gen.kill()
    records = read_records(Storage(run_dir), "train")
    assert sorted(r["step"] for r in records if r["step"] <= 2).count(2) == 2, "step 2 was redone by the second life"
    return run_dir, json.load(open(os.path.join(run_dir, "run.json")))["run_id"]


def test_trackio_holds_every_step_once_with_the_first_lifes_values_across_a_crash(tmp_path, monkeypatch):
    trackio_dir = str(tmp_path / "trackio")
    run_dir, run_id = crash_and_resume(tmp_path, "trackio", {"TRACKIO_DIR": trackio_dir},
                                       "after_metrics:2")  # exits like SIGKILL right after step 2's record
    monkeypatch.setenv("TRACKIO_DIR", trackio_dir)
    import trackio.sqlite_storage as sqlite_storage
    monkeypatch.setattr(sqlite_storage, "TRACKIO_DIR", Path(trackio_dir))  # read at import: set it for this read
    db = sqlite_storage.SQLiteStorage
    name = f"{run_id}-train"
    assert sorted(db.get_runs("trk")) == sorted([name, f"{run_id}-generate-g0"])
    assert [r["name"] for r in db.get_run_records("trk")].count(name) == 1, "both lives wrote into one run"
    logs, first = db.get_logs("trk", name), first_records(run_dir)
    assert [row["step"] for row in logs] == list(range(STEPS + 1))
    for row in logs:
        assert {k: row[k] for k in numbers(first[row["step"]])} == numbers(first[row["step"]])
        assert "group_ids" not in row and "__step" not in row
    config = db.get_run_config("trk", name)
    assert config["lr"] == 3e-3 and config["lora_r"] == 8 and config["max_steps"] == STEPS
    gen = db.get_logs("trk", f"{run_id}-generate-g0")
    assert [row["step"] for row in gen] == list(range(len(gen_records(run_dir, "g0"))))
    assert [row["reward/mean"] for row in gen] == [r["reward/mean"] for r in gen_records(run_dir, "g0")]


def wandb_records(path: str):
    """The protobuf records of a .wandb file. wandb 0.31 ships no reader in Python (its Go core writes the file), so
    this reads the format: LevelDB's log (32 KiB blocks of chunks, each after a 7-byte header: crc32c, length, type
    1 full | 2 first | 3 middle | 4 last), after a 7-byte file header ':W&B', magic 0xBEE1, version 0."""
    from wandb.proto import wandb_internal_pb2 as pb
    data, pos, chunks = open(path, "rb").read(), 7, b""
    assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + n > len(data):  # still being written
            break
        chunks, pos = chunks + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunks)
            yield record
            chunks = b""


def wandb_history(wandb_dir: str, run: str) -> tuple[list[str], list[dict], dict]:
    """(the run ids in each offline run file of `run`, oldest first; every history row; the config)."""
    ids, rows, config = [], [], {}
    for path in sorted(glob.glob(f"{wandb_dir}/wandb/offline-run-*-{run}*/run-{run}.wandb")):
        for r in wandb_records(path):
            if r.HasField("run"):
                ids.append(r.run.run_id)
                config |= {i.key: json.loads(i.value_json) for i in r.run.config.update}
            elif r.HasField("config"):
                config |= {i.key: json.loads(i.value_json) for i in r.config.update}
            elif r.HasField("history"):
                rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
    return ids, rows, config


def test_wandb_offline_holds_every_step_once_with_the_first_lifes_values_across_a_crash(tmp_path):
    wandb_dir = str(tmp_path / "wandb")
    os.makedirs(wandb_dir)

    def holds_step_2(run_dir):
        run_id = json.load(open(os.path.join(run_dir, "run.json")))["run_id"]
        return any(row.get("_step") == 2 for row in wandb_history(wandb_dir, f"{run_id}-train")[1])

    # wandb's own process writes the offline file every few seconds: pause after step 2's record (before the
    # checkpoint that covers it), wait until wandb has written step 2, then SIGKILL
    run_dir, run_id = crash_and_resume(
        tmp_path, "wandb", {"WANDB_MODE": "offline", "WANDB_DIR": wandb_dir, "WANDB_SILENT": "true",
                   "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL": "0.5"}, "after_metrics:2:pause", holds_step_2)
    ids, rows, config = wandb_history(wandb_dir, f"{run_id}-train")
    assert ids == [f"{run_id}-train"] * 2, "each life wrote a file of the same run"
    first = first_records(run_dir)
    assert [row["_step"] for row in rows] == list(range(STEPS + 1))
    for row in rows:
        assert {k: row[k] for k in numbers(first[row["_step"]])} == numbers(first[row["_step"]])
        assert "group_ids" not in row and "step" not in row
    assert config["lr"] == 3e-3 and config["lora_r"] == 8 and config["max_steps"] == STEPS
    _, gen_rows, gen_config = wandb_history(wandb_dir, f"{run_id}-generate-g0")
    assert [row["reward/mean"] for row in gen_rows] == [r["reward/mean"] for r in gen_records(run_dir, "g0")]
    assert gen_config["api_key"] == "" and gen_config["generator_id"] == "g0"


def test_a_generators_tracker_steps_go_on_across_its_lives_and_a_trainers_skip_what_earlier_lives_recorded(tmp_path):
    storage, sent = Storage(str(tmp_path / "run")), []
    fake = (lambda numbers, step: sent.append((step, numbers)), lambda: None)  # the numbering rule only
    first = Metrics(storage, "train-e000001", fake, "train")
    first.log({"step": 0, "x": 0.5, "group_ids": ["a"]}, "")
    first.log({"step": 1, "x": 1.5}, "")
    second = Metrics(storage, "train-e000002", fake, "train")
    for step in (1, 2):  # step 1 redone after a crash
        second.log({"step": step, "x": 9.0, "time": 1.0}, "")
    for _ in range(2):  # two lives
        gen = Metrics(storage, "generate-g0", fake)
        for batch in (1, 2):
            gen.log({"batch": batch, "generator": "g0"}, "")
    assert sent == [(0, {"x": 0.5}), (1, {"x": 1.5}), (2, {"x": 9.0}),
                    (0, {"batch": 1}), (1, {"batch": 2}), (2, {"batch": 1}), (3, {"batch": 2})]


@pytest.mark.parametrize("name", ["trackio", "wandb"])
def test_a_missing_tracker_is_one_clear_line(monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # what an environment without it gives: ImportError
    with pytest.raises(SystemExit, match=f"^--report_to {name}: not installed; pip install -r requirements-trackers"):
        tracker(name, "p", "r", {})
    assert tracker("none", "p", "r", {}) is None
