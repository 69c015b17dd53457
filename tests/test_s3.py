"""The whole demo on a real S3 server: moto's server mode on loopback (what s3fs's own tests use), reached the
standard way (AWS_ENDPOINT_URL and friends). Generator and trainer share nothing but s3://bucket/run.

    python -m pytest -q tests/test_s3.py
"""
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from conftest import ROOT, gen_records, publish_v0, train_records
from test_rundir import make_group

from minigrpo.rollouts import Ledger, RolloutBuffer, read_groups
from minigrpo.storage import Storage


def test_the_demo_runs_on_s3_and_trains_every_group_exactly_once(s3_bucket, tmp_path):
    run_dir = f"{s3_bucket}/run"
    log = tmp_path / "generate.log"  # a file: a pipe nobody reads fills up and stops the generator mid-print
    with open(log, "w") as out:
        gen = subprocess.Popen([sys.executable, "generate.py", "--run_dir", run_dir, "--generator_id", "g0"], cwd=ROOT,
                               stdout=out, stderr=subprocess.STDOUT)
    try:
        train = subprocess.run([sys.executable, "train.py", "--run_dir", run_dir, "--max_steps", "20", "--save_every",
                                "5", "--eval_every", "100", "--eval_size", "50", "--groups_per_step", "8"], cwd=ROOT,
                               capture_output=True, text=True, timeout=300)
        gen.wait(timeout=120)
    finally:
        gen.kill()
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert gen.returncode == 0, log.read_text()[-3000:]
    steps = train_records(run_dir)
    ids = [g for r in steps for g in r["group_ids"]]
    assert [r["step"] for r in steps] == list(range(1, 21)) and len(ids) == len(set(ids)) == 20 * 8
    assert abs(steps[0]["ratio/mean"] - 1) < 1e-3  # the generator loaded the adapter straight from the bucket
    assert max(int(i.rsplit(".", 1)[1]) for i in ids) == 15  # on a bucket its objects hold 16 groups, not 8
    storage = Storage(run_dir)
    assert storage.exists("DONE") and storage.list("checkpoints") == ["step-000015-e000001", "step-000020-e000001"]
    latest = storage.get("adapters/LATEST").decode().strip()
    assert storage.exists(f"adapters/{latest}/adapter_model.safetensors")
    for name in storage.list("rollouts"):  # what is left holds a group never trained (whole objects go), and is whole
        assert {g.group_id for g in read_groups(storage.get(f"rollouts/{name}"), name.removesuffix(".safetensors"))} - set(ids)


