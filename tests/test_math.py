"""The math task: boxed-answer extraction, the other answer formats (last number, 'Answer:' line) and the grader
each records, think-tag handling, equivalent answers, garbage, data files with their
own field names, and prompts through a chat template. Nothing is downloaded.

    python -m pytest -q tests/test_math.py
"""
import json
import os
import subprocess
import sys

import pytest

from minigrpo.tools.demo import build_tokenizer
from minigrpo.run import RunSettings, parse_config
from minigrpo.tasks import answer_of, last_boxed, make_task, math_reward, prompt_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = [{"question": f"What is {a} + {b}?", "solution": str(a + b), "id": a} for a in range(20) for b in range(3)]


def test_last_boxed_matches_braces_and_takes_the_last():
    assert last_boxed(r"so \boxed{\frac{1}{2}} is it") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{1} then \boxed{x^{2}}") == "x^{2}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed("no box here") is None and last_boxed(r"\boxed{unclosed") is None


def test_reasoning_models_are_graded_after_the_one_end_of_thinking():
    text = r"<think>maybe \boxed{3}</think> so the answer is \boxed{4}"
    assert math_reward(text, "4", reasoning=True) == 1.0
    assert math_reward(text, "3", reasoning=True) == 0.0
    assert math_reward(r"<think>no end \boxed{4}", "4", reasoning=True) == 0.0
    assert math_reward(r"</think>\boxed{4}</think>", "4", reasoning=True) == 0.0
    assert math_reward(r"\boxed{4}", "4") == 1.0


@pytest.mark.parametrize("pred, gold", [("0.5", r"\frac{1}{2}"), (r"\dfrac{1}{2}", "1/2"), (r"\frac12", "0.5"),
                                        (r"90^\circ", "90"), (r"\text{12}", "12"), ("1,000", "1000"), (r"\left(3\right)", "(3)"),
                                        ("-2", r"-\frac{4}{2}"), (r"(x+1)^2", "x^2+2x+1")])
def test_equivalent_answers_score_one(pred, gold):
    assert math_reward(rf"The answer is \boxed{{{pred}}}.", gold) == 1.0


@pytest.mark.parametrize("completion", ["no answer at all", r"\boxed{}", r"\boxed{5}", r"\boxed{\frac{1}{0}}", "\\boxed{" * 50])
def test_garbage_and_wrong_answers_score_zero(completion):
    assert math_reward(completion, "4") == 0.0


def test_math_task_reads_a_jsonl_with_its_own_field_names(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    task = make_task(RunSettings(task="math", task_data=str(path), task_fields="question,solution"))
    held_out = {p.prompt for p in task.eval_problems(100)}
    assert len(held_out) == 3 and not held_out & {p.prompt for p in task.train_set}
    problem = task.eval_problems(1)[0]
    assert task.reward(rf"\boxed{{{problem.answer}}}", problem.answer) == 1.0
    with pytest.raises(SystemExit, match="'problem'"):
        make_task(RunSettings(task="math", task_data=str(path)))
    with pytest.raises(SystemExit, match="task_data"):
        make_task(RunSettings(task="math"))


def test_task_data_without_task_math_is_refused_in_one_line_before_the_generator_waits(tmp_path):
    with pytest.raises(SystemExit, match="--task_data is read only by --task math and calculator, and --task is reverse_add"):
        make_task(RunSettings(task_data="problems.jsonl"))
    gen = subprocess.run([sys.executable, "generate.py", "--task_data", "problems.jsonl", "--run_dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)  # no run.json: it would wait 600 s
    assert gen.returncode == 1 and gen.stderr.strip().splitlines() == [
        "--task_data is read only by --task math and calculator, and --task is reverse_add: add --task math"], gen.stderr


def test_prompts_go_through_the_chat_template_when_there_is_one():
    tok = build_tokenizer()
    tok.chat_template = None  # the demo's own template only joins the messages
    assert prompt_ids(tok, "2+3=", "1") == tok("2+3=")["input_ids"]  # no template: plain text
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}{% if add_generation_prompt %}+{% endif %}"
    assert prompt_ids(tok, "2+3", system_prompt="1") == tok("1=2+3=+")["input_ids"]
    assert prompt_ids(tok, "2+3") == tok("2+3=+")["input_ids"]


def test_a_chatty_reply_is_graded_by_its_last_number_with_that_format():
    reply = "Sure! 3 + 4 is a sum of two numbers, so 3 + 4 = 7."  # a small model's typical answer: no \\boxed{}
    assert math_reward(reply, "7", answer_format="last_number") == 1.0 and math_reward(reply, "7") == 0.0
    assert math_reward("It is 7, not 8", "7", answer_format="last_number") == 0.0  # the last number, not any
    assert answer_of("about 1,000 or -2.5 of them", "last_number") == "-2.5" and answer_of("none", "last_number") is None
    assert math_reward("We have 1,000 in all", "1000", answer_format="last_number") == 1.0


def test_an_answer_line_is_graded_by_what_follows_the_last_answer_label():
    assert answer_of("Answer: 3\nno wait\nAnswer: 1/2.", "answer_line") == "1/2"
    assert math_reward("Answer: 1/2.", "0.5", answer_format="answer_line") == 1.0
    assert math_reward("The answer is 5", "5", answer_format="answer_line") == 0.0  # no label: no answer


def test_the_answer_format_is_part_of_the_grader_and_an_unknown_one_is_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps({"problem": r["question"], "answer": r["solution"]}) for r in ROWS) + "\n")
    boxed = make_task(RunSettings(task="math", task_data=str(path)))
    last = make_task(RunSettings(task="math", task_data=str(path), answer_format="last_number"))
    assert boxed.grader.endswith(", boxed") and last.grader == boxed.grader.replace("boxed", "last_number")
    with pytest.raises(SystemExit):  # argparse: "invalid choice: 'Boxed' (choose from boxed, last_number, answer_line)"
        parse_config(RunSettings, argv=["--answer_format", "Boxed"])
