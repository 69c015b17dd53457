"""minigrpo against TRL's GRPOTrainer with peft LoRA, on the demo task (or a real model), for the same training
wall-clock.

    pip install -r requirements-bench.txt      # TRL, in an environment of its own (see that file)
    python bench/compare_trl.py                # 3 arms x 3 seeds x 150 s of training, plus evaluation: ~30 minutes
    python bench/compare_trl.py --budget_s 20 --seeds 1      # a smoke run
    python bench/compare_trl.py --model models/smollm2 --task_data data/sums.jsonl   # the real model (bench/real_model.py)

With --model, the arms train that model on the math task from --task_data with the real-model recipe (REAL below:
answers graded by their last number, a system prompt, 48 new tokens, 4 groups a step, learning rate 1e-3), and TRL
gets conversational prompts that its chat template turns into minigrpo's prompt ids, to the token (checked).

The arms, all from the shipped base (minigrpo/demo_model), with the same tokenizer and raw-text prompts (the demo
tokenizer's chat template adds nothing to them), the same reward (bench/common.score on the training problems), LoRA r=8,
alpha=16 on the same seven projections, learning rate 3e-3 (constant), G=8 completions per prompt, 256
completions (32 groups) per optimizer step, at most 8 new tokens, temperature 1, top_p 1, top_k off, float32, on
the CPU. These are minigrpo's defaults, read from its config classes, so the TRL arms follow any change to them:
  minigrpo     its real scripts, generate.py and train.py, as two processes (one thread each) on a fresh run directory,
               with every training default (the dapo loss, behaviour log-probs, max_staleness 4, an adapter per step)
  trl_default  GRPOTrainer with TRL's own defaults for everything not matched above (TRL 1.16: loss_type="dapo",
               scale_rewards="group", epsilon 0.2, beta 0, one iteration per batch); one process, one thread
  trl_dapo     TRL's documented DAPO settings: loss_type="dapo", epsilon_high=0.28 (clip-higher),
               mask_truncated_completions=True (overlong filtering)
  trl_grpo, trl_dr_grpo   optional (--arms): TRL with minigrpo's loss, and TRL's Dr. GRPO (scale_rewards="none")

Equal budgets. Each arm's clock starts when its training can start, with the model loaded: TRL's on_train_begin;
for minigrpo, the moment train.py publishes version 0 (adapters/LATEST appears), which is when generate.py may
take its first batch. At each time point t the arm's adapter is the newest one complete at t after that start:
TRL keeps a copy of the LoRA weights after every optimizer step and writes the copy made before t at the first
step that ends after t; for minigrpo the bench reads adapters/LATEST at t and copies that version. TRL stops at
the first step that ends after the budget, minigrpo's two processes are killed at the budget; neither arm's
steps after the budget are counted or evaluated. Steps per second = steps complete at the budget / budget.

Threads. minigrpo's generator and trainer take one thread each (their defaults), two cores in all. TRL runs one
process; --trl_threads sets its torch threads. It defaults to 1: on a busy 2-core machine a second thread made a
TRL step take 15 s instead of 0.22 s (the threads wait on each other while other processes hold the cores). On
a quiet machine, also run --trl_threads 2 and keep TRL's better figure.

One evaluator for every arm: train.py's own `evaluate` (the first --eval_size held-out problems at T=1, problem i
sampled with seed * 1_000_003 + i) on minigrpo's torch engine with the arm's adapter loaded, after the runs, so
evaluation takes no training time. Seed s seeds the arm (LoRA init, prompts, sampling) and its evaluation.
"""
import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

from common import ROOT, report, stop_all
from trl_results import headline, plot_curves

ARMS = {  # TRL settings beyond the matched ones; None: minigrpo
    "minigrpo": None,
    "trl_default": {},
    "trl_dapo": {"loss_type": "dapo", "epsilon_high": 0.28, "mask_truncated_completions": True},
    "trl_grpo": {"loss_type": "grpo"},
    "trl_dr_grpo": {"loss_type": "dr_grpo", "scale_rewards": "none"},
}
DEFAULT_ARMS = "minigrpo,trl_default,trl_dapo"
# the real-model recipe (README, "A real model on a CPU"): run settings, train.py's and generate.py's flags
REAL = {"run": {"task": "math", "answer_format": "last_number", "system_prompt": "Reply with the number only.",
                "max_new_tokens": 48}, "train": {"lr": 1e-3, "groups_per_step": 4}, "gen": {"prompts_per_batch": 4}}


