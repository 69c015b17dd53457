"""Faults injected for real: the trainer killed at exact points (MINIGRPO_FAULT), two trainers on one run,
generators killed mid-write, damaged adapters, mismatched settings, full disks, replicas that hang or fail, and a
few hundred random requests. Nothing may be lost, trained twice or corrupted.

    python -m pytest -q tests/test_faults.py
"""
import json
import os
import random
import subprocess
import sys
import threading
import time
import http.server

import pytest
from conftest import ROOT, call, free_port, gen_records, generate_here, publish_v0, rollout_groups, start, train_records, unconsumed

from minigrpo.lora import DEFAULT_TARGETS, adapter_config, adapter_digest
from minigrpo.rollouts import RolloutBuffer
from minigrpo.run import RunSettings, create_run
from minigrpo.storage import Storage


def py(*args, log=None, env=None):
    """Start `python args...` in the repo root; its output goes to the file `log` (a pipe nobody reads can block)."""
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))


def generated_groups(run_dir, batches: int) -> list:
    """generate.py's groups of `batches` batches on a run publish_v0 made, read back and taken out of rollouts/, for
    a test to rewrite before the trainer sees them."""
    generate_here("--run_dir", str(run_dir), "--max_batches", str(batches))
    storage = Storage(run_dir)
    groups = list(rollout_groups(storage).values())
    storage.delete([f"rollouts/{f}" for f in storage.list("rollouts")])
    return groups


class Watcher(threading.Thread):
    """Polls a run every 10 ms: LATEST must always name a complete version, and a name must never get other
    weights (a name seen with two digests was reused)."""

    def __init__(self, run_dir):
        super().__init__(daemon=True)
        self.storage, self.stop, self.incomplete, self.digests = Storage(run_dir), threading.Event(), [], {}

    def run(self):
        while not self.stop.is_set():
            time.sleep(0.01)
            try:
                name = self.storage.get("adapters/LATEST").decode().strip()
            except FileNotFoundError:  # not published yet
                continue
            try:
                self.digests.setdefault(name, set()).add(adapter_digest(self.storage.get(f"adapters/{name}/adapter_model.safetensors")))
            except FileNotFoundError:
                if self.storage.get("adapters/LATEST").decode().strip() == name:
                    self.incomplete.append(name)  # still named, yet its weights are missing


TRAIN = ["train.py", "--max_steps", "12", "--save_every", "4", "--eval_every", "100", "--eval_size", "20",
         "--groups_per_step", "4"]


# (point, the step it is armed from, the step it fires at, the checkpoint the next life resumes from)
KILLS = [("after_metrics", 6, 6, "step-000004-e000001"), ("before_latest", 6, 6, "step-000004-e000001"),
         ("mid_gc", 6, 8, "step-000008-e000003"), ("after_checkpoint", 9, 12, "step-000012-e000004")]


def test_a_trainer_killed_at_each_fault_point_resumes_and_trains_every_group_exactly_once(tmp_path):
    """Five lives of one run beside one generator: each of the first four is killed at a fault point, the next
    resumes from the checkpoint that stands, and the fifth finishes. (One chain rather than a run a point: 6 processes
    start instead of 12, about 30 s less of CI's time.)"""
    run_dir = str(tmp_path / "run")
    gen = py("generate.py", "--run_dir", run_dir, "--generator_id", "g0", "--max_ready", "8")
    watcher = Watcher(run_dir)
    watcher.start()
    try:
        for life, (point, armed, fired, _) in enumerate([*KILLS, (None, 0, 0, "")], 1):
            log = str(tmp_path / f"train-{life}.log")
            trainer = py(*TRAIN, "--max_steps", "16", "--run_dir", run_dir, log=log,
                         env={"MINIGRPO_FAULT": f"{point}:{armed}"} if point else {})
            assert trainer.wait(timeout=300) == (137 if point else 0), open(log).read()[-3000:]
            said = open(log).read()
            assert not point or f"MINIGRPO_FAULT: exiting at {point}, step {fired}" in said, said[-3000:]
            resumed = KILLS[life - 2][3] if life > 1 else None
            assert not resumed or f"resumed from {os.path.join(run_dir, 'checkpoints', resumed)}" in said, said[-3000:]
        assert gen.wait(timeout=60) == 0
    finally:
        watcher.stop.set()
        gen.kill()
    steps = train_records(run_dir)
    assert [r["step"] for r in steps] == list(range(1, 17))
    ids = [g for r in steps for g in r["group_ids"]]
    assert len(ids) == len(set(ids)) == 16 * 4, "a group was trained twice in the surviving lineage"
    assert watcher.incomplete == [] and watcher.digests
    assert all(len(d) == 1 for d in watcher.digests.values()), "an adapter name was reused for other weights"
    versions = [r["version"] for r in steps]
    assert versions == sorted(versions) and len(set(versions)) == 16
    # every group written was trained once, dropped once (and counted once), or is still waiting
    written, last = 8 * len(gen_records(run_dir, "g0")), steps[-1]
    left = sum(map(len, unconsumed(Storage(run_dir)).values()))  # groups that wait
    dropped = last["sample/dropped_stale_total"] + last["sample/dropped_zero_std_total"]  # stale, and dapo's no-signal
    assert written == len(ids) + dropped + last["sample/bad_total"] + left


