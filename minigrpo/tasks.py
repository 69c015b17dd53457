"""Prompt sets and verifiable rewards: a task hands out Problems (prompt text + reference answer) and scores text.
reverse_add, the demo task: "12+34=" -> "64", the sum written backwards, which makes the carry local (a 2-layer model
learns it). math: --task_data's problems; the reward is 1 when the last \\boxed{...} (--answer_format: or, for a model
that rarely boxes, the last number or "Answer:" line) after a reasoning model's one </think> equals the reference as
math-verify judges it: spacing, \\left/\\right, \\dfrac, \\text{}, degrees, 1,000, 1/2 = 0.5, (x+1)^2 = x^2+2x+1."""
import collections
import contextlib
import importlib.metadata
import json
import random
import re

import fsspec
import math_verify


Problem = collections.namedtuple("Problem", "prompt answer")


class ReverseAddition:
    grader = "exact match"  # recorded in run.json and in every group: one grader scores a whole run

    def __init__(self):
        pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
        random.Random(0).shuffle(pairs)  # a random split: every digit combination appears on both sides
        self.eval_pairs, self.train_pairs = pairs[:810], pairs[810:]  # 10% the trainer never sees

    @staticmethod
    def problem(a: int, b: int) -> Problem:
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b)[::-1])

    def sample(self, rng: random.Random) -> Problem:
        return self.problem(*rng.choice(self.train_pairs))

    def eval_problems(self, n: int) -> list[Problem]:
        return [self.problem(a, b) for a, b in self.eval_pairs[:n]]

    def reward(self, completion: str, answer: str) -> float:
        return float(completion.strip() == answer)


def last_boxed(text: str) -> str | None:  # what the last \boxed{...} (or \fbox{...}) holds, braces matched; None if none
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i, depth = text.index("{", start), 0
    for j in range(i, len(text)):  # unbalanced (cut off before the answer closed): None
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]


def answer_of(text: str, answer_format: str = "boxed") -> str | None:
    if answer_format == "last_number":
        return (re.findall(r"-?\d+(?:,\d{3})*(?:\.\d+)?", text) or [None])[-1]
    if answer_format == "answer_line":
        return text.rsplit("Answer:", 1)[1].split("\n")[0].strip(" .") if "Answer:" in text else None
    return last_boxed(text)


def math_reward(completion: str, answer: str, reasoning: bool = False, answer_format: str = "boxed") -> float:
    if reasoning and completion.count("</think>") != 1:  # grade only what follows the single end of thinking
        return 0.0
    pred = answer_of(completion.split("</think>")[1] if reasoning else completion, answer_format)
    if pred is None or pred.strip() == answer.strip():  # no answer, or the same text: no parsing needed
        return float(pred is not None)
    gold, said = (math_verify.parse(text, parsing_timeout=5) for text in (f"${answer}$", f"$\\boxed{{{pred}}}$"))
    return float(math_verify.verify(gold, said, timeout_seconds=5))  # timeouts bound a pathological answer


def json_line(path: str, i: int, line: bytes) -> dict:  # one row of a JSON Lines file, or one line naming the bad one
    with contextlib.suppress(json.JSONDecodeError):
        if isinstance(row := json.loads(line), dict):
            return row
    raise SystemExit(f'{path} line {i} is not a JSON object; --task_data takes one a line: {{"problem": .., "answer": ..}}')


class MathTask:
    def __init__(self, data: str, fields: str = "problem,answer", reasoning: bool = False, eval_fraction: float = 0.05,
                 answer_format: str = "boxed"):
        self.answer_format, self.grader = answer_format, f"math-verify {importlib.metadata.version('math-verify')}, {answer_format}"
        if not data:
            raise SystemExit("--task math needs --task_data: a .jsonl or .parquet file, or hf://datasets/OWNER/NAME/FILE")
        problem_key, answer_key = fields.split(",")
        try:
            with fsspec.open(data, "rb") as f:  # a local path or a URL: hf://datasets/OWNER/NAME/FILE, s3://, gs://
                if data.endswith(".parquet"):
                    import pyarrow.parquet as pq  # only parquet needs it: pip install pyarrow
                    rows = pq.read_table(f).to_pylist()
                else:
                    rows = [json_line(data, i, line) for i, line in enumerate(f, 1) if line.strip()]
        except FileNotFoundError:
            raise SystemExit(f"--task_data {data}: no such file") from None
        if bad := [i for i, row in enumerate(rows) if problem_key not in row or answer_key not in row]:
            raise SystemExit(f"{data} row {bad[0]} lacks the field {problem_key!r} or {answer_key!r} "
                             f"(it has {sorted(rows[bad[0]])}); set --task_fields PROBLEM,ANSWER")
        problems = [Problem(str(r[problem_key]), str(r[answer_key])) for r in rows]
        random.Random(0).shuffle(problems)
        n_eval = max(1, int(len(problems) * eval_fraction))
        self.eval_set, self.train_set, self.reasoning = problems[:n_eval], problems[n_eval:] or problems, reasoning

    def sample(self, rng: random.Random) -> Problem:
        return rng.choice(self.train_set)

    def eval_problems(self, n: int) -> list[Problem]:
        return self.eval_set[:n]

    def reward(self, completion: str, answer: str) -> float:
        return math_reward(completion, answer, self.reasoning, self.answer_format)


def make_task(run) -> "ReverseAddition | MathTask":
    if run.task_data and run.task != "math":  # SystemExit: the scripts print it as one line, not a traceback
        raise SystemExit(f"--task_data is read only by --task math, and --task is {run.task}: add --task math")
    if run.task == "reverse_add":
        return ReverseAddition()
    if run.task == "math":
        return MathTask(run.task_data, run.task_fields, run.reasoning, answer_format=run.answer_format)
    raise SystemExit(f"--task {run.task!r} is unknown: pass --task reverse_add or --task math")


def prompt_ids(tokenizer, text: str, system_prompt: str = "") -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(text)["input_ids"]
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]


def score(task, tokenizer, problems: list[Problem], completions) -> list[list[float]]:
    """Rewards for completions[i][j], the j-th sample for problems[i] (special tokens such as EOS stripped)."""
    return [[task.reward(tokenizer.decode(c.token_ids, skip_special_tokens=True), p.answer) for c in group]
            for p, group in zip(problems, completions)]
