"""generate.py: the generation side. Samples G completions per prompt with the adapter RUN/adapters/LATEST names,
scores them and writes a batch's groups as one object in RUN/rollouts/. It shares only the run directory: run any number.

    python generate.py & python train.py                                  # the demo, one CPU machine
    python generate.py --run_dir s3://bucket/run1 --device cuda:0         # one generator per GPU, any machine
    python generate.py --engine http --url http://127.0.0.1:8000 --api_key KEY   # through a server or proxy.py
    python generate.py --engine http --replica_run_dir /mnt/bucket/run1 ...      # vllm serve replicas that mount it"""
import contextlib
import os
import random
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Literal

from minigrpo.run import Metrics, RunSettings, check_model, join_run, lease_view, parse_config, tracker  # torch-free
from minigrpo.tasks import check_turns, make_task, prompt_ids, rollout


@dataclass
class GenerateConfig:
    run_dir: str = field(default="runs/demo", metadata={"help": "the shared run directory: a folder or a URL"})
    replica_run_dir: str = field(default="", metadata={"help": "--engine http: the run directory as replicas see it"})
    engine: Literal["torch", "http"] = field(default="torch", metadata={"help": "http: vLLM or proxy.py"})
    url: str = field(default="http://127.0.0.1:8000", metadata={"help": "--engine http: the server or proxy address"})
    api_key: str = field(default="", metadata={"help": "--engine http: the server's API key (or env MINIGRPO_API_KEY)"})
    max_inflight: int = field(default=64, metadata={"help": "--engine http: most requests in flight at once"})
    generator_id: str = field(default="", metadata={"help": "names this generator's files; default host-pid"})
    prompts_per_batch: int = field(default=0, metadata={"help": "prompts a batch, written as one object (0: 8; 16 on a bucket)"})
    max_ready: int = field(default=0, metadata={"help": "backpressure: most groups left waiting for the trainer (0: 8 batches)"})
    seed: int = field(default=0, metadata={"help": "seed for prompts and sampling (mixed with generator_id)"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda | cuda:N | mps"})
    threads: int = field(default=1, metadata={"help": "CPU threads for torch (1 leaves a core to the trainer)"})
    poll_s: float = field(default=0.02, metadata={"help": "how often to look at LATEST, rollouts/ and DONE while waiting"})
    max_batches: int = field(default=0, metadata={"help": "stop after this many batches (0: until DONE)"})
    lockstep: bool = field(default=False, metadata={"help": "synchronous GRPO (exact with --loss_type grpo)"})
    report_to: Literal["none", "trackio", "wandb"] = field(default="none", metadata={"help": "also log to a tracker"})
    tracker_project: str = field(default="minigrpo", metadata={"help": "--report_to: the tracker's project"})


if __name__ == "__main__":  # --help, a bad flag, task or model: answered before torch loads (3-8 s); main() uses the task
    checked_task = make_task(check_model(parse_config(RunSettings, GenerateConfig)[0]))

import torch
from transformers import AutoTokenizer

from minigrpo.adapters import AdapterStore
from minigrpo.engine import SamplingParams, TorchEngine
from minigrpo.lora import inject_lora
from minigrpo.model import load_model, pick_device, resolve_model, stop_token_ids
from minigrpo.remote import HttpEngine, ServerError
from minigrpo.rollouts import Group, RolloutBuffer
from minigrpo.storage import Storage


def waiting_groups(buffer: RolloutBuffer, watch: dict, writer: str, written: int, batch: int) -> tuple[int, dict]:
    """(groups waiting once this generator writes its next batch, the lease). A live lease (unchanged for less than its
    timeout on this clock: watch) says what waited at the trainer's last listing, each writer's last object listed and
    the N writers, each taking 1/N of --max_ready; 0 while the trainer wants more. Else, or before it listed ours: rollouts/."""
    raw = None
    with contextlib.suppress(FileNotFoundError, ValueError):
        raw = buffer.storage.get("owner.json")
    watch |= {"raw": raw, "since": time.monotonic()} if raw != watch.get("raw") else {}
    lease = lease_view(raw)
    watch["live"] = raw is not None and time.monotonic() - watch["since"] <= lease["timeout_s"]  # a trainer runs the run
    unseen, n = written - 1 - lease["seen"].get(writer, -1), lease["writers"] + (writer not in lease["seen"])
    if not watch["live"] or lease["waiting"] < 0 or unseen and writer not in lease["seen"]:
        listed = buffer.listed()  # consumed objects too, until garbage collection: it errs on the safe side
        n = len({oid.rsplit("-", 1)[0] for oid in listed} | {writer})
        return 0 if len(listed) * batch < lease["groups_per_step"] else (len(listed) + n) * batch, lease
    return 0 if not unseen and lease["waiting"] < lease["groups_per_step"] else lease["waiting"] + n * (unseen + 1) * batch, lease


def main(task=None):  # task: the one the __main__ block checked, else built here
    run, cfg = parse_config(RunSettings, GenerateConfig)
    gen_id = cfg.generator_id or f"{socket.gethostname()}-{os.getpid()}"
    writer = f"{gen_id}-{uuid.uuid4().hex[:16]}"  # this life's name: a restart never rewrites an old group
    storage, task = Storage(cfg.run_dir), task or make_task(run)  # a bad task setting stops it before it waits for run.json
    cfg.prompts_per_batch = cfg.prompts_per_batch or (8 if storage.local else 16)  # a bucket bills each request
    cfg.max_ready = cfg.max_ready or 8 * cfg.prompts_per_batch  # room for a step's groups and more, whatever the batch
    if storage.exists("DONE"):
        raise SystemExit(f"{cfg.run_dir} is a finished run ({storage.url('DONE')} exists): pass another --run_dir.")
    meta, poll_s = join_run(storage, run), max(cfg.poll_s, storage.poll_s)  # a bucket charges per request: look less often
    torch.set_num_threads(cfg.threads)
    rng = random.Random(f"{cfg.seed}-{gen_id}")
    if cfg.engine == "torch":  # only the torch engine holds the model here; the http engine needs just the tokenizer
        model, tokenizer = load_model(run.model, pick_device(cfg.device), run.generator_dtype)
        inject_lora(model, run.lora_r, run.lora_alpha, run.lora_targets)
        engine = TorchEngine(model, stop_token_ids(model, tokenizer), tokenizer.pad_token_id, rng.getrandbits(63))
    else:
        tokenizer = AutoTokenizer.from_pretrained(folder := resolve_model(run.model))
        api_key = cfg.api_key or os.environ.get("MINIGRPO_API_KEY", "")
        engine = HttpEngine(cfg.url, api_key, cfg.max_inflight, run.max_staleness + 1, model=folder)
    check_turns(tokenizer, run)  # --max_turns: a template that rewrites earlier turns is refused
    sampling = SamplingParams(n=run.group_size, max_tokens=run.max_new_tokens, temperature=run.temperature)
    buffer, store = RolloutBuffer(storage, meta["run_id"]), AdapterStore(storage, meta["run_id"])
    shown = asdict(cfg) | {"api_key": "***" if cfg.api_key else ""}  # a secret: neither printed nor tracked
    metrics = Metrics(storage, f"generate-{gen_id}", tracker(cfg.report_to, cfg.tracker_project,
                      f"{meta['run_id']}-generate-{gen_id}", asdict(run) | shown))
    print(f"generator {gen_id} ({cfg.engine} engine): {cfg.prompts_per_batch} prompts x G={run.group_size} = "
          f"{cfg.prompts_per_batch * run.group_size} completions per batch\n  {asdict(run)}\n  {shown}", flush=True)

    if meta.get("grader") and meta["grader"] != task.grader:  # rewards from two graders would mix in one run
        raise SystemExit(f"this generator grades with {task.grader}, the run with {meta['grader']}: install the same")
    watch = {"raw": None, "since": time.monotonic()}  # while the lease is live, no look for DONE (2 requests on S3)
    batch, idle_since, skipped, made, waiting, grow, read_at, shown = 0, time.time(), set(), {}, 0, 0, 0.0, 0.0
    while (not cfg.max_batches or batch < cfg.max_batches) and (watch.get("live") or not storage.exists("DONE")):
        if watch.get("live") and time.monotonic() - read_at < poll_s and waiting + grow <= cfg.max_ready:
            waiting += grow  # a live lease read within a poll, with room: count this batch, not read it again (a request)
        else:
            waiting, lease = waiting_groups(buffer, watch, writer, batch, cfg.prompts_per_batch)
            grow, read_at = (lease["writers"] + 1) * cfg.prompts_per_batch, time.monotonic()  # errs high: N + 1 writers
        newest = lambda: lease["version"] if watch["live"] and lease["version"] >= 0 else store.latest()  # a live lease: no GET
        if waiting > cfg.max_ready or (cfg.lockstep and made.get(engine.version, 0) >= lease["groups_per_step"]
                                       and (newest() or 0) <= engine.version):
            time.sleep(poll_s)  # held back: look again in a poll (on a bucket each look is a request)
            continue
        backpressure_s, t0 = time.time() - idle_since, time.time()
        if (latest := newest()) is not None and latest != engine.version and latest not in skipped:
            path = f"{cfg.replica_run_dir.rstrip('/') or storage.url()}/adapters/{store.name(latest)}"
            try:
                engine.load_adapter(latest, path)
            except (OSError, ValueError, KeyError) as e:  # incomplete or damaged: keep the old one
                skipped.add(latest)
                print(f"generator {gen_id}: cannot load {path} ({type(e).__name__}: {e}); skipped", flush=True)
        if engine.version is None:  # no version could be loaded yet: wait for the next one (not backpressure)
            idle_since = time.time()
            time.sleep(poll_s)
            continue

        sync_s, problems = time.time() - t0, [task.sample(rng) for _ in range(cfg.prompts_per_batch)]
        prompts = [prompt_ids(tokenizer, task.reset(p), run.system_prompt) for p in problems]
        started, version = time.time(), engine.version  # one version: no adapter loads between a conversation's turns
        (completions, rewards), gen_s = rollout(engine, tokenizer, task, problems, prompts, sampling, run), time.time() - started
        groups = [Group(prompt_ids=prompt, completion_ids=[c.token_ids for c in group], loss_mask=[c.mask for c in group],
            rewards=r, behavior_logprobs=[c.logprobs for c in group], truncated=[c.finish_reason == "length" for c in group],
            policy_version=version, temperature=run.temperature, adapter_digest=group[0].adapter_digest, started_at=started,
            finished_at=time.time(), grader=task.grader) for prompt, group, r in zip(prompts, completions, rewards)]
        buffer.write(groups, writer, seq=batch)  # one object: rollouts/<writer>-<batch>.safetensors
        batch, made[version] = batch + 1, made.get(version, 0) + len(prompts)

        n_tok, flat = sum(sum(c.mask) for g in completions for c in g), [x for r in rewards for x in r]  # sampled
        record = {"batch": batch, "generator": gen_id, "policy_version": version, "reward/mean": sum(flat) / len(flat),
                  "completions/mean_length": n_tok / len(flat), "rollout/generated_tok_s": n_tok / gen_s,
                  "rollout/backpressure_s": backpressure_s, "perf/weight_sync_s": sync_s, "perf/generate_s": gen_s,
                  "adapters_skipped": len(skipped), "time": time.time()}
        shown = time.time() if (due := time.time() - shown >= 5) else shown  # a line every 5 s; each batch's record: metrics/
        metrics.log(record, f"gen {gen_id} batch {batch} | v{version} | reward {record['reward/mean']:.3f} | "
                    f"{n_tok / gen_s:.0f} tok/s | backpressure {backpressure_s:.2f}s" if due else None)
        idle_since = time.time()
    print(f"generator {gen_id} stopped after {batch} batches", flush=True)
    metrics.finish()


if __name__ == "__main__":
    try:
        main(checked_task)
    except (ServerError, OSError) as e:  # a server that stayed unreachable, a full disk, a refused bucket
        raise SystemExit(f"generate.py: {e}\nEvery group it finished is intact; fix the problem and start it again.")
    except KeyboardInterrupt:  # Ctrl-C, also on `(python generate.py & python train.py)`: one line, no traceback
        raise SystemExit("generate.py: interrupted; every group it finished is intact")