def test_a_second_trainer_is_refused_and_takes_over_once_the_first_is_dead(tmp_path):
    run_dir, log = str(tmp_path / "run"), str(tmp_path / "first.log")
    gen = py("generate.py", "--run_dir", run_dir, "--generator_id", "g0", "--max_ready", "8")
    storage = Storage(run_dir)
    try:
        first = py(*TRAIN, "--run_dir", run_dir, "--max_steps", "100000", log=log)
        deadline = time.time() + 120
        while not storage.exists("owner.json"):
            assert time.time() < deadline and first.poll() is None, open(log).read()
            time.sleep(0.05)
        owner = json.loads(storage.get("owner.json"))["owner"]
        second = subprocess.run([sys.executable, *TRAIN, "--run_dir", run_dir], cwd=ROOT, capture_output=True,
                                text=True, timeout=120)
        assert second.returncode == 1 and f"is owned by trainer {owner}" in second.stderr
        assert "heartbeat" in second.stderr and "Traceback" not in second.stderr
        first.kill()  # SIGKILL: its lease stays behind, but its pid is gone
        first.wait()
        third = subprocess.run([sys.executable, *TRAIN, "--run_dir", run_dir], cwd=ROOT, capture_output=True,
                               text=True, timeout=300)
        assert third.returncode == 0 and f"continuing after trainer {owner}" in third.stdout, third.stderr[-2000:]
    finally:
        gen.kill()


def three_steps_of_16_groups(run_dir, *gen_flags, train_flags=()):
    """train.py for 3 steps of 16 groups beside one generate.py with gen_flags; both must finish cleanly."""
    gen = py("generate.py", "--run_dir", run_dir, "--generator_id", "g0", *gen_flags)
    try:
        train = subprocess.run([sys.executable, *TRAIN, "--run_dir", run_dir, "--max_steps", "3", "--groups_per_step",
                                "16", *train_flags], cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
        assert gen.wait(timeout=60) == 0
    finally:
        gen.kill()
    return train_records(run_dir)


def test_backpressure_below_one_batch_never_deadlocks(tmp_path):
    """max_ready 4 < 16 groups a step: the generator waits for room while the trainer waits for groups, unless
    the trainer says, while it waits, what it consumed."""
    records = three_steps_of_16_groups(str(tmp_path / "run"), "--max_ready", "4")
    assert [r["step"] for r in records] == [1, 2, 3]


def test_lockstep_samples_each_step_with_the_newest_weights_from_several_batches(tmp_path):
    """--lockstep with 8 prompts a batch and 16 groups a step: two batches per version, then wait for the next
    (the grpo loss trains on every group, so exactly two)."""
    run_dir = str(tmp_path / "run")
    records = three_steps_of_16_groups(run_dir, "--lockstep", "--prompts_per_batch", "8", train_flags=["--loss_type",
                                       "grpo"])
    assert [(r["step"], r["sample/staleness_max"]) for r in records] == [(1, 0), (2, 0), (3, 0)]
    versions = [r["policy_version"] for r in gen_records(run_dir, "g0")]
    assert versions[:6] == [0, 0, 1, 1, 2, 2] and set(versions[6:]) <= {3}, versions  # v3 may start before DONE


def test_lockstep_makes_more_groups_of_a_version_as_dapo_drops_zero_std_ones(tmp_path):
    """dapo drops the groups whose rewards are all equal: the waiting trainer asks a lock-step generator for one
    more group per dropped one, so nothing deadlocks. It makes whole batches, so a step may leave some of its
    version's groups to the next (one version old; --max_staleness 0 would drop them)."""
    run_dir = str(tmp_path / "run")
    records = three_steps_of_16_groups(run_dir, "--lockstep", "--prompts_per_batch", "8")
    assert [r["step"] for r in records] == [1, 2, 3] and max(r["sample/staleness_max"] for r in records) <= 1
    assert records[-1]["sample/dropped_zero_std_total"] > 0  # the demo's base gets some problems always right
    versions = [r["policy_version"] for r in gen_records(run_dir, "g0")]
    assert versions == sorted(versions) and versions.count(0) > 2, versions


def test_resuming_with_other_training_settings_names_each_field():
    from train import TrainConfig, check_settings
    saved = vars(TrainConfig()) | {"lr": 1.0, "loss_type": "grpo"}
    assert check_settings(saved, TrainConfig(max_steps=9, device="cpu")) == [
        "loss_type: the checkpoint has 'grpo', this command has 'dapo'", "lr: the checkpoint has 1.0, this command has 0.003"]


def test_generators_killed_mid_write_never_leave_a_partial_group(tmp_path):
    run_dir, rng = str(tmp_path / "run"), random.Random(1)
    store = publish_v0(run_dir)
    writers = lambda: {n.rsplit("-", 1)[0] for n in store.storage.list("rollouts")}  # noqa: E731
    for life in range(2):
        before = writers()
        gens = [py("generate.py", "--run_dir", run_dir, "--generator_id", f"g{k}", "--max_ready", "100000") for k in (0, 1)]
        deadline = time.time() + 180
        while len(writers() - before) < 2:  # both are writing now, each under a name of this life
            assert time.time() < deadline, writers()
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.5))  # then die at a random point, very likely inside a write
        for g in gens:
            g.kill()
            g.wait()
        assert all(len(g.completion_ids) == 8 for g in rollout_groups(store.storage).values())  # whole and valid
    assert len(writers()) == 4 and {w.split("-")[0] for w in writers()} == {"g0", "g1"}  # a new name every life


