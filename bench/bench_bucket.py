"""A bucket run against a local one: the demo (train.py + one generate.py, evaluations off but for the last) on a
folder and on a real S3 server (moto's server mode, on loopback), in turns, --repeats times each.

    python bench/bench_bucket.py --steps 300 --repeats 3                        # bench/results/bucket.json
    python bench/bench_bucket.py --steps 50 --repeats 3 --baseline /tmp/old     # also an older checkout, side by side
    python bench/bench_bucket.py --root /tmp/new ...                            # run another checkout (a snapshot)
    python bench/bench_bucket.py --profile --steps 40                          # where a bucket step's time goes

--profile runs the bucket demo once with moto's request log, counts the requests per training step by kind and the
CPU moto spent, and times single requests (a PUT and a GET of 6 kB, one group, and of 48 kB, eight groups, and a
listing) one after another, with the CPU each costs moto and the client: bench/results/bucket_profile.json.

Reported per target: the wall time of the whole run, the mean step time (evaluation left out) over the first 50 steps
and over the last 50, the mean rollout wait and policy audit a step, and the CPU seconds a step of the trainer, the
generator and moto together (and moto's alone): on 2 cores that sum bounds the step; where the generator's time went,
as shares of the trainer's wall (sampling, held back by --max_ready, loading adapters, the rest: its start-up, each
batch's write and prompts); the stale groups dropped and the last evaluation's accuracy; then each bucket target's
ratio to the folder run of the same turn, our_cpu_s_step being the trainer's and the generator's CPU alone (moto's
left out: a real bucket's server does not share the trainer's cores).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from common import cpu_s, report  # noqa: E402
from conftest import free_port, train_records  # noqa: E402
from minigrpo.run import read_records  # noqa: E402
from minigrpo.storage import Storage  # noqa: E402


def start_moto(log=subprocess.DEVNULL) -> tuple[subprocess.Popen, dict]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    for _ in range(300):
        try:
            urllib.request.urlopen(env["AWS_ENDPOINT_URL"], timeout=2)
            break
        except urllib.error.HTTPError:
            break  # it answers
        except OSError:
            time.sleep(0.2)
    return proc, env


def demo(root: str, run_dir: str, steps: int, env: dict, server: int | None = None) -> dict:
    """One demo run; returns its timings from the trainer's records, and the CPU seconds a step that the trainer, the
    generator and the server (its pid; moto shares this machine's cores) spent over the whole run."""
    env, before = os.environ | env, (resource.getrusage(resource.RUSAGE_CHILDREN), server and cpu_s(server))
    gen = subprocess.Popen([sys.executable, "generate.py", "--run_dir", run_dir], cwd=root, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        t0 = time.time()
        train = subprocess.run([sys.executable, "train.py", "--run_dir", run_dir, "--max_steps", str(steps),
                                "--eval_every", "100000", "--eval_size", "50"], cwd=root, env=env,
                               capture_output=True, text=True, timeout=3600)
        wall = time.time() - t0
        assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
        gen.wait(timeout=300)
    finally:
        gen.kill()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # both processes, reaped
    clients = after.ru_utime + after.ru_stime - before[0].ru_utime - before[0].ru_stime
    moto = cpu_s(server) - before[1] if server else 0.0
    os.environ.update(env)  # train_records reads the bucket through s3fs
    records = train_records(run_dir)
    step_s = [r["perf/step_s"] - r.get("perf/eval_s", 0.0) for r in records]
    dropped = [0] + [sum(r[f"sample/{k}"] for k in ("dropped_stale_total", "dropped_zero_std_total", "bad_total"))
                     for r in records]  # running totals: what a step consumed is what it trained and what it dropped
    groups = [len(r["group_ids"]) + b - a for r, a, b in zip(records, dropped, dropped[1:])]
    batches = read_records(Storage(run_dir), "generate-")  # where the generator's time went, a share of the trainer's wall
    gen = {f"gen_{name}": sum(b[k] for b in batches) / wall for name, k in (("sampling", "perf/generate_s"),
           ("held_back", "rollout/backpressure_s"), ("adapter_load", "perf/weight_sync_s"))}
    last = f"_{max(1, steps - 49)}_{steps}"  # the last 50 steps, against the first 50
    return {"wall_s": wall, "step_s_1_50": statistics.mean(step_s[:50]), f"step_s{last}": statistics.mean(step_s[-50:]),
            "groups_1_50": statistics.mean(groups[:50]), f"groups{last}": statistics.mean(groups[-50:]),
            "wait_s": statistics.mean(r["perf/rollout_wait_s"] for r in records),
            "audit_s": statistics.mean(r.get("perf/audit_s", 0.0) for r in records),  # an older checkout's: 0, in wait_s
            "cpu_s_step": (clients + moto) / steps, "server_cpu_s_step": moto / steps, "gen_batches": len(batches), **gen,
            "gen_other": 1 - sum(gen.values()),  # gen_*: shares of the wall; other: start-up, each batch's write and prompts
            "stale_total": records[-1]["sample/dropped_stale_total"], "accuracy": records[-1].get("eval/accuracy", float("nan"))}


def summary(runs: list[dict]) -> dict:
    out = {}
    for k in runs[0]:
        values = [r[k] for r in runs]
        out[k] = f"{statistics.mean(values):.2f} ± {statistics.stdev(values) if len(values) > 1 else 0:.2f}"
    return out


def table(runs: dict, steps: int) -> list[dict]:
    """A row a target; then each bucket target's runs against the folder run of their turn: as a ratio, and the extra
    step time a consumed group (did a step cost more late because it did more, or because each look cost more?)."""
    rows, local = [{"target": name, "steps": steps, "runs": len(r), **summary(r)} for name, r in runs.items()], runs["local"]
    for name, r in runs.items():
        if name != "local":
            rows.append({"target": f"{name} / local", "steps": steps, "runs": len(r), **summary(
                [{k: v / local[i][k] for k, v in run.items() if k not in ("wait_s", "audit_s", "server_cpu_s_step")
                  and not k.startswith(("groups", "gen_", "stale", "acc"))}  # and the CPU of ours, moto's left out:
                 | {"our_cpu_s_step": (run["cpu_s_step"] - run["server_cpu_s_step"]) / local[i]["cpu_s_step"]}
                 for i, run in enumerate(r)])})
            rows.append({"target": f"{name} - local, ms a group", "steps": steps, "runs": len(r), **summary(
                [{f"extra_ms_group{k[6:]}": 1000 * (v - local[i][k]) / run[f"groups{k[6:]}"] for k, v in run.items()
                  if k.startswith("step_s")} for i, run in enumerate(r)])})  # step_s_1_50 -> groups_1_50
    return rows


def profile(steps: int):
    """One bucket demo with moto's request log: requests per step by kind; then single requests, timed."""
    import re
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/moto.log", "w") as log:
            moto, env = start_moto(log)
        try:
            os.environ.update(env)
            import boto3
            boto3.client("s3").create_bucket(Bucket="bench-profile")
            moto_cpu = cpu_s(moto.pid)
            timing = demo(str(ROOT), "s3://bench-profile/run", steps, env)
            moto_cpu = cpu_s(moto.pid) - moto_cpu
            counts = {}
            for method, path in re.findall(r'"(GET|PUT|HEAD|POST|DELETE) (\S+) HTTP',  # colours stripped (werkzeug paints 206s, 404s)
                                          re.sub(r"\x1b\[[\d;]*m", "", open(f"{tmp}/moto.log").read())):
                key = path.split("?")[0].removeprefix("/bench-profile").removeprefix("/run").strip("/")
                listed = re.search(r"prefix=([^&]*)", path)  # the prefix listed: run/rollouts/ -> rollouts/
                listed = listed and urllib.parse.unquote(listed[1]).removeprefix("run/").split("/")[0] + "/"
                kind = f"a listing of {listed or '?'}" if "list-type" in path else "delete (batched)" if method == "POST" else \
                    f"{method} {key.split('/')[0] + ('/*' if '/' in key else '')}"
                counts[kind] = counts.get(kind, 0) + 1
            store, small, big, timed = Storage("s3://bench-profile/timing"), os.urandom(6000), os.urandom(48000), {}
            for what, call in [("PUT 6 kB", lambda i: store.put(f"x/{i}", small)), ("GET 6 kB", lambda i: store.get(f"x/{i}")),
                               ("PUT 48 kB", lambda i: store.put(f"y/{i}", big)), ("GET 48 kB", lambda i: store.get(f"y/{i}")),
                               ("list 50 names", lambda i: store.list("x"))]:
                times, cpu, n = [], (cpu_s(moto.pid), cpu_s()), 50
                for i in range(n):
                    t0 = time.perf_counter()
                    call(i)
                    times.append(time.perf_counter() - t0)
                timed[what] = f"{statistics.median(times) * 1000:.1f} ms (min {min(times) * 1000:.1f}); CPU " \
                              f"{(cpu_s(moto.pid) - cpu[0]) * 1000 / n:.1f} ms moto, {(cpu_s() - cpu[1]) * 1000 / n:.1f} ms client"
        finally:
            moto.kill()
    rows = [{"requests": k, "per step": round(v / steps, 1)} for k, v in sorted(counts.items(), key=lambda kv: -kv[1])
            if v / steps >= 0.1]  # the rest: the run's start and end
    rows += [{"requests": "all", "per step": round(sum(counts.values()) / steps, 1)}]
    rows += [{"requests": f"the run's mean {k}", "per step": f"{timing[k]:.2f} s"} for k in ("step_s_1_50", "wait_s")]
    rows += [{"requests": "moto's CPU over the run", "per step": f"{moto_cpu / steps:.2f} s ({moto_cpu / timing['wall_s']:.0%} of a core)"}]
    rows += [{"requests": f"one {k}, alone", "per step": v} for k, v in timed.items()]
    report("bucket_profile", rows, notes=f"python bench/bench_bucket.py --profile --steps {steps}: requests moto logged "
           "during the run, over its steps; then single requests one after another, median of 50 (CPU: their mean)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", default=str(ROOT), help="the checkout to run")
    parser.add_argument("--baseline", default="", help="another checkout to run on the bucket too (before a change); "
                        "several: DIR,DIR (their targets: 's3 DIR's name')")
    parser.add_argument("--name", default="bucket")
    parser.add_argument("--profile", action="store_true", help="count and time a bucket run's requests instead")
    parser.add_argument("--again", default="", help="a results file of this bench: its table again, from its runs")
    args = parser.parse_args()
    if args.again:
        stored = json.load(open(args.again))
        report(args.name, table(stored["runs"], stored["rows"][0]["steps"]), extra={"runs": stored["runs"]},
               notes=stored["notes"].split(" [")[0] + " [this table: --again]")
        raise SystemExit
    if args.profile:
        raise SystemExit(profile(args.steps))
    moto, env = start_moto()
    import boto3
    targets = {"local": (args.root, False), "s3": (args.root, True)}
    for other in filter(None, args.baseline.split(",")):
        targets["s3 baseline" if "," not in args.baseline else f"s3 {os.path.basename(other.rstrip('/'))}"] = (other, True)
    runs = {k: [] for k in targets}
    try:
        for i in range(args.repeats):
            for name, (root, bucket) in targets.items():  # in turns: machine noise hits every target alike
                with tempfile.TemporaryDirectory() as tmp:
                    if bucket:
                        b = f"bench-{uuid.uuid4().hex[:8]}"
                        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                                     aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket=b)
                        run_dir = f"s3://{b}/run"
                    else:
                        run_dir = os.path.join(tmp, "run")
                    runs[name].append(demo(root, run_dir, args.steps, env if bucket else {}, moto.pid if bucket else None))
                print(name, i, json.dumps(runs[name][-1]), flush=True)
    finally:
        moto.kill()
    report(args.name, table(runs, args.steps), notes=f"mean ± sd over {args.repeats} runs each, in turns; step_s "
           "excludes evaluation; groups: consumed a step (trained, dropped as stale or zero-std, quarantined); ms a "
           f"group: the bucket's extra step time over them. Command: python bench/bench_bucket.py --steps {args.steps} "
           f"--repeats {args.repeats}" + (" --baseline DIR" if args.baseline else ""), extra={"runs": runs})
