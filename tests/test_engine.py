"""The torch engine: behaviour log-probs the trainer reproduces, stopping, seeding, padding, both cache APIs.

    python -m pytest -q tests/test_engine.py
"""
import math
from types import SimpleNamespace

import torch
import torch.nn as nn
from conftest import tiny_model

from minigrpo.engine import TorchEngine
from minigrpo.lora import inject_lora, lora_layers
from minigrpo.model import sequence_logprobs

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


def engine_for(model):
    return TorchEngine(model, stop_ids=[1], pad_id=0)


def test_behaviour_logprobs_match_the_trainers_full_forward(arch):
    model = tiny_model(arch)
    inject_lora(model, r=2, alpha=4)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(std=0.2)
    temperature = 0.7
    groups = engine_for(model).generate(PROMPTS, n=3, max_new_tokens=6, temperature=temperature, seed=0)
    for prompt, group in zip(PROMPTS, groups):
        for c in group:
            ids = torch.tensor([prompt + c.token_ids])
            logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), temperature)
            torch.testing.assert_close(logp[0, len(prompt) - 1:], torch.tensor(c.logprobs), atol=1e-5, rtol=0)


def test_stops_at_a_stop_token_and_reports_length_otherwise():
    model = tiny_model()
    every_token = list(range(32))
    stopped = engine_for(model).generate(PROMPTS, n=2, max_new_tokens=5, seed=0, stop_token_ids=every_token)
    assert all(len(c.token_ids) == 1 and c.finish_reason == "stop" for g in stopped for c in g)
    free = TorchEngine(model, stop_ids=[], pad_id=0).generate(PROMPTS, n=2, max_new_tokens=5, seed=0)
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for g in free for c in g)


def test_rows_that_stopped_keep_their_own_length():
    model = tiny_model()
    groups = engine_for(model).generate(PROMPTS, n=8, max_new_tokens=12, seed=3)
    for c in (c for g in groups for c in g):
        assert len(c.token_ids) == len(c.logprobs)
        assert (1 in c.token_ids) == (c.finish_reason == "stop")
        if c.finish_reason == "stop":
            assert c.token_ids.index(1) == len(c.token_ids) - 1, "nothing is generated after the stop token"


def test_same_seed_same_samples_other_seed_other_samples():
    engine = engine_for(tiny_model())
    a = engine.generate(PROMPTS, n=4, max_new_tokens=8, seed=11)
    assert a == engine.generate(PROMPTS, n=4, max_new_tokens=8, seed=11)
    assert a != engine.generate(PROMPTS, n=4, max_new_tokens=8, seed=12)


def test_left_padding_does_not_change_greedy_output():
    engine = engine_for(tiny_model())
    batched = engine.generate(PROMPTS, n=1, max_new_tokens=6, temperature=0)
    for prompt, group in zip(PROMPTS, batched):
        assert engine.generate([prompt], n=1, max_new_tokens=6, temperature=0)[0] == group


class PastKeyValuesOnly(nn.Module):
    """A model whose forward knows only `past_key_values`, as in the transformers 5.20 line vllm pins."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None,
                logits_to_keep=0):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          cache=past_key_values, use_cache=use_cache, logits_to_keep=logits_to_keep)


def test_engine_works_with_either_cache_keyword():
    model = tiny_model()
    new, old = engine_for(model), engine_for(PastKeyValuesOnly(model))
    assert (new.cache_kw, old.cache_kw) == ("cache", "past_key_values")
    assert new.generate(PROMPTS, n=2, max_new_tokens=6, seed=5) == old.generate(PROMPTS, n=2, max_new_tokens=6, seed=5)


def test_entropy_of_a_uniform_distribution_is_log_vocab():
    uniform = lambda input_ids, attention_mask: SimpleNamespace(logits=torch.zeros(*input_ids.shape, 4))
    ids = torch.tensor([[0, 1, 2, 3]])
    logp, entropy = sequence_logprobs(uniform, ids, torch.ones_like(ids), temperature=1.0)
    torch.testing.assert_close(entropy, torch.full((1, 3), math.log(4)))
    torch.testing.assert_close(logp, torch.full((1, 3), -math.log(4)))
