"""Multi-turn rollouts (--max_turns): the trainer scores exactly the tokens the policy sampled, the task's tokens
carry no loss, a template that rewrites earlier turns is refused, and every turn of a conversation goes to the
replica that holds its prefix.

    python -m pytest -q tests/test_multiturn.py
"""
import json
import random
import shutil
import subprocess
import sys

import pytest
import requests
import torch
from conftest import ROOT, free_port, start
from transformers import AutoTokenizer

from minigrpo.engine import Completion, SamplingParams, TorchEngine
from minigrpo.lora import inject_lora, lora_layers
from minigrpo.model import DEMO_MODEL, load_model, packed_logprobs, stop_token_ids
from minigrpo.packing import Sample, collate
from minigrpo.rollouts import Group, read_groups, to_tensors
from minigrpo.run import RunSettings
from minigrpo.tasks import Calculator, Problem, ReverseAddition, calculate, make_task, prompt_ids, rollout
from safetensors.torch import save
from test_train_step import lora_model  # the same tiny LoRA model at every call: the sampler's and the trainer's
from train import TrainConfig, build_samples, train_step

RUN = RunSettings(max_turns=3, max_new_tokens=24)


def demo_rollout(n_problems=16, seed=0):
    model, tokenizer = load_model("demo", torch.device("cpu"), "float32")
    inject_lora(model, 8, 16)
    torch.manual_seed(seed)
    with torch.no_grad():  # a policy unlike the base model, so that a slip in the layout would show
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(std=0.05)
    task = make_task(RUN)
    problems = [task.sample(random.Random(seed * 100 + i)) for i in range(n_problems)]
    prompts = [prompt_ids(tokenizer, task.reset(p)) for p in problems]
    engine = TorchEngine(model, stop_token_ids(model, tokenizer), tokenizer.pad_token_id, seed)
    out, rewards = rollout(engine, tokenizer, task, problems, prompts, SamplingParams(n=4, max_tokens=24), RUN)
    return model, tokenizer, problems, prompts, out, rewards


def turns_of(mask):  # the runs of 1s: the policy's turns
    return sum(1 for i, m in enumerate(mask) if m == 1 and (i == 0 or mask[i - 1] == 0))


def test_three_turn_conversations_are_scored_exactly_by_the_trainer():
    model, tokenizer, problems, prompts, out, rewards = demo_rollout()
    completions = [c for group in out for c in group]
    assert max(turns_of(c.mask) for c in completions) == 3, "some conversations took all three turns"
    for p, prompt, group, r in zip(problems, prompts, out, rewards):
        for c, reward in zip(group, r):
            assert len(c.token_ids) == len(c.logprobs) == len(c.mask) <= RUN.max_new_tokens
            replies = [c.token_ids[i] for i, m in enumerate(c.mask) if m == 0]
            asked = tokenizer(p.prompt)["input_ids"]  # a wrong answer is asked again, as the demo writes it
            assert replies == asked * (turns_of(c.mask) - 1), "the reply's ids, as the template renders them"
            assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.mask) if m == 0)
            last = c.token_ids[len(c.mask) - c.mask[::-1].index(0):] if 0 in c.mask else c.token_ids
            assert reward == float(tokenizer.decode(last, skip_special_tokens=True) == p.answer)
    # the trainer's log-probs of the sampled tokens, in its packed layout: the generator's, to float32 rounding
    groups = [Group(prompt, [c.token_ids for c in g], [c.logprobs for c in g], r, [False] * 4, 0, 1.0,
                    loss_mask=[c.mask for c in g]) for prompt, g, r in zip(prompts, out, rewards)]
    samples = build_samples(groups, RunSettings(group_size=4), TrainConfig())[0]
    inputs, batch = collate(samples, torch.device("cpu"))
    with torch.no_grad():
        logp = packed_logprobs(model, *inputs, 1.0)[0]
    gap = ((logp - batch.behav).abs() * batch.mask).max().item()
    ratio = (torch.exp(logp - batch.behav) * batch.mask).sum() / batch.mask.sum()
    assert gap < 1e-4 and abs(ratio.item() - 1) < 1e-5, (gap, ratio)
    assert batch.mask.sum() == sum(sum(c.mask) for c in completions) < sum(len(c.mask) for c in completions)


