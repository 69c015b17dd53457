"""Faults injected for real: processes killed at random moments, damaged files, mismatched settings, full disks,
replicas that hang or fail, and a few hundred random requests. Nothing may be lost, trained twice or corrupted.

    python -m pytest -q tests/test_faults.py
"""
import collections
import errno
import http.server
import json
import os
import random
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import ROOT, call, free_port, start

from minigrpo import rollouts
from minigrpo.adapters import AdapterStore, adapter_name
from minigrpo.lora import DEFAULT_TARGETS, adapter_config, inject_lora, lora_state_dict
from minigrpo.model import load_model
from minigrpo.rollouts import RolloutBuffer, read_group
from minigrpo.run import RunSettings, join_run
from test_e2e import latest_records, records
from test_rundir import make_group


def py(*args, log=None):
    """Start `python args...` in the repo root; its output goes to the file `log` (a pipe nobody reads can block)."""
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)


def publish_v0(run_dir):
    """What the trainer does first: run.json and the untrained adapter as version 0."""
    join_run(run_dir, RunSettings())
    model, _ = load_model("demo", torch.device("cpu"))
    inject_lora(model, 8, 16.0, DEFAULT_TARGETS)
    return AdapterStore(run_dir).publish(0, lora_state_dict(model), adapter_config(8, 16.0, DEFAULT_TARGETS, "demo"), keep=5)


def test_trainer_killed_again_and_again_loses_nothing_and_trains_nothing_twice(tmp_path):
    run_dir, rng = str(tmp_path / "run"), random.Random(0)
    cmd = ["train.py", "--run_dir", run_dir, "--max_steps", "100", "--save_every", "7", "--eval_every", "100"]
    gen = py("generate.py", "--run_dir", run_dir, "--generator_id", "g0")
    latest_ok, stop = [], threading.Event()

    def watch_latest():  # LATEST must always name a complete directory
        store = AdapterStore(run_dir) if os.path.isdir(run_dir) else None
        while not stop.is_set():
            store = store or (AdapterStore(run_dir) if os.path.isdir(run_dir) else None)
            found = store and store.latest()
            if found:
                latest_ok.append(os.path.isfile(os.path.join(found[1], "adapter_model.safetensors")) or
                                 found[0] < max(store.versions(), default=0))  # pruned only once superseded
            time.sleep(0.01)
    watcher = threading.Thread(target=watch_latest, daemon=True)
    watcher.start()
    kills = 0
    try:
        for _ in range(3):
            trainer = py(*cmd)
            time.sleep(rng.uniform(5, 9))  # start-up takes ~3 s; then die at a random point of the loop
            if trainer.poll() is None:
                trainer.kill()
                kills += 1
            trainer.wait()
        final = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert final.returncode == 0, final.stdout[-2000:] + final.stderr[-2000:]
        assert gen.wait(timeout=60) == 0
    finally:
        stop.set()
        gen.kill()
    assert kills >= 2 and latest_ok and all(latest_ok)
    log = os.path.join(run_dir, "metrics", "train.jsonl")
    steps = [r for r in latest_records(log) if r["step"] > 0]
    assert [r["step"] for r in steps] == list(range(1, 101))
    ids = [g for r in steps for g in r["group_ids"]]
    assert len(ids) == len(set(ids)) == 100 * 16, "a group was trained twice"
    versions = [r["version"] for r in records(log)]
    runs, current = [], []
    for r in records(log):  # split the log into trainer lives at each step-number reset
        if current and r["step"] <= current[-1]["step"]:
            runs.append(current)
            current = []
        current.append(r)
    runs.append(current)
    for earlier, later in zip(runs, runs[1:]):
        assert min(r["version"] for r in later) > max(r["version"] for r in earlier), "an adapter name was reused"
    evals = [r for r in records(log) if "eval/accuracy" in r]
    assert evals[-1]["eval/accuracy"] >= evals[0]["eval/accuracy"] + 0.08, "accuracy did not rise as in a clean run"
    assert versions == sorted(versions)