def test_generator_skips_an_adapter_without_weights_and_keeps_the_last_good_one(tmp_path):
    run_dir, log = str(tmp_path / "run"), str(tmp_path / "gen.log")
    store = publish_v0(run_dir)
    gen = py("generate.py", "--run_dir", run_dir, "--generator_id", "g0", "--max_ready", "100000", "--max_batches", "60", log=log)
    buffer = RolloutBuffer(store.storage)
    while not buffer.listed():
        assert gen.poll() is None, open(log).read()
        time.sleep(0.05)
    store.storage.put(f"adapters/{store.name(1)}/adapter_config.json",
                      json.dumps(adapter_config(8, 16.0, DEFAULT_TARGETS, "demo")))
    store.storage.put("adapters/LATEST", store.name(1))
    assert gen.wait(timeout=120) == 0
    out = open(log).read()
    assert f"cannot load {store.url(1)} (ValueError: {store.url(1)} doesn't contain tensors)" in out
    versions = {g.policy_version for g in rollout_groups(store.storage).values()}
    assert versions == {0}
    last = gen_records(run_dir, "g0")[-1]
    assert last["adapters_skipped"] == 1 and last["batch"] == 60


def test_a_generator_with_other_settings_refuses_to_join_and_names_the_field(tmp_path):
    run_dir = str(tmp_path / "run")
    create_run(Storage(run_dir), RunSettings())
    out = subprocess.run([sys.executable, "generate.py", "--run_dir", run_dir, "--temperature", "0.7"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "temperature: run.json has 1.0, this process has 0.7" in out.stderr


def test_a_failed_write_leaves_nothing_and_names_the_object(tmp_path, monkeypatch):
    """On a full disk the kernel fails the write or the fsync with ENOSPC: that exact error, then nothing."""
    storage = Storage(str(tmp_path))

    def full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=f"cannot write {tmp_path}/rollouts/g-000000.safetensors: OSError: .*No space"):
        storage.put("rollouts/g-000000.safetensors", b"x" * 1000)
    assert os.listdir(tmp_path / "rollouts") == []


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 1 MiB filesystem (CI runs as root); skipped where it cannot be mounted."""
    path = tmp_path / "small"
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield str(path)
    subprocess.run(["umount", "-l", str(path)])


def test_a_full_disk_stops_the_run_with_one_line_and_nothing_torn(tiny_tmpfs, tmp_path):
    run_dir, log = os.path.join(tiny_tmpfs, "run"), str(tmp_path / "gen.log")
    gen = py("generate.py", "--run_dir", run_dir, "--generator_id", "g0", "--max_ready", "100000", log=log)
    try:
        train = subprocess.run([sys.executable, *TRAIN, "--run_dir", run_dir, "--max_steps", "100000",
                                "--wait_timeout_s", "20"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        gen.wait(timeout=120)
    finally:
        gen.kill()
    gen_out = open(log).read()
    assert train.returncode == 1 and gen.returncode == 1, train.stderr + gen_out  # each stops by itself
    assert "Traceback" not in train.stderr + gen_out and "No space left on device" in train.stderr + gen_out
    storage = Storage(run_dir)
    rollout_groups(storage)  # every visible object is whole
    latest = storage.get("adapters/LATEST").decode().strip()
    assert storage.exists(f"adapters/{latest}/adapter_model.safetensors")


def test_an_unwritable_run_directory_is_one_clear_line(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    out = subprocess.run([sys.executable, "train.py", "--run_dir", str(tmp_path / "file" / "run")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and f"cannot read {tmp_path}/file/run/owner.json: NotADirectoryError" in out.stderr
    assert "Traceback" not in out.stderr


class Misbehaving(http.server.BaseHTTPRequestHandler):
    """A replica that is healthy on GET but hangs (port A) or fails (port B) on POST."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        if self.server.mode == "hang":
            time.sleep(5)
        body = b'{"error": {"message": "engine died", "type": "InternalServerError", "param": null, "code": 500}}'
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def bad_replicas():
    servers = []
    for mode in ("hang", "fail"):
        s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Misbehaving)
        s.mode, s.daemon_threads = mode, True
        threading.Thread(target=s.serve_forever, daemon=True).start()
        servers.append(s)
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    for s in servers:
        s.shutdown()


