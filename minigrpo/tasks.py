"""Prompt sets and verifiable rewards. A task hands out Problems (prompt text + reference answer) and scores text.

reverse_add, the demo task: "12+34=" -> "64", the sum 46 written backwards. The answer is checkable, the tiny
built-in model is right only some of the time, and writing digits in reverse order makes the carry local, so
a 2-layer model can learn it.
"""
import random
from dataclasses import dataclass


@dataclass
class Problem:
    prompt: str
    answer: str


class ReverseAddition:
    name = "reverse_add"

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


TASKS = {"reverse_add": ReverseAddition}


def make_task(name: str):
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    return TASKS[name]()


def score(task, tokenizer, problems: list[Problem], completions) -> list[list[float]]:
    """Rewards for completions[i][j], the j-th sample for problems[i] (special tokens such as EOS stripped)."""
    return [[task.reward(tokenizer.decode(c.token_ids, skip_special_tokens=True), p.answer) for c in group]
            for p, group in zip(problems, completions)]