def test_a_missing_bucket_is_one_clear_line(s3_endpoint):
    out = subprocess.run([sys.executable, "train.py", "--run_dir", "s3://no-such-bucket-here/run"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "cannot write s3://no-such-bucket-here/run/owner.json" in out.stderr and "bucket does not exist" in out.stderr


def test_a_read_on_s3_is_one_request_whatever_its_size(s3_bucket):
    """A bucket charges, and a run waits, per request: get() and versioned() read an object in one GET (s3fs would
    first ask for its size with a HEAD, to split a large one), and a missing object is still FileNotFoundError."""
    import pytest
    storage = Storage(f"{s3_bucket}/run")
    storage.put_many({"small": b"x" * 10, "large": bytes(range(256)) * 40_000})  # 10 MB: past s3fs's 5 MiB block
    calls, call_s3 = [], storage.fs._call_s3

    async def counted(method, *args, **kwargs):
        calls.append(method)
        return await call_s3(method, *args, **kwargs)
    storage.fs._call_s3 = counted
    assert storage.get("small") == b"x" * 10 and storage.get("large") == bytes(range(256)) * 40_000
    assert calls == ["get_object", "get_object"]
    calls.clear()
    assert storage.versioned("small")[0] == b"x" * 10 and calls == ["head_object", "get_object"]
    assert storage.versioned("small", read=False) == (None, storage.versioned("small")[1])  # a fence needs the token alone
    assert calls[2:] == ["head_object", "head_object", "get_object"]
    with pytest.raises(FileNotFoundError):
        storage.get("absent")


def test_a_poll_on_s3_looks_up_each_writers_next_objects_by_name(s3_bucket):
    """Consumed objects stay in rollouts/ until garbage collection, two checkpoints later: a poll must not grow with
    them. A writer names its objects in order, so the trainer GETs each recent writer's next ones by name (one more
    than its last look found, up to 8), and lists all of rollouts/ only now and then, to meet new writers and any
    object written out of order."""
    buffer, ledger = RolloutBuffer(Storage(f"{s3_bucket}/run"), "r1"), Ledger()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda seq: buffer.write([make_group()], "w", seq=seq), range(300)))
    assert len(buffer.take(300, ledger)) == 300  # the first listing is whole
    looked, get, listed = [], buffer.storage.get, buffer.storage.list
    buffer.storage.get = lambda key: looked.append(key.split("/")[1].split(".")[0]) or get(key)
    buffer.storage.list = lambda prefix: looked.append("LIST") or listed(prefix)

    def now(quiet_s=0.0, listed_s=0.0):  # as if w last grew quiet_s ago and rollouts/ was listed whole listed_s ago
        buffer.active["w"], buffer.full_at = time.monotonic() - quiet_s, time.monotonic() - listed_s
        looked.clear()

    def taken():
        return [g.group_id for g in buffer.take(8, ledger)]
    buffer.write([make_group()], "w", seq=300)
    now()  # the last look found 300: 8 names
    assert taken() == ["w-000300.0"] and sorted(looked) == [f"w-{i:06d}" for i in range(300, 308)] and buffer.next == {"w": 301}
    buffer.write([make_group()], "w", seq=302)  # 301 comes late
    buffer.write([make_group()], "v", seq=0)  # a new writer: met by a whole listing, 30 s after the last (5 s if w is quiet)
    now()
    assert taken() == ["w-000302.0"] and sorted(looked) == ["w-000301", "w-000302"] and buffer.next == {"w": 303}
    buffer.write([make_group()], "w", seq=301)
    now(listed_s=6)  # w grew within 5 s: no whole listing, and the look starts past 302
    assert taken() == [] and sorted(looked) == ["w-000303", "w-000304"]
    now(listed_s=6)  # that look found none: one name
    assert taken() == [] and looked == ["w-000303"]
    now(quiet_s=61, listed_s=1)  # w quiet for a minute: no look by name; the whole listing comes 5 s after the last
    assert taken() == [] and looked == []
    now(quiet_s=6, listed_s=6)  # w quiet for 6 s: the whole listing finds both, the oldest first
    assert taken() == ["v-000000.0", "w-000301.0"] and looked[0] == "LIST" and sorted(looked[1:]) == ["v-000000", "w-000301"]
    assert buffer.next == {"w": 303, "v": 1}
    assert ledger.taken == {f"{w}{part}" for w in [f"w-{i:06d}" for i in range(303)] + ["v-000000"] for part in ("", ".0")}


def test_a_generator_reads_LATEST_only_while_no_live_lease_names_the_version(s3_bucket):
    """Reading LATEST before every batch costs a GET on S3; the trainer writes the version it published into the
    lease, which a generator reads anyway. Without a live lease, it reads LATEST. And it reads a live lease at most
    once a poll while the count it took leaves room (--poll_s 60: once in these 3 batches)."""
    from minigrpo.run import Lease
    run_dir = f"{s3_bucket}/run-latest"
    publish_v0(run_dir)
    code = ("import sys, generate, minigrpo.storage as s; keys, get = [], s.Storage.get\n"
            "s.Storage.get = lambda self, key: keys.append(key) or get(self, key)\n"
            f"sys.argv = ['generate.py', '--run_dir', {run_dir!r}, '--generator_id', 'g', '--max_batches', '3', '--poll_s', '60', "
            "'--prompts_per_batch', '8']\n"  # the second life's count: (3 objects + 2 writers) x 8 <= --max_ready
            "generate.main(); print('LATEST read', keys.count('adapters/LATEST'), 'lease read', keys.count('owner.json'))")
    def generate():
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
        return out.stdout[-2000:] + out.stderr[-2000:]
    assert "LATEST read 3 lease read 3\n" in (out := generate()), out  # no trainer: before each batch
    lease = Lease(Storage(run_dir), 60.0)
    lease.acquire()
    lease.write(version=0)  # as publish() does once LATEST names version 0
    try:
        assert "LATEST read 0 lease read 1\n" in (out := generate()), out
    finally:
        lease.release()
    assert {r["policy_version"] for r in gen_records(run_dir, "g")} == {0}