def test_a_hanging_replica_gets_a_504_naming_it_and_the_proxy_stays_up(bad_replicas):
    port = free_port()
    proxy = start(["proxy.py", "--upstream", bad_replicas[0], "--port", str(port), "--no_auth", "--request_timeout_s", "1"], port)
    try:
        t0 = time.time()
        status, text, _ = call("POST", f"http://127.0.0.1:{port}/v1/completions", {"prompt": [1, 2, 3]})
        assert status == 504 and bad_replicas[0] in text and time.time() - t0 < 4
        assert call("GET", f"http://127.0.0.1:{port}/health")[0] == 200
    finally:
        proxy.kill()


def test_a_failing_replica_passes_its_error_through_and_fails_a_load_everywhere(bad_replicas, tmp_path):
    port = free_port()
    proxy = start(["proxy.py", "--upstream", bad_replicas[1], "--port", str(port), "--no_auth"], port)
    try:
        status, _, out = call("POST", f"http://127.0.0.1:{port}/v1/completions", {"prompt": [1, 2, 3]})
        assert status == 500 and out["error"]["message"] == "engine died"
        status, text, _ = call("POST", f"http://127.0.0.1:{port}/v1/load_lora_adapter",
                               {"lora_name": "x", "lora_path": str(tmp_path)})
        assert status == 500 and bad_replicas[1] in text
    finally:
        proxy.kill()


def random_request(rng: random.Random):
    junk = [None, -1, 10**12, "x" * 50, [], {}, [[]], [1.5], [-3, 2], True, [[1, 2], "a"], "12+34="]
    body = {k: rng.choice(junk + [rng.randrange(0, 20)]) for k in rng.sample(
        ["prompt", "n", "max_tokens", "temperature", "top_p", "seed", "logprobs", "model", "stop_token_ids",
         "lora_name", "lora_path", "stream", "top_k"], rng.randrange(0, 6))}
    path = rng.choice(["/v1/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/models", "/pause",
                       "/nope", "/v1/chat/completions", "/resume", "/server_info"])
    raw = rng.choice([json.dumps(body).encode(), b"{", b"\xff\xfe", json.dumps([body]).encode(), b"A" * (20 * 2**20)])
    return rng.choice(["POST", "GET", "PUT"]), path, raw


def test_random_requests_get_an_answer_and_everything_stays_healthy(tmp_path):
    ports = [free_port(), free_port()]
    server = start(["-m", "minigrpo.replica.serve", "--port", str(ports[0]), "--lora_root", str(tmp_path)], ports[0])
    proxy = start(["proxy.py", "--upstream", f"http://127.0.0.1:{ports[0]}", "--port", str(ports[1]), "--no_auth"], ports[1])
    rng, statuses = random.Random(7), []
    try:
        for i in range(300):
            method, path, raw = random_request(rng)
            port = ports[i % 2]
            try:
                statuses.append(call(method, f"http://127.0.0.1:{port}{path.replace('/pause', '/is_paused')}", raw=raw)[0])
            except (ConnectionError, OSError):  # an oversized body may be refused before it is read
                statuses.append(413)
        assert all(s < 500 for s in statuses), sorted(set(statuses))
        for port in ports:
            assert call("GET", f"http://127.0.0.1:{port}/health")[0] == 200
        assert call("POST", f"http://127.0.0.1:{ports[1]}/v1/completions", {"prompt": [2, 3], "max_tokens": 2})[0] == 200
    finally:
        server.kill()
        proxy.kill()
