"""The shipped demo model and task: loads with the Auto classes, tokenizer round trip, a starting point with room.

    python -m pytest -q tests/test_demo.py
"""
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minigrpo.demo import CHARS, build_tokenizer
from minigrpo.engine import SamplingParams, TorchEngine
from minigrpo.model import DEMO_MODEL, load_model, stop_token_ids
from minigrpo.run import RunSettings
from minigrpo.tasks import ReverseAddition, make_task, score


def test_demo_model_is_a_small_qwen2_that_auto_classes_load():
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL)
    assert model.config.model_type == "qwen2"
    assert 100_000 <= sum(p.numel() for p in model.parameters()) <= 5_000_000
    size = sum(os.path.getsize(os.path.join(DEMO_MODEL, f)) for f in os.listdir(DEMO_MODEL))
    assert size < 2 * 2**20


def test_tokenizer_round_trips_through_auto_tokenizer():
    loaded, built = AutoTokenizer.from_pretrained(DEMO_MODEL), build_tokenizer()
    text = "12+34=64" + CHARS + "99+99=891"
    assert loaded(text)["input_ids"] == built(text)["input_ids"] == [CHARS.index(c) + 1 for c in text]
    ids = loaded(text)["input_ids"] + [loaded.eos_token_id]
    assert loaded.decode(ids, skip_special_tokens=True) == text
    assert loaded.eos_token_id == loaded.pad_token_id == 0


def test_task_answers_are_reversed_sums_and_splits_are_disjoint():
    task = make_task(RunSettings())
    assert ReverseAddition.problem(12, 34).answer == "64" and ReverseAddition.problem(99, 99).answer == "891"
    assert task.reward(" 64", "64") == 1.0 and task.reward("46", "64") == 0.0
    assert not set(task.train_pairs) & set(task.eval_pairs)


def test_base_model_is_right_only_part_of_the_time():
    torch.manual_seed(0)
    model, tokenizer = load_model("demo", torch.device("cpu"))
    task = make_task(RunSettings())
    problems = task.eval_problems(400)
    engine = TorchEngine(model, stop_token_ids(model, tokenizer), tokenizer.pad_token_id)
    completions = engine.generate([tokenizer(p.prompt)["input_ids"] for p in problems], SamplingParams(max_tokens=8, seed=0))
    accuracy = sum(r[0] for r in score(task, tokenizer, problems, completions)) / len(problems)
    assert 0.2 <= accuracy <= 0.5
