"""Shared by the benchmarks: timing, a printed table, and a JSON file under bench/results/."""
import json
import os
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def timed(fn, iters: int = 5, warmup: int = 1) -> float:
    """Median seconds of fn() over iters runs, after warmup runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_together(fns: dict, iters: int = 5, warmup: int = 1) -> dict:
    """Median seconds of each fn, run in turns (a, b, a, b, ...) so that machine noise hits all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def cpu_s(pid: "int | str" = "self") -> float:
    """User + system CPU seconds of a process so far, this one by default (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def report(name: str, rows: list[dict], notes: str = "", extra: dict | None = None) -> str:
    """Print rows as a table and write them to bench/results/<name>.json (with `extra`, e.g. per-run data)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    widths = [max(len(k), *(len(fmt(r.get(k, ""))) for r in rows)) for k in keys]
    print(f"\n== {name} ==")
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(k, "")).ljust(w) for k, w in zip(keys, widths)))
    if notes:
        print(notes)
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    path = os.path.join(ROOT, "bench", "results", f"{name}.json")
    with open(path, "w") as f:
        json.dump({"rows": rows, "notes": notes, **(extra or {}), "time": time.time()}, f, indent=2)
    return path


def generate_and_train(run_dir: str, gen: list, train: list, env: dict) -> tuple[list[dict], dict]:
    """One generator command beside one trainer command on run_dir until the trainer is done (their output in
    run_dir.gen.log and run_dir.train.log): the trainer's step records and its held-out accuracy by step, 0 included."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import train_records
    from minigrpo.run import read_records
    from minigrpo.storage import Storage
    with open(run_dir + ".train.log", "w") as tlog, open(run_dir + ".gen.log", "w") as glog:
        g = subprocess.Popen(gen, cwd=ROOT, stdout=glog, stderr=subprocess.STDOUT, env=env)
        try:
            rc = subprocess.run(train, cwd=ROOT, stdout=tlog, stderr=subprocess.STDOUT, env=env).returncode
        finally:
            g.kill()
            g.wait()
    assert rc == 0, open(run_dir + ".train.log").read()[-3000:]
    steps = train_records(run_dir)
    step0 = [r for r in read_records(Storage(run_dir), "train") if r.get("step") == 0][-1]
    return steps, {0: step0["eval/accuracy"]} | {r["step"]: r["eval/accuracy"] for r in steps if "eval/accuracy" in r}


def stop_all(procs, logs):
    """Kill what is still running of a run's processes (each started in a session of its own, so that this ends
    exactly them and their children) and close their logs."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    for log in logs:
        log.close()


def score(task, tokenizer, problems, completions) -> list[list[float]]:
    """Rewards for completions[i][j], the j-th sample for problems[i] (special tokens such as EOS stripped): one turn,
    as minigrpo.tasks.rollout scores it with --max_turns 1."""
    return [[task.reward(tokenizer.decode(c.token_ids, skip_special_tokens=True), p.answer) for c in group]
            for p, group in zip(problems, completions)]
