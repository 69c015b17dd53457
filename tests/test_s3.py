"""The whole demo on a real S3 server: moto's server mode on loopback (what s3fs's own tests use), reached the
standard way (AWS_ENDPOINT_URL and friends). Generator and trainer share nothing but s3://bucket/run.

    python -m pytest -q tests/test_s3.py
"""
import subprocess
import sys

from conftest import ROOT, train_records

from minigrpo.rollouts import read_group
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
    storage = Storage(run_dir)
    assert storage.exists("DONE") and storage.list("checkpoints") == ["step-000015-e000001", "step-000020-e000001"]
    latest = storage.get("adapters/LATEST").decode().strip()
    assert storage.exists(f"adapters/{latest}/adapter_model.safetensors")
    for name in storage.list("rollouts"):  # what is left was never trained, and is whole
        assert name.removesuffix(".safetensors") not in ids
        read_group(storage.get(f"rollouts/{name}"), name.removesuffix(".safetensors"))


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
    with pytest.raises(FileNotFoundError):
        storage.get("absent")