def matched(model: str = "demo", task_data: str = ""):
    """The settings both arms share: minigrpo's defaults (RunSettings, TrainConfig), or with a real model its recipe."""
    from minigrpo.run import RunSettings
    from train import TrainConfig
    real = REAL if model != "demo" else {"run": {}, "train": {}}
    run = RunSettings(model=model, **real["run"], **({"task_data": task_data} if model != "demo" else {}))
    cfg = TrainConfig(**real["train"])
    return SimpleNamespace(run=run, lr=cfg.lr, groups_per_step=cfg.groups_per_step, max_grad_norm=cfg.max_grad_norm,
                           weight_decay=cfg.weight_decay, completions_per_step=cfg.groups_per_step * run.group_size)


# ---------------------------------------------------------------------------------------------------------------
# the TRL arm, in a process of its own: python bench/compare_trl.py --worker trl ...
def trl_worker(args):
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from minigrpo.lora import adapter_config, adapter_files
    from minigrpo.model import resolve_model
    from minigrpo.storage import Storage
    from minigrpo.tasks import Problem, make_task, prompt_ids
    from common import score

    torch.set_num_threads(args.threads)
    m = matched(args.model, args.task_data)
    task, base = make_task(m.run), resolve_model(m.run.model)
    tokenizer = AutoTokenizer.from_pretrained(base)
    train_set = task.train_set if m.run.task == "math" else [task.problem(a, b) for a, b in task.train_pairs]
    system = [{"role": "system", "content": m.run.system_prompt}] if m.run.system_prompt else []
    chat = m.run.task == "math"  # the demo's template adds nothing: TRL gets its raw text
    probe = train_set[0].prompt  # minigrpo templates its prompts (tasks.prompt_ids); TRL must see the same ids
    theirs = (tokenizer.apply_chat_template(system + [{"role": "user", "content": probe}], add_generation_prompt=True,
                                            return_dict=True)["input_ids"] if chat else tokenizer(probe)["input_ids"])
    if prompt_ids(tokenizer, probe, m.run.system_prompt) != theirs:
        raise SystemExit("TRL's prompt ids differ from minigrpo's for the same problem: match the prompt format")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": system + [{"role": "user", "content": p.prompt}] if chat else p.prompt,
                                  "answer": p.answer} for p in train_set])

    def reward(prompts, completions, completion_ids, answer, **_):
        """minigrpo's reward, through score (bench/common.py): the same decoding (special tokens stripped) and comparison."""
        problems = [Problem("", a) for a in answer]
        return [r[0] for r in score(task, tokenizer, problems, [[SimpleNamespace(token_ids=c)] for c in completion_ids])]

    peft_config = LoraConfig(r=m.run.lora_r, lora_alpha=m.run.lora_alpha, target_modules=list(m.run.lora_targets),
                             lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    config = GRPOConfig(
        output_dir=os.path.join(args.out, "trainer"), seed=args.seed, data_seed=args.seed, use_cpu=True,
        # matched to minigrpo: batch, group, lengths, sampling, optimizer
        per_device_train_batch_size=m.completions_per_step, gradient_accumulation_steps=1,
        num_generations=m.run.group_size, max_completion_length=m.run.max_new_tokens,
        temperature=m.run.temperature, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
        learning_rate=m.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=m.weight_decay,
        max_grad_norm=m.max_grad_norm,
        # not learning settings: float32 like minigrpo (TRL would pick bf16), no recomputation of activations
        # (TRL turns gradient checkpointing on by default, which only costs time on this model), no files
        bf16=False, fp16=False, activation_checkpointing=False, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0,
        max_steps=10**7,  # the wall clock stops it
        **ARMS[args.arm])
    adapter_json = adapter_config(peft_config.r, peft_config.lora_alpha, m.run.lora_targets, base)
    points = [float(x) for x in args.points.split(",")]
    saved = {}

    class WallClock(TrainerCallback):
        """Starts the clock when training starts; at each point writes the weights of the last step that ended
        before it; stops at the first step that ends after the budget."""

        def snapshot(self, model, state):
            return state.global_step, {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}

        def on_train_begin(self, args_, state, control, model=None, **kw):
            self.t0, self.last = time.time(), self.snapshot(model, state)

        def on_step_end(self, args_, state, control, model=None, **kw):
            now = time.time() - self.t0
            while points and now >= points[0]:
                t, (step, weights) = points.pop(0), self.last
                Storage(os.path.join(args.out, f"t{t:g}")).put_many(adapter_files(weights, adapter_json))
                saved[t] = step
            self.last = self.snapshot(model, state)
            if not points:
                control.should_training_stop = True
            return control

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config, callbacks=[WallClock()])
    print("effective:", {k: getattr(config, k) for k in ("loss_type", "scale_rewards", "epsilon", "epsilon_high", "beta",
          "num_iterations", "mask_truncated_completions", "generation_batch_size", "steps_per_generation",
          "activation_checkpointing", "bf16", "optim", "lr_scheduler_type")},
          "| checkpointing:", trainer.model.is_activation_checkpointing, flush=True)
    trainer.train()
    check_same_weights(trainer.model, tokenizer, get_peft_model_state_dict(trainer.model), adapter_json, args.out, base)
    with open(os.path.join(args.out, "steps.json"), "w") as f:
        json.dump({f"{t:g}": s for t, s in saved.items()}, f)


