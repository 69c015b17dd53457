"""Prompt sets and verifiable rewards. A task hands out Problems (prompt text + reference answer) and scores text.

reverse_add, the demo task: "12+34=" -> "64", the sum 46 written backwards: the digits in reverse order make the
carry local, so a 2-layer model can learn it. math: problems from --task_data (README, "Real models"); the reward
is 1 when the last \\boxed{...} (after the one </think> of a reasoning model) equals the reference, compared
after normalising (spacing, \\left/\\right, \\dfrac, \\text{}, degrees, numbers), else by math-verify.
"""
import json
import math
import random
import re
from dataclasses import dataclass

try:
    import math_verify
except ImportError:  # optional: the normalised comparison below still grades
    math_verify = None


@dataclass
class Problem:
    prompt: str
    answer: str


class ReverseAddition:
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


def read_rows(path: str) -> list[dict]:
    if path.startswith("hf://datasets/"):
        from huggingface_hub import hf_hub_download
        owner, name, filename = path.removeprefix("hf://datasets/").split("/", 2)
        path = hf_hub_download(f"{owner}/{name}", filename, repo_type="dataset")
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise SystemExit(f"reading {path} needs pyarrow: pip install pyarrow (or convert it to JSONL)")
        return pq.read_table(path).to_pylist()
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} (or \\fbox{...}), braces matched; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i, depth = text.index("{", start), 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None  # unbalanced: cut off before the answer closed


def normalize(answer: str) -> str:
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", answer)  # \text{12} -> 12
    for old, new in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""), ("\\!", ""),
                     ("\\,", ""), ("^\\circ", ""), ("^{\\circ}", ""), ("$", ""), (" ", "")):  # in this order
        s = s.replace(old, new)
    return s.rstrip(".").strip()


def as_number(s: str) -> float:  # nan when s is not a number
    m = re.fullmatch(r"(-?)\\frac\{?(-?[\d.]+)\}?\{?(-?[\d.]+)\}?", s) or re.fullmatch(r"(-?)([\d.]+)/([\d.]+)", s)
    try:
        if m:
            return (-1 if m.group(1) else 1) * float(m.group(2)) / float(m.group(3))
        return float(s.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return math.nan


def math_reward(completion: str, answer: str, reasoning: bool = False) -> float:
    if reasoning and completion.count("</think>") != 1:  # grade only what follows the single end of thinking
        return 0.0
    pred = last_boxed(completion.split("</think>")[1] if reasoning else completion)
    if pred is None:
        return 0.0
    a, b = normalize(pred), normalize(answer)
    if a == b or math.isclose(as_number(a), as_number(b), rel_tol=1e-6, abs_tol=1e-9):
        return 1.0
    if math_verify is not None:  # symbolic equivalence; its own timeouts keep a pathological answer from blocking
        gold = math_verify.parse(f"${answer}$", parsing_timeout=1)
        return float(math_verify.verify(gold, math_verify.parse(f"$\\boxed{{{pred}}}$", parsing_timeout=1), timeout_seconds=1))
    return 0.0


class MathTask:
    def __init__(self, data: str, fields: str = "problem,answer", reasoning: bool = False, eval_fraction: float = 0.05):
        if not data:
            raise ValueError("--task math needs --task_data: a .jsonl or .parquet file, or hf://datasets/OWNER/NAME/FILE")
        problem_key, answer_key = fields.split(",")
        rows = read_rows(data)
        if bad := [i for i, row in enumerate(rows) if problem_key not in row or answer_key not in row]:
            raise ValueError(f"{data} row {bad[0]} lacks the field {problem_key!r} or {answer_key!r} "
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
        return math_reward(completion, answer, self.reasoning)


def make_task(run) -> "ReverseAddition | MathTask":
    if run.task == "reverse_add":
        return ReverseAddition()
    if run.task == "math":
        return MathTask(run.task_data, run.task_fields, run.reasoning)
    raise ValueError(f"unknown task {run.task!r}; known: reverse_add, math")


def prompt_ids(tokenizer, text: str, system_prompt: str = "") -> list[int]:
    """Token ids of a prompt: through the model's chat template when its tokenizer has one, else plain text."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(text)["input_ids"]
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [{"role": "user", "content": text}]
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(templated, add_special_tokens=False)["input_ids"]


def score(task, tokenizer, problems: list[Problem], completions) -> list[list[float]]:
    """Rewards for completions[i][j], the j-th sample for problems[i] (special tokens such as EOS stripped)."""
    return [[task.reward(tokenizer.decode(c.token_ids, skip_special_tokens=True), p.answer) for c in group]
            for p, group in zip(problems, completions)]
