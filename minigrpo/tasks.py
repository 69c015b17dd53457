"""Prompt sets and verifiable rewards: a task hands out Problems (prompt text + reference answer) and scores text.
reverse_add, the demo task: "12+34=" -> "64", the sum written backwards, which makes the carry local (a 2-layer model
learns it). math: --task_data's problems; the reward is 1 when the last \\boxed{...} (or --answer_format's last number or
"Answer:" line) after a reasoning model's one </think> equals the reference as math-verify judges it (\\dfrac, 1/2 = 0.5)."""
import collections
import contextlib
import importlib.metadata
import json
import random
import re
from dataclasses import replace
from fractions import Fraction

import fsspec

Problem = collections.namedtuple("Problem", "prompt answer")


class Task:  # what every task shares: its problem sets, its side of a conversation (--max_turns above 1, which make_task sets)
    max_turns = 1

    def sample(self, rng: random.Random) -> Problem:
        return rng.choice(self.train_set)

    def eval_problems(self, n: int) -> list[Problem]:
        return self.eval_set[:n]

    def reset(self, problem: Problem) -> list[str]:  # the conversation's opening: user, assistant, user, ... texts
        return [problem.prompt]

    def step(self, problem: Problem, turns: list[str]) -> tuple[str | None, float]:
        """After the policy's turns: (the reply, None to end; the reward). A wrong answer is asked again, a new try."""
        reward = self.reward(turns[-1], problem.answer)
        return (None if reward == 1 else problem.prompt), reward


class ReverseAddition(Task):
    grader = "exact match"  # recorded in run.json and in every group: one grader scores a whole run

    def __init__(self):
        pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
        random.Random(0).shuffle(pairs)  # a random split: every digit combination appears on both sides
        self.eval_pairs, self.train_pairs = pairs[:810], pairs[810:]  # 10% the trainer never sees
        self.eval_set, self.train_set = [self.problem(*p) for p in pairs[:810]], [self.problem(*p) for p in pairs[810:]]

    @staticmethod
    def problem(a: int, b: int) -> Problem:
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b)[::-1])

    def reward(self, completion: str, answer: str) -> float:
        return float(completion.strip() == answer)


def last_boxed(text: str) -> str | None:  # what the last \boxed{...} (or \fbox{...}) holds, braces matched; None if none
    if (start := max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))) < 0:
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
    import math_verify  # here: only the math task grades with it, and importing it takes 0.6 s
    gold, said = (math_verify.parse(text, parsing_timeout=5) for text in (f"${answer}$", f"$\\boxed{{{pred}}}$"))
    return float(math_verify.verify(gold, said, timeout_seconds=5))  # timeouts bound a pathological answer


def json_line(path: str, i: int, line: bytes) -> dict:  # one row of a JSON Lines file, or one line naming the bad one
    with contextlib.suppress(json.JSONDecodeError):
        if isinstance(row := json.loads(line), dict):
            return row
    raise SystemExit(f'{path} line {i} is not a JSON object; --task_data takes one a line: {{"problem": .., "answer": ..}}')


class MathTask(Task):
    def __init__(self, data: str, fields: str = "problem,answer", reasoning: bool = False, answer_format: str = "boxed"):
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
        n_eval = max(1, int(len(problems) * 0.05))  # 5% held out
        self.eval_set, self.train_set, self.reasoning = problems[:n_eval], problems[n_eval:] or problems, reasoning

    def reward(self, completion: str, answer: str) -> float:
        return math_reward(completion, answer, self.reasoning, self.answer_format)


class Calculator(MathTask):
    """--task calculator: math's data and grader, and a tool. While turns remain, arithmetic in a turn (`5+7`, which small
    models write unasked) gets its values back ("calculator: 5+7 = 12"); the first turn without any, or the last, is graded."""

    def step(self, problem: Problem, turns: list[str]) -> tuple[str | None, float]:
        calls = dict.fromkeys(re.findall(r"(\d+(?:\.\d+)?)\s*([-+*/x×])\s*(\d+(?:\.\d+)?)", turns[-1]))  # in order, once
        if calls and len(turns) < self.max_turns:
            return "calculator: " + ", ".join(f"{a}{op}{b} = {calculate(a, op, b)}" for a, op, b in list(calls)[:4]), 0.0
        return None, self.reward(turns[-1], problem.answer)


def calculate(a: str, op: str, b: str) -> str:  # one operation, exactly (fractions); x and × multiply
    x, y = Fraction(a), Fraction(b)
    value = x + y if op == "+" else x - y if op == "-" else (x / y if y else None) if op == "/" else x * y
    return "undefined" if value is None else str(value) if value.denominator == 1 else f"{float(value):.6g}"