def check_same_weights(peft_model, tokenizer, weights, adapter_json, out, base):
    """The evaluator must see exactly TRL's policy: the trained peft model and minigrpo's model with the adapter
    written from it give the same logits."""
    import torch

    from minigrpo.lora import adapter_files, inject_lora, load_adapter
    from minigrpo.model import load_model
    from minigrpo.storage import Storage
    path = os.path.join(out, "final")
    Storage(str(path)).put_many(adapter_files(weights, adapter_json))
    ours, _ = load_model(base, torch.device("cpu"))
    inject_lora(ours, adapter_json["r"], adapter_json["lora_alpha"], adapter_json["target_modules"])
    load_adapter(ours, path)
    ids = torch.tensor([tokenizer(f"{a}+{b}=12")["input_ids"] for a, b in ((12, 34), (99, 99), (50, 17))])
    peft_model.eval()
    with torch.no_grad():
        theirs, mine = peft_model(input_ids=ids).logits, ours(input_ids=ids).logits
    err = (theirs - mine).abs().max().item()
    if err > 1e-4:
        raise SystemExit(f"TRL's adapter, loaded by minigrpo, gives other logits (max diff {err:.2e})")
    print(f"TRL's final adapter in minigrpo's model: logits within {err:.1e} of the peft model's", flush=True)
    shutil.rmtree(path)


