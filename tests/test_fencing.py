"""One owner, fenced: a trainer paused at each write point of a step while another takes the run over, clocks an
hour apart, a kill during the first checkpoint, and four generators on one trainer. Whatever the paused trainer does
when it wakes, no group is trained twice, no adapter name gets two sets of weights, LATEST never goes back, and the
steps' standing records are the new owner's lineage.

    python -m pytest -q tests/test_fencing.py
"""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from conftest import ROOT, gen_records, train_records, unconsumed
from test_faults import TRAIN, py

from minigrpo.lora import adapter_digest
from minigrpo.storage import Storage


class Audit(threading.Thread):
    """Every 10 ms: the version LATEST names (it must never go back) and the weights under every adapter name (one
    digest a name, ever: a file that changed is read again)."""

    def __init__(self, run_dir):
        super().__init__(daemon=True)
        self.root, self.stop, self.latest, self.digests, self.stats = run_dir, threading.Event(), [], {}, {}

    def look(self):
        with contextlib.suppress(OSError):
            name = open(f"{self.root}/adapters/LATEST").read().strip()
            if name and (not self.latest or self.latest[-1] != name):
                self.latest.append(name)
        for name in os.listdir(f"{self.root}/adapters") if os.path.isdir(f"{self.root}/adapters") else []:
            path = f"{self.root}/adapters/{name}/adapter_model.safetensors"
            with contextlib.suppress(OSError):
                st = os.stat(path)
                if self.stats.get(name) != (key := (st.st_ino, st.st_mtime_ns, st.st_size)):
                    self.stats[name] = key
                    self.digests.setdefault(name, set()).add(adapter_digest(open(path, "rb").read()))

    def run(self):
        while not self.stop.is_set():
            time.sleep(0.01)
            self.look()

    def finish(self) -> dict:
        self.stop.set()
        self.join()
        self.look()
        versions = [int(n.rsplit("-v", 1)[1]) for n in self.latest]
        return {"latest_went_back": versions != sorted(versions), "names": len(self.digests),
                "names_with_two_digests": sum(len(d) > 1 for d in self.digests.values())}


def standing(run_dir) -> dict[int, tuple[int, dict]]:
    """{step: (epoch of the life that wrote it, record)} of the records that stand (read segment by segment)."""
    storage, out = Storage(run_dir), {}
    for f in sorted(storage.list("metrics")):
        if m := re.match(r"train-e(\d+)-", f):
            for line in storage.get(f"metrics/{f}").decode().splitlines():
                out[json.loads(line)["step"]] = int(m[1]), json.loads(line)
    return out


def wait_for(what, proc, log, timeout=240):
    deadline = time.time() + timeout
    while not what():
        assert proc.poll() is None and time.time() < deadline, open(log).read()[-3000:]
        time.sleep(0.05)


def stopped(pid) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def pause_chain(tmp_path, pauses, wake_after=1, steps=12, pause_s=0.0) -> dict:
    """Trainer life 1 stops (SIGSTOP) at pauses[0], a (point, step); life 2 takes the run over, and life 1 wakes once
    life 2 has logged `wake_after` steps or stopped (and pause_s more seconds); life 2 stops at pauses[1], life 3
    takes over, and so on; the last life finishes. Returns the audit of the run once all have ended."""
    run_dir, logs = str(tmp_path / "run"), []
    args = [*TRAIN, "--run_dir", run_dir, "--max_steps", str(steps), "--lease_timeout_s", "2"]
    gen = py("generate.py", "--run_dir", run_dir, "--generator_id", "g0", "--max_ready", "8")
    audit, procs = Audit(run_dir), [gen]
    audit.start()
    try:
        for life, pause in enumerate([*pauses, None], 1):
            logs.append(log := str(tmp_path / f"life{life}.log"))
            procs.append(p := py(*args, log=log, env={"MINIGRPO_FAULT": f"{pause[0]}:{pause[1]}:pause"} if pause else {}))
            if life > 1:  # it took the run over from the paused life before it, which now wakes
                wait_for(lambda: p.poll() is not None or stopped(p.pid) or  # it may finish at once, or stop first
                         len(re.findall(r"step \d+/\d+ \| reward", open(log).read())) >= wake_after, procs[-2], logs[-2])
                time.sleep(pause_s)
                os.kill(procs[-2].pid, signal.SIGCONT)
                procs[-2].wait(timeout=120)
            if pause:
                wait_for(lambda: "MINIGRPO_FAULT: pausing" in open(log).read() and stopped(p.pid), p, log)
        assert p.wait(timeout=300) == 0, open(log).read()[-3000:]
        assert gen.wait(timeout=60) == 0
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
            p.kill()
    out, records = audit.finish(), standing(run_dir)
    resumed = [int(m[1]) if (m := re.search(r"resumed from .*step-(\d+)-e\d+ \(step", open(log).read())) else 0 for log in logs]
    ids = [g for s, (_, r) in records.items() if s for g in r["group_ids"]]
    last = records.get(steps, (0, {}))[1]  # every group written was trained once, dropped, quarantined, or waits
    written, left = 8 * len(gen_records(run_dir, "g0")), sum(map(len, unconsumed(Storage(run_dir)).values()))
    return out | {  # a step's record stands from the last life that resumed before it
        "a_exit": [p.returncode for p in procs[1:-1]], "trained_twice": len(ids) - len(set(ids)), "trained": len(ids),
        "a_lost_lease": len(logs) > 1 and all("lease lost" in open(log).read() for log in logs[:-1]),
        "lineage": {s: e for s, (e, _) in records.items() if s} == {
            s: max(life for life, r in enumerate(resumed, 1) if r < s) for s in range(1, steps + 1)},
        "unaccounted": written - len(ids) - last.get("sample/dropped_stale_total", 0)
        - last.get("sample/dropped_zero_std_total", 0) - last.get("sample/bad_total", 0) - left}