def samples_with_replies(seed=0):
    """Two-turn samples: a turn, 3 tokens the task wrote (mask 0, log-prob 0), another turn; the policy's log-probs."""
    from conftest import sequence_logprobs
    rng, out, model = random.Random(seed), [], lora_model()
    for i in range(8):
        prompt = [rng.randrange(2, 32) for _ in range(4)]
        turns = [[rng.randrange(2, 32) for _ in range(rng.randrange(1, 5))] for _ in range(2)]
        ids = prompt + turns[0] + [rng.randrange(2, 32) for _ in range(3)] + turns[1]
        with torch.no_grad():
            t = torch.tensor([ids])
            logp = sequence_logprobs(model, t, torch.ones_like(t), 1.0)[0][0, len(prompt) - 1:].tolist()
        mask = [1] * len(turns[0]) + [0] * 3 + [1] * len(turns[1])
        logp = [lp if m else 0.0 for lp, m in zip(logp, mask)]
        out.append(Sample(ids, len(prompt), logp, 1.0 if i % 2 else -0.5, mask))
    return out


def step_grads(samples, cfg, run=RunSettings(max_new_tokens=16)):
    model = lora_model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0)
    opt.zero_grad = lambda set_to_none=True: None  # keep the gradients to read
    m = train_step(model, opt, samples, run, cfg, torch.device("cpu"))
    return torch.cat([p.grad.flatten() for p in params]), m


def test_tokens_the_task_wrote_change_no_gradient():
    samples = samples_with_replies()
    cfg = TrainConfig(micro_batch_tokens=40, tis_cap=2.0)
    grads, m = step_grads(samples, cfg)
    for s in samples:  # the task's tokens get absurd behaviour log-probs: nothing may change
        s.behav = [lp if k else -30.0 * (1 + random.random()) for lp, k in zip(s.behav, s.mask)]
    perturbed, m2 = step_grads(samples, cfg)
    assert torch.equal(grads, perturbed) and m == m2
    for s in samples:  # the same tokens trained on: another gradient (the check above can fail)
        s.mask = [1] * len(s.mask)
    assert not torch.allclose(grads, step_grads(samples, cfg)[0])


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_the_loss_normalisers_count_only_sampled_tokens(loss_type):
    """On policy (ratio 1) each token's loss is -A: the loss is a weighted sum of advantages whose weights show
    what each normaliser counted."""
    samples = samples_with_replies()
    cfg, run = TrainConfig(loss_type=loss_type, micro_batch_tokens=40), RunSettings(max_new_tokens=16)
    _, m = step_grads(samples, cfg, run)
    k = [sum(s.mask) for s in samples]  # sampled tokens
    expected = {"grpo": sum(-s.adv for s in samples) / len(samples),
                "dapo": sum(-s.adv * n for s, n in zip(samples, k)) / sum(k),
                "dr_grpo": sum(-s.adv * n for s, n in zip(samples, k)) / (len(samples) * run.max_new_tokens)}[loss_type]
    assert m["tokens"] == sum(k) and abs(m["ratio/mean"] - 1) < 1e-5
    assert m["loss"] == pytest.approx(expected, rel=1e-5)


def test_a_group_without_a_mask_is_all_sampled_and_a_mask_round_trips():
    group = Group([1, 2], [[3, 4, 5], [6]], [[-1.0] * 3, [-2.0]], [0.0, 1.0], [False, False], 0, 1.0, group_id="g-000001.0")
    assert read_groups(save(*to_tensors([group])), "g-000001")[0].loss_mask == [[1, 1, 1], [1]]
    group.loss_mask = [[1, 0, 1], [1]]
    assert read_groups(save(*to_tensors([group])), "g-000001")[0].loss_mask == [[1, 0, 1], [1]]