def written_by(buffer) -> collections.Counter:
    """Visible groups per generator id (file names are <time>-<generator>-<seq>.safetensors)."""
    return collections.Counter(n.split("-")[1] for n in os.listdir(buffer.ready) if not n.startswith("."))


def test_generators_killed_mid_write_never_leave_a_partial_group(tmp_path):
    run_dir, rng = str(tmp_path / "run"), random.Random(1)
    publish_v0(run_dir)
    for life in range(2):
        buffer = RolloutBuffer(run_dir)
        before = written_by(buffer)
        gens = [py("generate.py", "--run_dir", run_dir, "--generator_id", f"g{k}", "--max_ready", "100000") for k in (0, 1)]
        deadline = time.time() + 180
        while not all(written_by(buffer)[g] > before[g] for g in ("g0", "g1")):  # both are writing now
            assert time.time() < deadline, written_by(buffer)
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.5))  # then die at a random point, very likely inside a write
        for g in gens:
            g.kill()
            g.wait()
        visible = [n for n in os.listdir(buffer.ready) if not n.startswith(".")]
        for name in visible:  # every visible file is a whole, valid group
            assert len(read_group(os.path.join(buffer.ready, name))) == 8
    names = [n for n in os.listdir(buffer.ready) if not n.startswith(".")]
    assert {n.split("-")[1] for n in names} == {"g0", "g1"} and len(names) == len(set(names))


def test_generator_skips_an_adapter_without_weights_and_keeps_the_last_good_one(tmp_path):
    run_dir = str(tmp_path / "run")
    publish_v0(run_dir)
    log = str(tmp_path / "gen.log")
    gen = py("generate.py", "--run_dir", run_dir, "--generator_id", "g0", "--max_ready", "100000", "--max_batches", "60", log=log)
    buffer, store = RolloutBuffer(run_dir), AdapterStore(run_dir)
    while buffer.count_ready() == 0:
        assert gen.poll() is None, open(log).read()
        time.sleep(0.05)
    broken = store.path(1)
    os.makedirs(broken)
    json.dump(adapter_config(8, 16.0, DEFAULT_TARGETS, "demo"), open(os.path.join(broken, "adapter_config.json"), "w"))
    open(os.path.join(store.root, "LATEST"), "w").write(adapter_name(1))
    assert gen.wait(timeout=120) == 0
    out = open(log).read()
    assert "cannot load" in out and "adapter_model.safetensors" in out
    versions = {read_group(os.path.join(buffer.ready, n)).policy_version for n in os.listdir(buffer.ready) if not n.startswith(".")}
    assert versions == {0}
    last = records(os.path.join(run_dir, "metrics", "generate-g0.jsonl"))[-1]
    assert last["adapters_skipped"] == 1 and last["batch"] == 60


def test_a_process_with_other_settings_refuses_to_join_and_names_the_field(tmp_path, flag="--temperature", value="0.7"):
    # (every field is compared the same way; tests/test_rundir.py checks group_size and temperature in-process)
    run_dir = str(tmp_path / "run")
    join_run(run_dir, RunSettings())
    out = subprocess.run([sys.executable, "generate.py", "--run_dir", run_dir, flag, value], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and flag.lstrip("-") in out.stderr and "run.json" in out.stderr


def test_a_full_disk_leaves_no_partial_group(tmp_path, monkeypatch):
    buffer = RolloutBuffer(str(tmp_path))

    def half_then_full(tensors, path, metadata=None):
        open(path, "wb").write(b"\x00" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(rollouts, "save_file", half_then_full)
    with pytest.raises(OSError, match="No space left") as e:
        buffer.write(make_group(), "g", 0)
    assert buffer.ready in str(e.value) and os.listdir(buffer.ready) == []


def test_an_unwritable_run_directory_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(SystemExit, match="not writable"):
        join_run(str(tmp_path / "file" / "run"), RunSettings())
    out = subprocess.run([sys.executable, "train.py", "--run_dir", str(tmp_path / "file" / "run")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "not writable" in out.stderr and "Traceback" not in out.stderr


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
    server = start(["-m", "minigrpo.serve", "--port", str(ports[0]), "--lora_root", str(tmp_path)], ports[0])
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