def pause_and_take_over(tmp_path, point, pause_step=6, **more) -> dict:  # one pause (bench/fencing_trials.py)
    return pause_chain(tmp_path, [(point, pause_step)], **more)


def assert_fenced(audit: dict, pauses: int, steps: int):
    assert audit["a_exit"] == [1] * pauses and audit["a_lost_lease"], audit  # every paused life woke to a fence
    assert audit["trained_twice"] == 0 and audit["trained"] == steps * 4 and audit["unaccounted"] == 0, audit
    assert audit["names_with_two_digests"] == 0 and not audit["latest_went_back"] and audit["names"] > 0, audit
    assert audit["lineage"], audit  # every step 1..N: one standing record, from the last owner's lineage


# Life 1 pauses before_publish at step 6 (checkpoint 4 stands); life 2 resumes from 4 and pauses before_latest at 7;
# life 3 from 4, checkpoints 8, pauses before_metrics at 9; life 4 from 8, pauses after_metrics at 10; life 5 from 8,
# checkpoints 12, pauses mid_gc there; life 6 from 12 finishes. One chain, not a run a point: 7 processes, not 15.
PAUSES = [("before_publish", 6), ("before_latest", 7), ("before_metrics", 9), ("after_metrics", 10), ("mid_gc", 11)]


def test_a_trainer_paused_at_each_write_point_wakes_to_a_fence(tmp_path):
    assert_fenced(pause_chain(tmp_path, PAUSES, steps=16), len(PAUSES), 16)


def test_clocks_an_hour_apart_decide_nothing(tmp_path):
    """The first trainer's clock runs an hour ahead and it dies after step 6; the second's runs an hour behind, and
    so does the generator's. The newest life's records stand, and backpressure holds (it once compared the
    trainer's timestamps with the generator's clock)."""
    run_dir, log = str(tmp_path / "run"), str(tmp_path / "a.log")
    gen = py("generate.py", "--run_dir", run_dir, "--generator_id", "g0", "--max_ready", "8",
             env={"MINIGRPO_FAULT": "clock:-3600"})
    try:
        first = py(*TRAIN, "--run_dir", run_dir, log=log, env={"MINIGRPO_FAULT": "clock:3600,after_metrics:6"})
        assert first.wait(timeout=300) == 137, open(log).read()[-3000:]
        second = subprocess.run([sys.executable, *TRAIN, "--run_dir", run_dir], cwd=ROOT, capture_output=True, text=True,
                                timeout=300, env=dict(os.environ, MINIGRPO_FAULT="clock:-3600"))
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
        assert gen.wait(timeout=60) == 0
    finally:
        gen.kill()
    records = standing(run_dir)
    assert {s: e for s, (e, _) in records.items() if s} == {s: 1 if s <= 4 else 2 for s in range(1, 13)}
    steps = train_records(run_dir)
    # backpressure held (--max_ready 8), but at the resumed step 5, where what the dead life had consumed is back
    assert max(r["sample/rollout_queue_size"] for r in steps if r["step"] != 5) <= 8


