"""train.py: the training side of minigrpo.

Reads scored groups from RUN/rollouts/, computes GRPO on the LoRA weights only, and publishes a new adapter version
into RUN/adapters/ every --sync_every steps. The run directory is the only thing it shares with the generators.

    python generate.py & python train.py                # the demo on a laptop CPU, a few minutes
    python train.py --run_dir s3://bucket/run1 ...      # any machine that reaches the bucket (or a shared folder)
    torchrun --nproc_per_node 4 train.py ...            # data-parallel on 4 GPUs (rank 0 reads and publishes)
    (killed? run the same command again: it resumes from the newest intact checkpoint in RUN/checkpoints/)

Where it departs from the GRPO paper, on purpose: old_logp is the generator's log-prob of each token (TRL's AsyncGRPO;
--old_logp recompute: these weights, detached, with truncated importance sampling against mu); one optimizer step a
batch, no PPO epochs; no reference model, no KL (DAPO, Dr. GRPO); stale groups are dropped whole, never reweighted."""
import math
import os
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from functools import partial
from typing import Literal

from minigrpo.run import Lease, LossConfig, Metrics, RunSettings, check_model, create_run, fault, parse_config, tracker  # torch-free
from minigrpo.tasks import check_turns, make_task, prompt_ids, rollout