# ---------------------------------------------------------------------------------------------------------------
def run_trl(arm, seed, args, out) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "trl", "--arm", arm, "--seed", str(seed),
           "--out", out, "--points", ",".join(f"{t:g}" for t in args.point_list), "--threads", str(args.trl_threads),
           "--model", args.model, "--task_data", args.task_data]
    with open(os.path.join(out, "trl.log"), "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=bench_env(args.trl_threads)).returncode
    if rc:
        raise SystemExit(f"{arm} seed {seed} failed (exit {rc}); the end of {out}/trl.log:\n{tail(out, 'trl.log')}")
    steps = {float(t): s for t, s in json.load(open(os.path.join(out, "steps.json"))).items()}
    return {"adapters": {t: os.path.join(out, f"t{t:g}") for t in args.point_list}, "steps": steps}


def run_minigrpo(seed, args, out) -> dict:
    """generate.py + train.py on a fresh run directory; adapters copied at each point in time (and, with --at_steps,
    when the published version first reaches each step count); both processes killed at the budget."""
    run_dir = os.path.join(out, "run")
    common = ["--run_dir", run_dir, "--seed", str(seed), "--device", "cpu"]
    real = REAL if args.model != "demo" else {"run": {}, "train": {}, "gen": {}}
    flags = lambda d: [x for k, v in d.items() for x in (f"--{k}", str(v))]  # noqa: E731
    common += flags(real["run"]) + (["--model", args.model, "--task_data", args.task_data] if real["run"] else [])
    common += shlex.split(args.run_flags)  # run settings: both scripts must agree on them
    train = [sys.executable, "train.py", *common, "--max_steps", "10000000",  # the wall clock stops it
             "--eval_every", "1000000000", "--eval_size", "1", *flags(real["train"]),  # evaluated outside the budget
             *shlex.split(args.train_flags)]
    gen = [sys.executable, "generate.py", *common, "--generator_id", "g", *flags(real["gen"]), *shlex.split(args.gen_flags)]
    logs = [open(os.path.join(out, name), "w") for name in ("train.log", "generate.log")]
    env = bench_env(1)
    procs = [subprocess.Popen(c, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
             for c, log in zip((train, gen), logs)]
    latest = os.path.join(run_dir, "adapters", "LATEST")
    times, steps_due = list(args.point_list), list(args.step_list)
    try:
        while not os.path.exists(latest):  # version 0 is out: the generator may start, the trainer is ready
            if any(p.poll() is not None for p in procs):
                raise SystemExit(f"minigrpo seed {seed} stopped before it published version 0:\n{tail(out, 'train.log')}")
            time.sleep(0.005)
        t0, adapters, steps = time.time(), {}, {}
        while times:
            if any(p.poll() is not None for p in procs):
                raise SystemExit(f"minigrpo seed {seed} died before {times[0]:g} s:\n{tail(out, 'train.log')}\n"
                                 f"{tail(out, 'generate.log')}")
            if time.time() >= t0 + times[0]:
                t = times.pop(0)
                adapters[t], steps[t] = copy_latest(run_dir, os.path.join(out, f"t{t:g}"))
            elif steps_due and latest_version(run_dir) >= steps_due[0]:
                k = steps_due.pop(0)
                adapters[f"step{k}"], steps[f"step{k}"] = copy_latest(run_dir, os.path.join(out, f"step{k}"))
            else:
                time.sleep(0.005)
    finally:
        stop_all(procs, logs)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"adapters": adapters, "steps": steps}


def latest_version(run_dir) -> int:
    try:
        return int(open(os.path.join(run_dir, "adapters", "LATEST")).read().strip().rsplit("-v", 1)[1])
    except (FileNotFoundError, IndexError, ValueError):  # being replaced
        return -1


def copy_latest(run_dir, dest):
    """Copy the version LATEST names now. Returns (path, version = steps trained, as train.py publishes every step)."""
    for _ in range(100):  # a version can leave the window between reading LATEST and copying it: read again
        name = open(os.path.join(run_dir, "adapters", "LATEST")).read().strip()
        try:
            shutil.copytree(os.path.join(run_dir, "adapters", name), dest)
            return dest, int(name.rsplit("-v", 1)[1])
        except (FileNotFoundError, shutil.Error):
            shutil.rmtree(dest, ignore_errors=True)
    raise SystemExit(f"could not copy the adapter LATEST names in {run_dir}")


def bench_env(threads: int) -> dict:
    return os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                         "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}


def tail(out, name, n=30):
    with open(os.path.join(out, name)) as f:
        return "".join(f.readlines()[-n:])


# ---------------------------------------------------------------------------------------------------------------
class Evaluator:
    """train.py's evaluate on minigrpo's engine: the same held-out problems, T=1, seed * 1_000_003 + i per problem."""

    def __init__(self, eval_size: int, threads: int, split: str = "test", model: str = "demo", task_data: str = "",
                 samples: int = 1):
        import torch

        from minigrpo.engine import TorchEngine
        from minigrpo.lora import inject_lora
        from minigrpo.model import load_model, stop_token_ids
        from minigrpo.tasks import make_task
        torch.set_num_threads(threads)
        self.run, self.samples = matched(model, task_data).run, samples
        self.model, self.tokenizer = load_model(self.run.model, torch.device("cpu"))
        inject_lora(self.model, self.run.lora_r, self.run.lora_alpha, self.run.lora_targets)  # B = 0: the base model
        self.engine = TorchEngine(self.model, stop_token_ids(self.model, self.tokenizer), self.tokenizer.pad_token_id)
        self.task = make_task(self.run)
        if split == "val" and self.run.task != "reverse_add":
            raise SystemExit("--split val is the demo task's: a task file has one held-out set")
        # test: the first eval_size held-out problems, the ones train.py reports. val: the held-out problems after
        # them (400 of the 810 with eval_size 400), for tuning a recipe without looking at the test answers
        self.problems = (self.task.eval_problems(eval_size) if split == "test" else
                         [self.task.problem(a, b) for a, b in self.task.eval_pairs[-eval_size:]])
        if split == "val" and eval_size > len(self.task.eval_pairs) // 2:
            raise SystemExit(f"--split val holds {len(self.task.eval_pairs) // 2} problems, not {eval_size}")

    def __call__(self, adapter: str | None, seed: int) -> float:
        from minigrpo.lora import load_adapter, lora_layers
        from train import evaluate
        if adapter is None:  # the base
            for layer in lora_layers(self.model).values():
                layer.lora_B.data.zero_()
        else:
            load_adapter(self.model, adapter)
        # --samples k: each problem k times (seeds seed, seed + 1000, ...), for a smaller held-out set's noise
        return statistics.mean(evaluate(self.engine, self.tokenizer, self.task, self.problems, self.run, seed + 1000 * k,
                                        len(self.problems)) for k in range(self.samples))


def mean_sd(xs) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget_s", type=float, default=150.0, help="training wall-clock per arm and seed")
    p.add_argument("--points", default="", help="seconds at which to evaluate (default: 5 even points up to the budget)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 for every arm")
    p.add_argument("--first_seed", type=int, default=0, help="seeds FIRST_SEED..FIRST_SEED+SEEDS-1")
    p.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated, from {','.join(ARMS)}")
    p.add_argument("--eval_size", type=int, default=400, help="held-out problems per evaluation (train.py's default)")
    p.add_argument("--trl_threads", type=int, default=1, help="torch threads of TRL's one process (minigrpo runs two "
                   "processes of one thread each); see the docstring")
    p.add_argument("--train_flags", default="", help="extra train.py flags for the minigrpo arm, e.g. '--lr 6e-3'")
    p.add_argument("--gen_flags", default="", help="extra generate.py flags for the minigrpo arm, e.g. '--max_ready 128'")
    p.add_argument("--run_flags", default="", help="extra run settings for both minigrpo scripts, e.g. "
                   "'--group_size 16' (the TRL arms keep the matched settings)")
    p.add_argument("--split", default="test", choices=["test", "val"], help="evaluate on the reported held-out "
                   "problems (test), or on the other held-out problems (val: for tuning the recipe)")
    p.add_argument("--at_steps", default="", help="minigrpo only: also evaluate the adapter of these steps, e.g. "
                   "'250,500' (a per-step view of the same runs; a step not reached in the budget is left out)")
    p.add_argument("--name", default="", help="results file bench/results/NAME.json (default: compare_trl, or "
                   "compare_trl_val with --split val)")
    p.add_argument("--work_dir", default="", help="keep each arm's logs and adapters here (default: a temp folder)")
    p.add_argument("--model", default="demo", help="demo, or a real model's folder (bench/real_model.py build) with "
                   "--task_data: the real-model recipe")
    p.add_argument("--task_data", default="", help="--model: the task file (bench/real_model.py task)")
    p.add_argument("--eval_samples", type=int, default=1, help="samples per held-out problem (pass@1 averaged)")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--arm", default="", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "trl":
        return trl_worker(args)
    arms = args.arms.split(",")
    if unknown := [a for a in arms if a not in ARMS]:
        raise SystemExit(f"unknown arms {unknown}; choose from {list(ARMS)}")
    args.point_list = sorted({float(x) for x in args.points.split(",")} if args.points else
                             {round(args.budget_s * k / 5, 3) for k in range(1, 6)})
    args.step_list = sorted(int(x) for x in args.at_steps.split(",") if x)
    if args.point_list[-1] != args.budget_s:
        raise SystemExit(f"--points must end at the budget ({args.budget_s:g} s)")
    work = args.work_dir or tempfile.mkdtemp(prefix="compare-trl-")
    os.environ.update(bench_env(1))
    if args.model != "demo" and not args.task_data:
        raise SystemExit("--model needs --task_data (python bench/real_model.py task data/sums.jsonl)")
    evaluator = Evaluator(args.eval_size, threads=1, split=args.split, model=args.model, task_data=args.task_data,
                          samples=args.eval_samples)

    runs = []  # one per arm and seed
    # arms take turns within a seed, so that slow spells of the machine hit all alike
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        base = evaluator(None, seed)
        for arm in arms:
            out = os.path.join(work, f"{arm}-s{seed}")
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(out)
            t = time.time()
            result = run_minigrpo(seed, args, out) if arm == "minigrpo" else run_trl(arm, seed, args, out)
            wall = time.time() - t
            acc = {t if isinstance(t, str) else f"{t:g}": evaluator(path, seed) for t, path in result["adapters"].items()}
            runs.append({"arm": arm, "seed": seed, "pass@1_base": base, "pass@1": acc,
                         "steps": {t if isinstance(t, str) else f"{t:g}": s for t, s in result["steps"].items()},
                         "steps_per_s": result["steps"][args.budget_s] / args.budget_s, "wall_s": wall})
            print(f"{arm} seed {seed}: steps {runs[-1]['steps']} | pass@1 {acc} (base {base:.3f}) | "
                  f"{wall:.0f} s with start-up", flush=True)

    rows = []
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        row = {"arm": arm, "seeds": len(mine), "base": mean_sd([r["pass@1_base"] for r in mine])}
        row |= {f"{t:g}s": mean_sd([r["pass@1"][f"{t:g}"] for r in mine]) for t in args.point_list}
        row |= {f"step{k}": mean_sd(got) for k in args.step_list
                if (got := [r["pass@1"][f"step{k}"] for r in mine if f"step{k}" in r["pass@1"]])}
        row |= {"steps/s": mean_sd([r["steps_per_s"] for r in mine]),
                "steps": mean_sd([float(r["steps"][f"{args.budget_s:g}"]) for r in mine])}
        rows.append(row)
    which = "first" if args.split == "test" else "last (--split val)"
    notes = (f"held-out pass@1 ({which} {args.eval_size} held-out problems, T=1, mean ± sd over seeds "
             f"{', '.join(str(r['seed']) for r in runs if r['arm'] == arms[0])}) of the newest adapter complete at each second of training "
             f"since the arm's start; base: the untrained model; steps/s: optimizer steps of "
             f"{matched(args.model, args.task_data).completions_per_step} completions done in "
             f"the {args.budget_s:g} s budget / budget." + (f" Logs and adapters: {work}" if args.work_dir else ""))
    import peft, torch, transformers, trl
    settings = {k: getattr(args, k) for k in ("budget_s", "point_list", "step_list", "seeds", "arms", "eval_size",
                                              "split", "trl_threads", "train_flags", "gen_flags", "run_flags", "model",
                                              "task_data", "eval_samples")}
    versions = {m.__name__: m.__version__ for m in (trl, peft, transformers, torch)}
    if head := headline(runs, args.point_list):
        print(f"minigrpo - {head['best_trl_arm']} (TRL's best) over {head['late_points']} s: "
              f"{head['margin']:+.3f} ± {head['margin_sd']:.3f}; time to {head['best_trl_arm']}'s final "
              f"{head['target']:.3f}: {head['time_ratio_interpolated']} of the budget (interpolated), "
              f"{head['time_ratio_first_point']} (first point)", flush=True)
    name = args.name or ("compare_trl_real" if args.model != "demo" else "compare_trl" if args.split == "test" else
                         "compare_trl_val")
    plot_curves(runs, arms, args.point_list, os.path.join(ROOT, "bench", "results", f"{name}.png"))
    report(name, rows, notes, extra={"settings": settings, "versions": versions, "runs": runs, "headline": head})
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