def test_a_template_that_rewrites_earlier_turns_is_refused_in_one_line_before_anything_is_written(tmp_path):
    model = shutil.copytree(DEMO_MODEL, tmp_path / "rewriting")
    config = json.loads((model / "tokenizer_config.json").read_text())
    # earlier assistant turns shortened to their last character, as Qwen3's template drops their thinking
    config["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
                               "{{ m['content'][-1:] }}{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    run_dir = tmp_path / "run"
    train = subprocess.run([sys.executable, "train.py", "--model", str(model), "--max_turns", "2", "--run_dir",
                            str(run_dir)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert train.returncode == 1 and train.stderr.strip().splitlines() == [
        f"--max_turns 2: {model}'s chat template is not prefix-preserving (it renders earlier turns differently once "
        "a reply follows), so a conversation would not train on the tokens sampled; use --max_turns 1"], train.stderr
    assert not run_dir.exists() or not any(run_dir.iterdir())


def test_the_calculator_answers_arithmetic_while_turns_remain():
    task = Calculator.__new__(Calculator)  # no data needed for its turns
    task.max_turns, task.reasoning, task.answer_format = 3, False, "last_number"
    problem = Problem("What is 5 plus 7?", "12")
    assert task.step(problem, ["5 + 7 and 2*3, then 5+7"]) == ("calculator: 5+7 = 12, 2*3 = 6", 0.0)
    assert task.step(problem, ["5+7", "so 12"]) == (None, 1.0), "a turn without arithmetic is graded"
    assert task.step(problem, ["5+7", "12 = 5+7", "5 + 7 = 12"]) == (None, 1.0), "the last turn is graded"
    assert task.step(problem, ["no idea"]) == (None, 0.0)
    assert [calculate(*c) for c in [("7", "/", "2"), ("1", "/", "0"), ("99999999", "x", "99999999"), ("3", "-", "5")]] \
        == ["3.5", "undefined", "9999999800000001", "-2"]
    assert task.reset(problem)[-1] == problem.prompt and len(task.reset(problem)) % 2 == 1


class AskAgain(ReverseAddition):  # every turn gets a one-token reply, and another turn
    def step(self, problem, turns):
        return "=", 0.0


class RecordingEngine:
    """TorchEngine's interface over HTTP to the proxy, one request a prompt, noting which replica answered."""

    def __init__(self, url):
        self.url, self.served = url, []

    def generate(self, prompts, params):
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        out = []
        for prompt, sp in zip(prompts, params):
            r = requests.post(self.url + "/v1/completions", json={"prompt": prompt, "n": sp.n, "max_tokens": sp.max_tokens,
                              "temperature": sp.temperature, "logprobs": 0, "return_token_ids": True}, timeout=60)
            assert r.status_code == 200, r.text
            self.served.append((prompt, r.headers["X-Proxy-Upstream"]))
            out.append([Completion(c["token_ids"], c["logprobs"]["token_logprobs"], c["finish_reason"])
                        for c in r.json()["choices"]])
        return out


def test_every_turn_of_a_conversation_goes_to_the_replica_that_holds_its_prefix():
    ports = [free_port() for _ in range(3)]
    procs = [start(["-m", "minigrpo.replica.serve", "--port", str(p)], p) for p in ports[:2]]
    try:
        procs.append(start(["proxy.py", "--no_auth", "--port", str(ports[2]), *(f"--upstream=http://127.0.0.1:{p}"
                                                                                  for p in ports[:2])], ports[2]))
        tokenizer, engine = AutoTokenizer.from_pretrained(DEMO_MODEL), RecordingEngine(f"http://127.0.0.1:{ports[2]}")
        task, run = AskAgain(), RunSettings(max_turns=3, max_new_tokens=20)
        rng = random.Random(0)  # prompts of two 16-token blocks, each its own: affinity has a prefix to follow
        problems = [Problem("".join(rng.choice("0123456789") for _ in range(29)) + "+1=", "0") for _ in range(6)]
        prompts = [prompt_ids(tokenizer, p.prompt) for p in problems]
        out, _ = rollout(engine, tokenizer, task, problems, prompts, SamplingParams(n=2, max_tokens=20), run)
        later = [(p, u) for p, u in engine.served[len(problems):]]
        assert len(later) >= 6, "conversations went on past their first turn"
        for prompt, (first, upstream) in zip(prompts, engine.served):
            assert first == prompt
            assert {u for p, u in later if p[:len(prompt)] == prompt} <= {upstream}
        assert {u for _, u in engine.served[:len(problems)]} == {"0", "1"}, "conversations spread over both"
    finally:
        for p in procs:
            p.kill()
