"""Weight sync: seconds from the trainer publishing an adapter version (files in the run directory) to every
replica serving it, through the proxy (POST /v1/load_lora_adapter broadcast, then a completion on the new name),
with two local minigrpo replicas of the demo model, for rank 1 and rank 16.

    python bench/bench_weight_sync.py      # ~1 minute
"""
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from common import ROOT, report
from minigrpo.adapters import AdapterStore
from minigrpo.engine import SamplingParams
from minigrpo.lora import DEFAULT_TARGETS, adapter_config, inject_lora, lora_state_dict
from minigrpo.model import load_model
from minigrpo.remote import HttpEngine

if __name__ == "__main__":
    run_dir, ports = tempfile.mkdtemp(prefix="bench-sync-"), [18201, 18202, 18200]
    procs = [subprocess.Popen([sys.executable, "-m", "minigrpo.serve", "--port", str(p), "--max_lora_rank", "16"], cwd=ROOT,
                              stdout=subprocess.DEVNULL) for p in ports[:2]]
    procs.append(subprocess.Popen([sys.executable, "proxy.py", "--port", str(ports[2]), "--no_auth",
                                   *[a for p in ports[:2] for a in ("--upstream", f"http://127.0.0.1:{p}")]], cwd=ROOT,
                                  stdout=subprocess.DEVNULL))
    try:
        engine = HttpEngine(f"http://127.0.0.1:{ports[2]}", keep=3)
        engine.wait_ready(timeout_s=120)
        store, rows, version = AdapterStore(run_dir), [], 0
        for r in (1, 16):
            model, _ = load_model("demo", torch.device("cpu"))
            inject_lora(model, r, 2 * r, DEFAULT_TARGETS)
            config = adapter_config(r, 2 * r, DEFAULT_TARGETS, "demo")
            publish_s, load_s, first_s = [], [], []
            for _ in range(10):
                t0 = time.perf_counter()
                path = store.publish(version, lora_state_dict(model), config, keep=3)
                t1 = time.perf_counter()
                engine.load_adapter(version, path)  # returns once every replica has it
                t2 = time.perf_counter()
                engine.generate([[2, 3, 11, 4, 5, 12]], SamplingParams(max_tokens=1))
                t3 = time.perf_counter()
                publish_s.append(t1 - t0), load_s.append(t2 - t1), first_s.append(t3 - t0)
                version += 1
            kb = sum(v.numel() for v in lora_state_dict(model).values()) * 4 / 1024
            rows.append({"rank": r, "adapter_kb": kb, "publish_ms": 1000 * statistics.median(publish_s),
                         "load_on_both_ms": 1000 * statistics.median(load_s),
                         "publish_to_served_ms": 1000 * statistics.median(first_s)})
        engine.close()
        report("weight_sync", rows, "medians of 10 versions each; publish = write the PEFT directory + LATEST")
    finally:
        for p in procs:
            p.kill()