def test_a_kill_during_the_first_checkpoint_restarts_from_step_0(tmp_path):
    run_dir, log = str(tmp_path / "run"), str(tmp_path / "a.log")
    gen = py("generate.py", "--run_dir", run_dir, "--generator_id", "g0", "--max_ready", "8")
    try:
        first = py(*TRAIN, "--run_dir", run_dir, log=log, env={"MINIGRPO_FAULT": "after_metrics:4"})
        assert first.wait(timeout=300) == 137, open(log).read()[-3000:]
        storage = Storage(run_dir)  # what a kill inside save_checkpoint leaves: some files, no MANIFEST
        storage.put("checkpoints/step-000004-e000001/trainer_state.json", "{")
        os.makedirs(os.path.join(run_dir, "checkpoints", "step-000004"))
        second = subprocess.run([sys.executable, *TRAIN, "--run_dir", run_dir, "--max_steps", "6"], cwd=ROOT,
                                capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
        assert gen.wait(timeout=60) == 0
    finally:
        gen.kill()
    assert "resumed from" not in second.stdout and "continuing after trainer" in second.stdout
    records = standing(run_dir)
    assert {s: e for s, (e, _) in records.items()} == {s: 2 for s in range(7)}  # all redone, by the second life
    ids = [g for s, (_, r) in records.items() if s for g in r["group_ids"]]
    assert len(ids) == len(set(ids)) == 6 * 4
    assert {"step-000004-e000002", "step-000006-e000002"} <= set(Storage(run_dir).list("checkpoints"))


def stale_share(run_dir, generators: int, steps: int, root=ROOT, timeout=900) -> dict:
    """The demo's trainer (fewer evaluations) beside N generators: the share of the groups it consumed that it
    dropped as stale, and the longest queue it saw. bench/generators_stale.py runs it for 1, 2 and 4."""
    gens = [subprocess.Popen([sys.executable, "generate.py", "--run_dir", run_dir, "--generator_id", f"g{i}"], cwd=root,
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT) for i in range(generators)]
    try:
        t0 = time.time()
        train = subprocess.run([sys.executable, "train.py", "--run_dir", run_dir, "--max_steps", str(steps),
                                "--eval_every", "1000", "--eval_size", "50"], cwd=root, capture_output=True, text=True,
                               timeout=timeout)
        assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
        assert all(g.wait(timeout=120) == 0 for g in gens)
    finally:
        for g in gens:
            g.kill()
    records = [r for r in (json.loads(x) for f in sorted(os.listdir(f"{run_dir}/metrics")) if f.startswith("train")
                           for x in open(f"{run_dir}/metrics/{f}")) if r["step"] > 0]
    dropped, trained = records[-1]["sample/dropped_stale_total"], sum(len(r["group_ids"]) for r in records)
    return {"generators": generators, "steps": steps, "stale_share": dropped / (dropped + trained),
            "max_queue": max(r["sample/rollout_queue_size"] for r in records), "wall_s": time.time() - t0}


def test_four_generators_on_one_trainer_drop_at_most_one_percent_as_stale(tmp_path):
    """Together they stay within --max_ready (64) of what the trainer consumed, so a group waits at most two steps.
    (When each counted only its own groups, the queue reached 128 and 5.7% went stale in 150 steps: bench/
    generators_stale.py. 30 steps, not 60: max_queue fails as soon as the queue passes 64.)"""
    out = stale_share(str(tmp_path / "run"), generators=4, steps=30)
    assert out["stale_share"] <= 0.01 and out["max_queue"] <= 64, out


def test_a_generator_trusts_a_lease_only_while_it_changes_whatever_its_timestamps(tmp_path):
    from generate import waiting_groups
    from minigrpo.rollouts import RolloutBuffer
    storage = Storage(str(tmp_path / "run"))
    for i in range(20):
        storage.put(f"rollouts/w-{i:06d}.safetensors", b"")
    lease = {"owner": "t", "waiting": 0, "seen": {"w": 19}, "writers": 1, "timeout_s": 0.3, "groups_per_step": 4,
             "heartbeat": time.time() + 3600, "beat": 1}  # a trainer an hour ahead, dead: its room is not there
    storage.put("owner.json", json.dumps(lease))
    buffer, watch = RolloutBuffer(storage), {"raw": None, "since": time.monotonic()}
    assert waiting_groups(buffer, watch, "w", 20, 8)[0] == 0  # live as far as this generator knows: room
    time.sleep(0.35)
    assert waiting_groups(buffer, watch, "w", 20, 8)[0] == (20 + 1) * 8  # unchanged for its timeout: count the listing
    storage.put("owner.json", json.dumps(lease | {"beat": 2, "waiting": 10, "writers": 3}))
    assert waiting_groups(buffer, watch, "w", 22, 8)[0] == 10 + 3 * (2 + 1) * 8  # alive again: its share, N = 3
