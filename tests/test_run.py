"""The run (minigrpo/run.py) in-process: run.json written once and joined, the trainer's lease and its fence, the
metrics segments, and the flags both scripts share.

    python -m pytest -q tests/test_run.py
"""
import json
import os
import socket
import subprocess
import time

import pytest

from minigrpo.run import Lease, Metrics, RunSettings, create_run, join_run, lease_view, parse_config, read_records
from minigrpo.tools.plot import latest_per_step


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


class Deposed(Exception):
    pass


def no_exit(lease):
    """In-process, a lease that is lost raises instead of ending the test run with os._exit."""
    lease.lost = lambda: (_ for _ in ()).throw(Deposed())
    return lease


@pytest.mark.parametrize("skew", [-3600, 0, 3600])
def test_a_live_lease_refuses_a_contender_whatever_the_clocks_say(storage, monkeypatch, skew):
    owner = no_exit(Lease(storage, timeout_s=0.6))
    monkeypatch.setattr(time, "time", lambda _t=time.time: _t() + skew)  # nothing may depend on the wall clock
    assert owner.acquire() is None and owner.info["epoch"] == 1
    with pytest.raises(SystemExit, match=f"owned by trainer {owner.info['owner']} .*epoch 1.*heartbeat moved"):
        Lease(storage, timeout_s=600).acquire()  # a contender with a long timeout still sees the beat move
    owner.release()
    assert not storage.exists("owner.json")


HOSTILE_LEASES = [json.dumps({"owner": "x", "host": "elsewhere", "pid": 1, "epoch": 4, "heartbeat": time.time() + 3600,
                              "timeout_s": float("inf")}), "not json {", "[1, 2]", '{"heartbeat": "soon", "epoch": "4"}',
                  json.dumps({"owner": "y", "host": "elsewhere", "epoch": 4, "heartbeat": time.time() - 3600})]


@pytest.mark.parametrize("raw", HOSTILE_LEASES, ids=["future", "garbage", "list", "strings", "past"])
def test_a_dead_lease_is_taken_over_after_the_timeout_on_this_processs_clock(storage, raw):
    storage.put("owner.json", raw)
    storage.put("metrics/train-e000002-x-0001-00000.jsonl", "{}\n")  # a life's epoch survives a garbage lease
    lease, t0 = no_exit(Lease(storage, timeout_s=0.5)), time.monotonic()
    lease.acquire()
    assert 0.5 <= time.monotonic() - t0 < 30  # after the timeout, not at once; a loaded machine (CI's 2 cores, two
    # pytest workers) took 6.8 s for what takes 0.6 s alone
    assert lease.info["epoch"] == (5 if '"epoch": 4' in raw else 3)
    assert json.loads(storage.get("owner.json"))["owner"] == lease.info["owner"]
    lease.stop.set()


def test_a_deposed_trainer_can_neither_write_behind_its_fence_nor_rewrite_the_lease(storage):
    old = no_exit(Lease(storage, timeout_s=0.3))
    old.acquire()
    old.stop.set()  # paused: it beats no more
    new = no_exit(Lease(storage, timeout_s=0.3))
    new.acquire()
    assert new.info["epoch"] == old.info["epoch"] + 1
    for deposed in (lambda: old.fenced(storage.put, "DONE", "x"), old.write):
        with pytest.raises(Deposed):
            deposed()
    assert not storage.exists("DONE") and json.loads(storage.get("owner.json"))["owner"] == new.info["owner"]
    new.fenced(storage.put, "DONE", "x")  # the owner writes
    new.stop.set()


def test_a_write_that_does_not_wait_is_made_by_the_heartbeats_thread_and_none_once_it_stopped(storage):
    """The trainer's progress (what waits, for the generators' backpressure) goes out without holding up its step."""
    lease = no_exit(Lease(storage, timeout_s=600))  # its own beat: every 100 s, so any write below is a woken one
    lease.acquire()
    lease.write(wait=False, step=7)
    deadline = time.monotonic() + 10
    while json.loads(storage.get("owner.json")).get("step") != 7:
        assert time.monotonic() < deadline, "the heartbeat's thread did not write it"
        time.sleep(0.01)
    lease.stop.set()
    lease.write(wait=False, step=8)  # stopped: the thread ends without writing
    lease.beat.join(timeout=10)
    assert not lease.beat.is_alive() and json.loads(storage.get("owner.json"))["step"] == 7