@dataclass
class TrainConfig(LossConfig):  # the loss's flags (loss_type, eps_low, eps_high, tis_cap) come first
    run_dir: str = field(default="runs/demo", metadata={"help": "the shared run directory: a folder, s3://, gs://, hf://"})
    max_steps: int = field(default=250, metadata={"help": "optimizer steps in the whole run"})
    groups_per_step: int = field(default=32, metadata={"help": "groups (prompts) per optimizer step; x G = completions"})
    lr: float = field(default=3e-3, metadata={"help": "AdamW learning rate on the LoRA weights"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping by global norm"})
    old_logp: Literal["behavior", "recompute"] = field(default="behavior", metadata={
        "help": "pi_old: the generator's log-probs (behavior) or the current weights (recompute)"})
    sync_every: int = field(default=1, metadata={"help": "publish a new adapter version every N steps"})
    save_every: int = field(default=25, metadata={"help": "checkpoint every N steps (resume point)"})
    eval_every: int = field(default=50, metadata={"help": "pass@1 on the held-out set every N steps, and at step 0"})
    eval_size: int = field(default=400, metadata={"help": "held-out problems per evaluation"})
    micro_batch_tokens: int = field(default=4096, metadata={"help": "packed tokens per forward/backward micro-batch"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations in backward: less memory"})
    seed: int = field(default=0, metadata={"help": "seed for the LoRA init and the evaluation samples"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda | mps (torchrun: cuda:LOCAL_RANK)"})
    collective_timeout_s: float = field(default=600.0, metadata={"help": "torchrun: the gradient all-reduce's timeout"})
    eval_batch_tokens: int = field(default=2**20, metadata={"help": "held-out rows x (longest prompt + max_new_tokens) "
                                   "sampled at once: bounds the KV cache (2^20: about 30 GB for a 1.5B Qwen2 in bf16)"})
    policy_check_tol: float = field(default=0.01, metadata={"help": "mean |log pi - log mu| per token under the weights "
                                    "a group names past which it was sampled with others (float32; bf16: x10, mixed: x30)"})
    dtype: Literal["float32", "bfloat16"] = field(default="float32", metadata={"help": "base weights (LoRA, loss: "
                                                  "float32); no float16: without loss scaling its gradients underflow"})
    threads: int = field(default=1, metadata={"help": "CPU threads for torch (1 leaves a core to the generator)"})
    wait_timeout_s: float = field(default=600.0, metadata={"help": "fail if no group to learn from arrives this long"})
    lease_timeout_s: float = field(default=60.0, metadata={"help": "another trainer takes the run over once the "
                                   "owner's heartbeat (RUN/owner.json) is this old, or at once if it died on this host"})
    allow_new_settings: bool = field(default=False, metadata={"help": "resume with other training settings (lr, ...)"})
    report_to: Literal["none", "trackio", "wandb"] = field(default="none", metadata={"help": "also log to a tracker"})
    tracker_project: str = field(default="minigrpo", metadata={"help": "--report_to: the tracker's project"})


if __name__ == "__main__":  # --help, a bad flag, task or model: answered before torch loads (3-8 s); main() uses the task
    checked_task = make_task(check_model(parse_config(RunSettings, TrainConfig)[0]))

import torch
import torch.distributed as dist

from minigrpo.adapters import AdapterStore
from minigrpo.checkpoint import load_checkpoint, prune_checkpoints, save_checkpoint
from minigrpo.engine import SamplingParams, TorchEngine
from minigrpo.grpo import advantages, combine_metrics, grpo_loss, zero_std_groups
from minigrpo.lora import adapter_config, inject_lora, load_lora_state_dict, lora_state_dict
from minigrpo.model import FLAG_DEVICES, load_model, packed_logprobs, pick_device, resolve_model, stop_token_ids
from minigrpo.packing import Sample, collate, micro_batches
from minigrpo.rollouts import Ledger, RolloutBuffer, check_group
from minigrpo.storage import Storage


def take_batch(buffer, ledger, lease, cfg, run, version, validate, audit, stats):
    """(groups_per_step fresh groups that passed the audit, those it quarantined, s waiting, s auditing). Stale, caught and
    (dapo) zero-std groups are consumed and counted; each 5 polls waited, the lease says what waits and asks one more a drop."""
    t0, last_seen, told, groups, caught, taken_n, said, audit_s = time.time(), time.time(), time.time(), [], [], 0, 0, 0.0
    while len(groups) < cfg.groups_per_step:
        taken = buffer.take(cfg.groups_per_step - len(groups), ledger, validate, stats)
        taken_n, kept = taken_n + len(taken), len(groups)
        recent = [g for g in taken if run.is_fresh(version, g.policy_version)]
        fresh = [g for g in recent if cfg.loss_type != "dapo" or len(set(g.rewards)) != 1]  # dapo, zero std: no signal
        stats["dropped_stale_total"] += len(taken) - len(recent)
        stats["dropped_zero_std_total"] += len(recent) - len(fresh)
        audit_s -= time.time()  # compute, not waiting: perf/audit_s, apart from perf/rollout_wait_s
        for g, gap, tol in (lies := audit(fresh)):
            buffer.quarantine(g.group_id, g, f"PolicyMismatch: policy_version: v{g.policy_version}'s "
                              f"weights give a mean |log pi - log mu| of {gap:.4f} a token (tolerance {tol:g})", stats)
        caught, lied, audit_s = caught + [g for g, *_ in lies], {id(g) for g, *_ in lies}, audit_s + time.time()
        groups += [g for g in fresh if id(g) not in lied]
        if len(groups) > kept:  # one to learn from: a dapo policy that gets every sample alike right or wrong has none
            last_seen, said = time.time(), 0
        elif (waited := time.time() - last_seen) > min(cfg.wait_timeout_s, min(20, cfg.wait_timeout_s / 2) + 60 * said):
            why = ", ".join(f"{n} {k}" for k, n in buffer.reasons.most_common()) or "none (is generate.py running?)"
            where, said = buffer.storage.url("rollouts"), said + 1  # said at 20 s (or half the timeout), then each minute
            if waited > cfg.wait_timeout_s:
                raise SystemExit(f"no fresh group to learn from (dapo: unequal rewards) in {where} for "
                                 f"{cfg.wait_timeout_s:.0f}s. Consumed: {why} {stats}")
            print(f"waited {waited:.0f}s for a fresh group in {where}; consumed: {why} {stats}", flush=True)
        time.sleep(0 if taken else min(buffer.storage.poll_s, 0.05))  # nothing new: look again soon (a miss is cheap)
        if len(groups) < cfg.groups_per_step and time.time() - told > 5 * buffer.storage.poll_s:  # backpressure
            lease.write(wait=False, **buffer.progress(lease.timeout_s), groups_per_step=cfg.groups_per_step + taken_n - len(groups))
            told = time.time()
    return groups, caught, time.time() - t0 - audit_s, audit_s


def build_samples(groups, run, cfg):  # one Sample per completion, with its group-normalised advantage
    rewards = torch.tensor([r for g in groups for r in g.rewards])  # (N*G,)
    lengths = torch.tensor([len(c) for g in groups for c in g.completion_ids])  # (N*G,)
    adv = iter(advantages(rewards, run.group_size, scale_rewards=cfg.loss_type != "dr_grpo").tolist())  # (N*G,)
    return [Sample(g.prompt_ids + c, len(g.prompt_ids), lp, next(adv), m)
            for g in groups for c, lp, m in zip(g.completion_ids, g.behavior_logprobs, g.loss_mask)], rewards, lengths


def policy_tol(cfg, run) -> float:  # bf16 rounds more: honest max gaps f32 9e-7, bf16 6e-3, mixed 0.03 (bench_honest_gap)
    return cfg.policy_check_tol * (30 if cfg.dtype != run.generator_dtype else 1 if cfg.dtype == "float32" else 10)


def audit(model, groups, weights_of, run, cfg, device) -> list:
    """(group, mean |log pi - log mu| a token, tolerance) for each group too far from the weights of the version it
    names: its sampler did not apply them (a base-model replica, a stale LoRA). No gradient; the weights are restored."""
    if (tol := policy_tol(cfg, run)) <= 0 or not groups:
        return []
    current, caught = {k: v.clone() for k, v in lora_state_dict(model).items()}, []
    for v in sorted({g.policy_version for g in groups}):
        if (weights := weights_of(v)) is None:  # gone with retention: nothing to compare with
            continue
        load_lora_state_dict(model, weights)
        samples = build_samples(mine := [g for g in groups if g.policy_version == v], run, cfg)[0]
        owner, gap = {id(s): i // run.group_size for i, s in enumerate(samples)}, torch.zeros(len(mine), device=device)
        with torch.no_grad():
            for mb in micro_batches(samples, cfg.micro_batch_tokens):
                inputs, batch = collate(mb, device)
                logp = packed_logprobs(model, *inputs, run.temperature)[0]  # (b, T)
                sums = ((logp - batch.behav).abs() * batch.mask).sum(1)  # (b,) each sample's summed gap
                gap.index_add_(0, torch.tensor([owner[id(s)] for s in mb], device=device), sums)
        caught += [(g, s / n, tol) for g, s in zip(mine, gap.tolist()) if s > tol * (n := sum(map(sum, g.loss_mask)))]
    load_lora_state_dict(model, current)
    return caught


def train_step(model, optimizer, samples, run, cfg, device, rank=0, world=1):
    """Forward/backward over this rank's packed micro-batches with the whole batch's normaliser, then one AdamW step."""
    num_tokens = sum(sum(s.mask) for s in samples)  # sampled tokens of the whole batch, on every rank
    mbs, parts = micro_batches(samples, cfg.micro_batch_tokens)[rank::world], []  # largest first, dealt out in turn
    model.train(cfg.gradient_checkpointing)  # transformers checkpoints only in train mode (no dropout in these models)
    for mb in mbs:
        inputs, batch = collate(mb, device, len(samples), num_tokens)
        logp, entropy = packed_logprobs(model, *inputs, run.temperature)  # (b, T) each
        if cfg.old_logp == "recompute":  # pi_old = these weights: ratio 1, no clip; the IS weight is the control
            batch.old = logp.detach()
        loss, m = grpo_loss(logp, batch, cfg, run.max_new_tokens)
        loss.backward()
        parts.append(m | {"entropy": (entropy * batch.mask).sum() / m["tokens"].clamp(min=1), "loss": loss.detach()})
    model.eval()  # and the engine needs eval mode for its KV cache
    params = [p for p in model.parameters() if p.requires_grad]
    if world > 1:  # every rank ends with the whole batch's gradient and metrics, so every optimizer takes the same step
        flat = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in params])  # None: no share
        dist.all_reduce(flat)  # one collective for all LoRA tensors, not one each (hundreds a step)
        for p, grad in zip(params, flat.split([p.numel() for p in params])):
            p.grad = grad.view_as(p)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
    host = iter(torch.stack([grad_norm.double(), *(v.double() for m in parts for v in m.values())]).tolist())  # the one read
    grad_norm, parts = next(host), [{k: next(host) for k in m} for m in parts]  # a dict iterates as it did above
    if world > 1:  # every rank's micro-batches
        dist.all_gather_object(every := [None] * world, parts)
        parts = [m for mine in every for m in mine]
    loss_sum = sum(m.pop("loss") for m in parts)
    if finite := math.isfinite(loss_sum) and math.isfinite(grad_norm):  # alike on every rank; else every weight turns NaN
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return combine_metrics(parts) | {"loss": loss_sum, "grad_norm": grad_norm, "perf/micro_batches": len(mbs),
                                     "train/skipped_nonfinite": int(not finite)}


def distributed(device: str, timeout_s: float):
    """(rank, world size, this rank's device (a GPU rank binds to cuda:LOCAL_RANK before it joins), and the gloo group,
    with no deadline, in which the others wait for rank 0's batch while it works alone: NCCL times only all-reduces)."""
    world, local, device = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)), pick_device(device)
    if world == 1:
        return 0, 1, device, None
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise SystemExit(f"torchrun started local rank {local}, but {torch.cuda.device_count()} GPUs are visible: "
                             f"--nproc_per_node must be at most that (or set CUDA_VISIBLE_DEVICES)")
        torch.cuda.set_device(device := torch.device("cuda", local))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    return dist.get_rank(), world, device, dist.new_group(backend="gloo", timeout=timedelta(days=365))


def share(obj, group):  # rank 0's object on every rank (the batch of samples: kilobytes to megabytes of token ids)
    if group is not None:
        dist.broadcast_object_list(box := [obj], src=0, group=group)
    return obj if group is None else box[0]


def evaluate(engine, tokenizer, task, problems, run, seed, batch_tokens, rank=0, world=1, group=None) -> float:
    """pass@1 at the run's temperature on a fixed held-out set (--max_turns: a whole conversation's reward), at most
    batch_tokens KV-cache tokens at once. Problem i has its own seed: the same draws in any batch, rank and evaluation."""
    ids, mine = range(rank, len(problems), world), problems[rank::world]
    prompts = [prompt_ids(tokenizer, task.reset(p), run.system_prompt) for p in mine]
    batch_size = max(1, batch_tokens // (max(map(len, prompts), default=0) + run.max_new_tokens))
    params = [SamplingParams(max_tokens=run.max_new_tokens, temperature=run.temperature, seed=seed * 1_000_003 + i) for i in ids]
    scores = [r[0] for i in range(0, len(prompts), batch_size) for r in rollout(
        engine, tokenizer, task, mine[i:i + batch_size], prompts[i:i + batch_size], params[i:i + batch_size], run)[1]]
    if world > 1:  # every rank's scores, back in problem order: the same sum as one process's
        dist.all_gather_object(every := [None] * world, scores, group=group)
        scores = [every[i % world][i // world] for i in range(len(problems))]
    return sum(scores) / len(problems)


def finite_weights(model) -> dict:  # the LoRA tensors to publish or save
    state = lora_state_dict(model)
    if bad := [k for k, v in state.items() if not torch.isfinite(v).all()]:
        raise SystemExit(f"the LoRA weights hold NaN or infinite values ({bad[0]}): nothing more is published or "
                         f"saved; run the same command to resume from the last checkpoint, with a lower --lr")
    return state


def publish(store, lease, model, version, config, run, step) -> tuple[int, float]:
    """Write adapter `version` (or the next unclaimed name), then point LATEST at it under the lease: (version, s)."""
    t0 = time.time()
    fault("before_publish", step)
    version = store.write(version, finite_weights(model), config)
    fault("before_latest", step)
    lease.fenced(store.set_latest, version, run.max_staleness + 1, version=version)  # generators read the version in
    return version, time.time() - t0  # the lease (the fence's write) before each batch, LATEST without a live lease


def check_settings(saved: dict, cfg) -> list[str]:  # what a resume must keep (the run's math); others may change
    kept = {"loss_type", "eps_low", "eps_high", "tis_cap", "groups_per_step", "lr", "weight_decay", "max_grad_norm",
            "old_logp", "sync_every", "seed", "dtype"}
    return [f"{k}: the checkpoint has {saved[k]!r}, this command has {v!r}" for k, v in asdict(cfg).items()
            if k in kept and k in saved and saved[k] != v]


def resume(storage, model, optimizer, cfg, committed) -> dict | None:
    """Load the newest intact checkpoint of `committed` (None: all) into model and optimizer: its state, None: a new run."""
    state, skipped = load_checkpoint(storage, model, optimizer, committed)
    print("".join(f"skipped checkpoint {s}\n" for s in skipped), end="", flush=True)
    if state is None and any("damaged" in s for s in skipped):
        raise SystemExit(f"no intact checkpoint in {storage.url('checkpoints')} (above): restore one or use another --run_dir")
    if state and (changed := check_settings(state["config"], cfg)) and not cfg.allow_new_settings:
        raise SystemExit("resuming with other training settings than the checkpoint's:\n  " + "\n  ".join(changed) +
                         "\nuse the same flags, or pass --allow_new_settings true to change them on purpose")
    if state:
        print(f"resumed from {storage.url('checkpoints/' + state['name'])} (step {state['step']})", flush=True)
    return state


def main(task=None):  # task: the one the __main__ block checked, else built here
    run, cfg = parse_config(RunSettings, TrainConfig)
    (rank, world, device, waiting), storage = distributed(cfg.device, cfg.collective_timeout_s), Storage(cfg.run_dir)
    if rank == 0 and storage.exists("DONE"):
        raise SystemExit(f"{cfg.run_dir} is a finished run ({storage.url('DONE')} exists): pass another --run_dir.")
    task = task or make_task(run)  # the task and the model first: a bad flag stops it before the run directory records it
    torch.set_num_threads(cfg.threads)
    if device.type == "cuda" and cfg.dtype == "float32" and rank == 0:  # the default: right for a CPU, not a GPU
        print("train.py: float32 base weights on a GPU take twice the memory of --dtype bfloat16, and run slower", flush=True)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(run.model, device, cfg.dtype)
    check_turns(tokenizer, run)
    inject_lora(model, run.lora_r, run.lora_alpha, run.lora_targets)
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})  # no input gradients needed
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    engine = TorchEngine(model, stop_token_ids(model, tokenizer), tokenizer.pad_token_id)
    lease = Lease(storage, cfg.lease_timeout_s, groups_per_step=cfg.groups_per_step) if rank == 0 else None
    if lease and (old := lease.acquire()):  # the job's ranks share rank 0's; lock-step generators read its groups_per_step
        print(f"continuing after trainer {old['owner'] or '?'} (host {old['host']}, epoch {old['epoch']}), now gone", flush=True)
    meta = create_run(storage, run, task.grader) if rank == 0 else None
    buffer, eval_problems = RolloutBuffer(storage, meta and meta["run_id"]), task.eval_problems(cfg.eval_size)
    peft_config = adapter_config(run.lora_r, run.lora_alpha, run.lora_targets, resolve_model(run.model))

    state = resume(storage, model, optimizer, cfg, share(lease and lease.info["checkpoints"], waiting))
    counters = ("dropped_stale_total", "dropped_zero_std_total", "bad_total", "attribution_mismatch", "policy_mismatch_total")
    step, stats = state["step"] if state else 0, dict.fromkeys(counters, 0) | (state["stats"] if state else {})
    for p in params if world > 1 else []:  # rank 0's weights on every rank (a resume loaded them there)
        dist.broadcast(p.data, src=0)
    evaluate_now = partial(evaluate, engine, tokenizer, task, eval_problems, run, cfg.seed, cfg.eval_batch_tokens, rank, world, waiting)
    if rank > 0:  # the other ranks only compute and evaluate: rank 0 reads groups, publishes, checkpoints and logs
        if step == 0:
            evaluate_now()
        for step in range(step + 1, cfg.max_steps + 1):  # one train_step for each of rank 0's, and its evaluations
            train_step(model, optimizer, share(None, waiting), run, cfg, device, rank, world)
            if step % cfg.eval_every == 0 or step == cfg.max_steps:
                evaluate_now()
        return dist.destroy_process_group()
    ledger = Ledger(state and state["ledger"])
    buffer.collect(ledger.collect, lease.fenced)  # idempotent: a crash may have cut the last garbage collection short
    store, metrics = AdapterStore(storage, meta["run_id"]), Metrics(storage, f"train-e{lease.info['epoch']:06d}",
        tracker(cfg.report_to, cfg.tracker_project, f"{meta['run_id']}-train", asdict(run) | asdict(cfg)), "train")
    version = store.next_version(at_least=state["version"] + 1 if state else 0)  # a resume: its weights, under a new name
    version = publish(store, lease, model, version, peft_config, run, step)[0]  # publish first: v0, the untrained adapter
    G, adapter_mb = run.group_size, sum(p.numel() for p in params) * 4 / 2**20
    print(f"trainer on {device}: {cfg.groups_per_step} groups x G={G} = {cfg.groups_per_step * G} completions per "
          f"step, {cfg.max_steps} steps, max_staleness {run.max_staleness}, adapter {adapter_mb:.2f} MB "
          f"(published {store.url(version)}), eval on {len(eval_problems)} held-out problems, packed attention with "
          f"{'causal flags (flash kernels)' if device.type in FLAG_DEVICES else 'one boolean mask for each length'}\n"
          f"  {asdict(run)}\n  {asdict(cfg)}", flush=True)
    if step == 0:
        metrics.log({"step": 0, "eval/accuracy": (acc := evaluate_now()), "version": version, "time": time.time()},
                    f"step 0/{cfg.max_steps} | eval/accuracy {acc:.3f} (n={len(eval_problems)}"
                    + (f", split over {world} ranks)" if world > 1 else ")"))

    for step in range(step + 1, cfg.max_steps + 1):
        t0, validate = time.time(), partial(check_group, run=meta, vocab_size=model.config.vocab_size, version=version,
                                            digest_of=store.digest, reward_range=getattr(task, "reward_range", (0.0, 1.0)))
        check = partial(audit, model, weights_of=lambda v: store.weights(v)[0], run=run, cfg=cfg, device=device)
        groups, caught, wait_s, audit_s = take_batch(buffer, ledger, lease, cfg, run, version, validate, check, stats)
        lease.write(wait=False, **(queue := buffer.progress(lease.timeout_s)), step=step, groups_per_step=cfg.groups_per_step)
        staleness = [version - g.policy_version for g in groups]  # versions behind the weights it trains: not the record's
        (samples, rewards, lengths), t1, sync_s = build_samples(groups, run, cfg), time.time(), 0.0
        m, fwd_bwd_s = train_step(model, optimizer, share(samples, waiting), run, cfg, device, 0, world), time.time() - t1
        stats["policy_mismatch_total"] += len(caught)
        if m["train/skipped_nonfinite"]:  # no update was made: say so, and keep the groups out of any later step
            print(f"NON-FINITE STEP {step} SKIPPED: loss {m['loss']}, grad norm {m['grad_norm']}; its groups go to "
                  f"bad/: {[g.group_id for g in groups]}", flush=True)
            for g in groups:
                buffer.quarantine(g.group_id, g, f"NonFinite: loss: {m['loss']} at step {step}", stats)
        if step % cfg.sync_every == 0:
            version, sync_s = publish(store, lease, model, version + 1, peft_config, run, step)
        record = {"step": step, "version": version, "reward/mean": rewards.mean().item(), "reward/std": rewards.std().item(),
                  "loss": m["loss"], "frac_reward_zero_std": zero_std_groups(rewards, run.group_size).float().mean().item(),
                  "completions/mean_length": lengths.float().mean().item(), **{k: v for k, v in m.items() if k != "tokens"},
                  "completions/truncated_frac": sum(t for g in groups for t in g.truncated) / len(lengths),
                  "sample/staleness_mean": sum(staleness) / len(staleness), "sample/staleness_max": max(staleness),
                  **{f"sample/{k}": v for k, v in stats.items()}, "group_ids": [g.group_id for g in groups]}
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            t_eval = time.time()  # evaluation has a time of its own: perf/step_s includes it, perf/fwd_bwd_s not
            record |= {"eval/accuracy": evaluate_now(), "perf/eval_s": time.time() - t_eval}
        record |= {"sample/policy_mismatch": len(caught), "sample/rollout_queue_size": queue["waiting"],
                   "perf/rollout_wait_s": wait_s, "perf/audit_s": audit_s, "perf/fwd_bwd_s": fwd_bwd_s, "perf/weight_sync_s": sync_s,
                   "perf/step_s": time.time() - t0, "lr": cfg.lr, "time": time.time(),
                   "perf/peak_mem_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0}
        acc = f" | eval/accuracy {record['eval/accuracy']:.3f}" if "eval/accuracy" in record else ""
        if caught:  # the field's costliest async-LoRA bug: say it on the step line, not only in the metrics
            acc += (f" | POLICY MISMATCH: {len(caught)} groups quarantined, not sampled with the weights they name "
                    f"(v{sorted({g.policy_version for g in caught})}, generators {sorted({g.generator_id for g in caught})})")
        fault("before_metrics", step)  # logged before the checkpoint covering it: a redone step's newer life writes a newer one
        metrics.log(record, f"step {step}/{cfg.max_steps} | reward {record['reward/mean']:.3f} | ratio {m['ratio/mean']:.4f} | "
            f"clip {m['clip_ratio/low']:.3f}/{m['clip_ratio/high']:.3f} | stale {record['sample/staleness_mean']:.1f} | "
            f"v{version} | wait {wait_s:.2f}s | dt {record['perf/step_s']:.2f}s{acc}")
        fault("after_metrics", step)
        if step % cfg.save_every == 0 or step == cfg.max_steps:
            metrics.flush()  # the records it covers, which a bucket writes at most every 5 s
            name = save_checkpoint(storage, step, lease.info["epoch"], finite_weights(model), peft_config, optimizer, {
                "stats": stats, "version": version, "ledger": ledger.state(), "run": asdict(run), "config": asdict(cfg)})
            lease.write(checkpoints=[*(lease.info["checkpoints"] or [])[-1:], name])  # the commit: fails once deposed
            fault("after_checkpoint", step)
            ledger.advance()
            buffer.collect(ledger.collect, lease.fenced, fault_step=step)  # now covered by both kept checkpoints
            lease.fenced(prune_checkpoints, storage, lease.info["checkpoints"])

    lease.fenced(storage.put, "DONE", f"finished at step {step}, version {version}\n")
    buffer.collect(ledger.consumed, lease.fenced)  # nothing resumes a finished run: what the last checkpoint covers can go
    lease.release()
    print(f"done: {cfg.run_dir} (DONE written)", flush=True)
    metrics.finish()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(checked_task)
    except OSError as e:  # a full disk, a refused bucket, a vanished mount: one line, keep what is written
        raise SystemExit(f"train.py: {e}\nNothing complete was overwritten (every object appears whole or not at "
                         f"all); fix the problem and run the same command again.")
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback
        raise SystemExit("train.py: interrupted; run the same command to resume from the last checkpoint") from None