def make_task(run) -> Task:
    if run.task_data and run.task not in ("math", "calculator"):  # SystemExit: one line, not a traceback
        raise SystemExit(f"--task_data is read only by --task math and calculator, and --task is {run.task}: add --task math")
    if run.max_turns < 1:
        raise SystemExit(f"--max_turns {run.max_turns}: a completion needs at least 1 turn")
    if (kind := {"reverse_add": ReverseAddition, "math": MathTask, "calculator": Calculator}.get(run.task)) is None:
        raise SystemExit(f"--task {run.task!r} is unknown: pass --task reverse_add, math or calculator")
    task = kind() if kind is ReverseAddition else kind(run.task_data, run.task_fields, run.reasoning, run.answer_format)
    task.max_turns = run.max_turns
    return task


def render(tokenizer, system_prompt: str, texts: list[str], next_turn: bool) -> list[int]:
    """The chat template's token ids of user, assistant, user, ... texts (no template: the texts, joined)."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer("".join(texts))["input_ids"]
    messages = [{"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(texts)]
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + messages
    return tokenizer.apply_chat_template(messages, add_generation_prompt=next_turn, return_dict=True)["input_ids"]


def prompt_ids(tokenizer, text: "str | list[str]", system_prompt: str = "") -> list[int]:  # text: or task.reset's
    return render(tokenizer, system_prompt, [text] if isinstance(text, str) else text, True)


def reply_ids(tokenizer, run, texts: list[str], end: int) -> list[int]:
    """The ids of the task's reply texts[-1] after a policy turn that ended with token `end`: the conversation rendered
    with the reply and the next turn's start, past its rendering without them (after its last `end`, if any). Refused
    if the template is not prefix-preserving, rewriting earlier turns once another follows (Qwen3's drops thinking)."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(texts[-1])["input_ids"]
    before, after = render(tokenizer, run.system_prompt, texts[:-1], False), render(tokenizer, run.system_prompt, texts, True)
    cut = len(before) - before[::-1].index(end) if end in before else len(before)
    if after[:cut] != before[:cut] or tokenizer.decode(before[cut:]).strip():
        raise SystemExit(f"--max_turns {run.max_turns}: {run.model}'s chat template is not prefix-preserving (it renders earlier "
                         f"turns differently once a reply follows), so a conversation would not train on the tokens sampled; use --max_turns 1")
    return after[cut:]


def check_turns(tokenizer, run):  # --max_turns above 1: a template that rewrites earlier turns is refused at start
    if run.max_turns > 1:  # an answer with thinking, what such templates drop, in digits the demo's tokenizer has
        reply_ids(tokenizer, run, ["1+1=", "<think>\n1+1\n</think>\n\n2", "Sure?"], tokenizer.eos_token_id)


def rollout(engine, tokenizer, task, problems, prompts, params, run) -> tuple[list, list[list[float]]]:
    """(completions[i][j], rewards[i][j]): params[i].n samples for problems[i] (prompts[i]: its ids). With --max_turns above 1
    a sample is a conversation: a turn up to its stop token; task.step's reply (or the end) and reward; the reply's ids with
    mask 0 and log-prob 0; the next turn; all within max_new_tokens; the last reward counts. Ids are never decoded and re-encoded."""
    params = params if isinstance(params, list) else [params] * len(prompts)  # one for all, or one a prompt
    out = engine.generate(prompts, params)
    rewards, live = [[0.0] * len(g) for g in out], [(i, j, task.reset(p), 0) for i, p in enumerate(problems)
                                                     for j in range(params[i].n)]  # (problem, sample, texts, turn start)
    for c in (c for group in out for c in group):
        c.mask = [1] * len(c.token_ids)
    for turn in range(1, run.max_turns + 1):
        going = []
        for i, j, texts, start in live:
            c, texts = out[i][j], texts + [tokenizer.decode(out[i][j].token_ids[start:], skip_special_tokens=True)]
            reply, rewards[i][j] = task.step(problems[i], texts[len(task.reset(problems[i]))::2])
            if reply is None or turn == run.max_turns or c.finish_reason == "length":
                continue
            extra = reply_ids(tokenizer, run, texts + [reply], c.token_ids[-1])
            if len(c.token_ids) + len(extra) >= run.max_new_tokens:  # no room for the reply and a turn
                c.finish_reason = "length"
                continue
            c.token_ids, c.logprobs, c.mask = c.token_ids + extra, c.logprobs + [0.0] * len(extra), c.mask + [0] * len(extra)
            going.append((i, j, texts + [reply], len(c.token_ids)))
        if not going:
            break
        asks = [replace(params[i], n=1, max_tokens=run.max_new_tokens - len(out[i][j].token_ids),
                        seed=None if params[i].seed is None else params[i].seed + j + 1_000_003 * turn) for i, j, *_ in going]
        for (i, j, *_), (t,) in zip(going, engine.generate([prompts[i] + out[i][j].token_ids for i, j, *_ in going], asks)):
            c = out[i][j]
            c.token_ids, c.logprobs, c.mask = c.token_ids + t.token_ids, c.logprobs + t.logprobs, c.mask + [1] * len(t.token_ids)
            c.finish_reason = t.finish_reason
        live = going
    return out, rewards