def test_a_take_that_waits_less_than_five_polls_writes_no_lease(tmp_path):
    """The trainer says what waits (for the generators' backpressure) once it has waited 5 polls for a step's groups,
    not at its first look: here the second look finds the rest, and nothing is written."""
    from types import SimpleNamespace

    from test_rundir import make_group
    from train import take_batch

    from minigrpo.rollouts import Ledger, RolloutBuffer
    from minigrpo.storage import Storage
    buffer, writes, looks = RolloutBuffer(Storage(str(tmp_path / "run")), "r1"), [], []
    buffer.storage.poll_s = 1.0  # 5 polls: 5 s, more than the two looks below take on any machine
    buffer.write([make_group(), make_group()], "w", seq=0)
    write_next = lambda group: looks.append(group) or len(looks) == 1 and buffer.write([make_group(), make_group()], "w", seq=1)
    lease = SimpleNamespace(timeout_s=60.0, write=lambda **progress: writes.append(progress))
    cfg = SimpleNamespace(groups_per_step=4, loss_type="grpo", wait_timeout_s=60.0)
    groups = take_batch(buffer, Ledger(), lease, cfg, RunSettings(), 3, write_next, lambda gs: [], {"dropped_stale_total": 0,
                        "dropped_zero_std_total": 0})[0]
    assert len(groups) == 4 and len(looks) == 4 and writes == []


def test_metrics_are_written_in_segments_and_the_newest_lifes_record_of_a_step_stands(storage, monkeypatch):
    monkeypatch.setattr(time, "time", lambda: 9e9)  # the first life's clock ran far ahead: it does not matter
    first = Metrics(storage, "train-e000001", segment=2)
    for step in (1, 2, 3):
        first.log({"step": step, "life": 1}, f"step {step}")
    first.flush()  # as train.py does before a checkpoint: a bucket writes at most one segment each 5 s (below)
    monkeypatch.undo()
    Metrics(storage, "train-e000002").log({"step": 2, "life": 2}, "step 2")  # resumed after step 1
    storage.put("metrics/train-e000002-junk.jsonl", '{"step": 3, "life": 2}\nnot json\n[1]\n{"step": "x"}\n')
    bad = []
    records = read_records(storage, "train", bad)
    assert len(storage.list("metrics")) == 4 and len(bad) == 2
    assert {s: r["life"] for s, r in latest_per_step(records).items()} == {1: 1, 2: 2, 3: 2}


def test_a_bucket_gets_the_step_records_at_most_every_5_s_and_all_on_a_flush(storage, monkeypatch, capsys):
    """A bucket bills each write: a record with a console line is written at once on a local disk, on any other store
    when 5 s have passed since the last write. train.py flushes before each checkpoint, so a crash loses only records
    of steps after the last one, which the next life does again."""
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    metrics, written = Metrics(storage, "train-e000001"), []
    for step, later in ((1, 0.0), (2, 1.0), (3, 4.5), (4, 0.1), (5, 4.9), (6, 0.1)):
        now[0] += later
        metrics.log({"step": step}, f"step {step}")
        written.append(len(read_records(storage, "train")))
    assert written == ([1, 2, 3, 4, 5, 6] if storage.local else [1, 1, 3, 3, 5, 5])  # at once, 5.5 s later, 5 s later
    metrics.log({"step": 7}, None)  # no line, as a generator's batch between its lines: never written at once
    metrics.flush()
    assert [r["step"] for r in read_records(storage, "train")] == [1, 2, 3, 4, 5, 6, 7]
    assert capsys.readouterr().out == "".join(f"step {s}\n" for s in range(1, 7))  # every line printed at once


def test_both_scripts_parse_the_same_run_settings_and_refuse_an_unknown_choice(capsys):
    from generate import GenerateConfig
    from train import TrainConfig
    shared = ["--model", "Qwen/Qwen2.5-Math-1.5B", "--task", "math", "--lora_r", "1", "--max_new_tokens", "3000"]
    run_t, cfg = parse_config(RunSettings, TrainConfig, argv=shared + ["--lr", "1e-5", "--old_logp", "recompute"])
    run_g, gen = parse_config(RunSettings, GenerateConfig, argv=shared + ["--engine", "http"])
    assert run_t == run_g and (run_t.lora_r, run_t.max_new_tokens, cfg.lr, cfg.tis_cap, gen.engine) == (1, 3000, 1e-5, 2.0, "http")
    with pytest.raises(SystemExit, match="2"):  # a generator's flag: one line, no traceback
        parse_config(RunSettings, TrainConfig, argv=["--lr", "1e-5", "--engine", "http"])
    assert "unrecognized arguments: --engine http (--help lists the flags)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # vLLM runs as `vllm serve`, reached with --engine http
        parse_config(RunSettings, GenerateConfig, argv=["--engine", "vllm"])
    assert "--engine: invalid choice: 'vllm' (choose from 'torch', 'http')" in capsys.readouterr().err


def test_a_lease_is_free_at_once_only_when_its_owner_died_on_this_host():
    from minigrpo import run
    from minigrpo.run import dead_here
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no process holds now
    here = socket.gethostname()
    lease = lambda host, pid: lease_view(json.dumps({**run.here(), "host": host, "pid": pid}))  # noqa: E731
    assert dead_here(lease(here, gone.pid))
    assert not dead_here(lease(here, os.getpid())) and not dead_here(lease("elsewhere", gone.pid))
    assert not any(dead_here(lease(here, bad)) for bad in ("x", None, 10**30, [1]))