def test_a_generator_looks_for_DONE_only_while_no_live_lease_says_a_trainer_runs(s3_bucket):
    """A missing object costs two requests on S3 (a HEAD, then a listing for a "directory"): a generator whose lease
    is live skips the look for DONE before every batch. Once the lease is gone, it looks, and stops on DONE."""
    from minigrpo.run import Lease
    run_dir = f"{s3_bucket}/run"
    publish_v0(run_dir)
    lease = Lease(Storage(run_dir), 60.0)
    lease.acquire()
    code = ("import sys, generate, minigrpo.storage as s; keys, exists = [], s.Storage.exists\n"
            "s.Storage.exists = lambda self, key: keys.append(key) or exists(self, key)\n"
            f"sys.argv = ['generate.py', '--run_dir', {run_dir!r}, '--generator_id', 'g', '--max_batches', '4', "
            "'--prompts_per_batch', '8']\n"  # h's count below: (4 objects + 2 writers) x 8 <= --max_ready
            "generate.main(); print('looked up', keys.count('DONE'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "looked up 2\n" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]  # at start, and before the first batch
    gen = subprocess.Popen([sys.executable, "generate.py", "--run_dir", run_dir, "--generator_id", "h", "--prompts_per_batch",
                            "8"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        while not any(name.startswith("h-") for name in Storage(run_dir).list("rollouts")):
            assert gen.poll() is None, "the generator stopped before it wrote a group"
            time.sleep(0.2)
        lease.fenced(Storage(run_dir).put, "DONE", "finished\n")  # what the trainer does last
        lease.release()
        assert gen.wait(timeout=60) == 0
    finally:
        gen.kill()


def test_a_held_back_generator_looks_at_the_lease_once_a_poll(s3_bucket):
    """Held back by --max_ready, a generator looks at the lease (a GET on a bucket) once a poll, 0.2 s on a bucket,
    not every 50 ms: while it waits, the trainer's requests, not its own, should have the server."""
    from minigrpo.run import Lease
    run_dir = f"{s3_bucket}/run-held"
    publish_v0(run_dir)
    lease = Lease(Storage(run_dir), 60.0)
    lease.acquire()
    lease.write(version=0, waiting=1000)  # more than --max_ready waits: hold back
    code = ("import sys, threading, time, generate, minigrpo.storage as s; keys, naps, get, nap = [], [], s.Storage.get, time.sleep\n"
            "s.Storage.get = lambda self, key: keys.append(key) or get(self, key)\n"
            "def sleep(t):\n"
            "    if threading.current_thread() is threading.main_thread():\n"
            "        naps.append(t)\n"
            "        if len(naps) == 5: sys.exit(f'naps {naps} lease reads {keys.count(\"owner.json\")}')\n"
            "    nap(t)\n"
            f"time.sleep = sleep; sys.argv = ['generate.py', '--run_dir', {run_dir!r}, '--generator_id', 'g']\n"
            "generate.main()")
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        lease.release()
    assert "naps [0.2, 0.2, 0.2, 0.2, 0.2] lease reads 5\n" in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
    assert Storage(run_dir).list("rollouts") == []


def test_a_generator_leaves_room_for_eight_of_its_batches_on_a_bucket_and_in_a_folder(s3_bucket, tmp_path):
    """A bucket's batch is 16 prompts (a request each), a folder's 8; --max_ready's default is 8 batches, 128 groups
    and 64. (At 64 on a bucket, fewer than 4 batches ahead, a dapo step that drops a third of its groups waited for
    the generator the lease held back: bench/README.md, "A bucket".)"""
    for run_dir, room in ((f"{s3_bucket}/run-room", "16, 'max_ready': 128"), (str(tmp_path / "run"), "8, 'max_ready': 64")):
        publish_v0(run_dir)
        out = subprocess.run([sys.executable, "generate.py", "--run_dir", run_dir, "--generator_id", "g", "--max_batches",
                              "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert f"'prompts_per_batch': {room}," in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
