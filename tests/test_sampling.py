"""vLLM's sampling parameters in the replica server's engine (minigrpo/replica/sampling.py), each against a plain-Python reference with a fixed seed: the
log-prob reported for every sampled token is the one the reference gives after all processors.

    python -m pytest -q tests/test_sampling.py
"""
import math
from collections import Counter

import pytest
import torch
from conftest import tiny_model

from minigrpo.replica.sampling import ServerEngine, ServerParams as SP

PROMPTS = [[5, 6, 7, 8, 9, 5], [10, 11]]
EOS = 1


def reference_logp(model, prompt, out, sp) -> torch.Tensor:
    """The distribution vLLM samples token len(out)+1 from, one token id at a time, no batching, no cache."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, -1].float().clone()
    for t, b in (sp.logit_bias or {}).items():
        logits[t] += b
    if len(out) < sp.min_tokens:
        for t in list(sp.stop_token_ids) + ([] if sp.ignore_eos else [EOS]):
            logits[t] = -math.inf
    counts = Counter(out)
    for t in range(len(logits)):
        if t in prompt or t in counts:
            rep = sp.repetition_penalty
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        logits[t] -= sp.frequency_penalty * counts[t] + sp.presence_penalty * (counts[t] > 0)
    logp = torch.log_softmax(logits / sp.temperature, -1)
    if sp.min_p:
        p = logp.exp()
        logp = torch.log_softmax(logp.masked_fill(p < p.max() * sp.min_p, -math.inf), -1)
    if sp.top_p < 1:  # keep the most likely tokens until their mass reaches top_p
        mass, keep = 0.0, set()
        for t in sorted(range(len(logp)), key=lambda t: -logp[t].item()):
            if mass >= sp.top_p:
                break
            keep.add(t)
            mass += logp[t].exp().item()
        drop = torch.tensor([t not in keep for t in range(len(logp))])
        logp = torch.log_softmax(logp.masked_fill(drop, -math.inf), -1)
    return logp


CASES = {"plain": {}, "temperature": {"temperature": 0.6}, "logit_bias": {"logit_bias": {3: 4.0, 4: -100.0}},
         "min_tokens": {"min_tokens": 5}, "repetition_penalty": {"repetition_penalty": 1.8},
         "presence_penalty": {"presence_penalty": 1.5}, "frequency_penalty": {"frequency_penalty": -0.7},
         "min_p": {"min_p": 0.6}, "top_p": {"top_p": 0.5},
         "all_at_once": {"top_p": 0.9, "logit_bias": {2: 2.0}, "min_tokens": 2, "repetition_penalty": 0.7,
                         "presence_penalty": -0.5, "frequency_penalty": 0.4, "min_p": 0.05, "temperature": 1.3}}


@pytest.mark.parametrize("case", list(CASES))
def test_reported_logprob_is_the_reference_distribution_after_every_processor(case):
    model = tiny_model()
    sp = SP(n=3, max_tokens=8, seed=4, **CASES[case])
    groups = ServerEngine(model, [EOS], 0, None).generate(PROMPTS, sp)
    for prompt, group in zip(PROMPTS, groups):
        for c in group:
            for i, (t, lp) in enumerate(zip(c.token_ids, c.logprobs)):
                assert lp == pytest.approx(reference_logp(model, prompt, c.token_ids[:i], sp)[t].item(), abs=1e-4)


def test_logit_bias_of_100_forces_the_token_and_min_p_1_is_greedy():
    engine = ServerEngine(tiny_model(), [EOS], 0, None)
    forced = engine.generate(PROMPTS, SP(n=2, max_tokens=5, seed=0, logit_bias={7: 100.0}))
    assert all(c.token_ids == [7] * 5 for g in forced for c in g)
    greedy = engine.generate(PROMPTS, SP(max_tokens=5, temperature=0))
    assert engine.generate(PROMPTS, SP(max_tokens=5, seed=9, min_p=1.0))[0][0].token_ids == greedy[0][0].token_ids


def test_tiny_top_p_is_greedy():  # the core engine has no top_p: training samples at plain temperature
    engine = ServerEngine(tiny_model(), [EOS], 0, None)
    greedy = engine.generate(PROMPTS, SP(max_tokens=5, temperature=0))
    nucleus = engine.generate(PROMPTS, SP(max_tokens=5, top_p=1e-6, seed=1))
    for g, c in zip(greedy, nucleus):
        assert c[0].token_ids == g[0].token_ids and all(lp == 0.0 for lp in c[0].logprobs)


def test_min_tokens_holds_back_stop_ids_and_ignore_eos_runs_to_the_limit():
    engine = ServerEngine(tiny_model(), [EOS], 0, None)
    eos_everywhere = {EOS: 100.0}
    held = engine.generate(PROMPTS, SP(max_tokens=8, seed=1, min_tokens=3, logit_bias=eos_everywhere))
    assert all(c.token_ids[:3].count(EOS) == 0 and c.token_ids[3] == EOS and c.finish_reason == "stop"
               for g in held for c in g)
    ignored = engine.generate(PROMPTS, SP(max_tokens=6, seed=1, ignore_eos=True, logit_bias=eos_everywhere))
    assert all(c.token_ids == [EOS] * 6 and c.finish_reason == "length" for g in ignored for c in g)
    by_id = engine.generate(PROMPTS, SP(max_tokens=6, seed=1, ignore_eos=True, stop_token_ids=(EOS,),
                                        logit_bias=eos_everywhere))
    assert all(c.token_ids == [EOS] and c.stop_reason == EOS for g in by_id for c in g)


def test_each_request_keeps_its_own_stop_ids():
    engine = ServerEngine(tiny_model(), [], 0, None)
    free, stopped = engine.generate(PROMPTS, [SP(max_tokens=3, seed=1), SP(max_tokens=3, stop_token_ids=tuple(range(32)))])
    assert len(free[0].token_ids) == 3 and free[0].finish_reason == "length"
    assert len(stopped[0].token_ids) == 1 and stopped[0].finish_reason == "stop"


def test_a_stop_string_ends_the_row_and_cuts_the_text_before_it():
    letters = lambda ids: "".join(chr(ord("a") + t % 26) for t in ids)  # a decode: one letter per token
    engine = ServerEngine(tiny_model(), [], 0, letters)
    free = engine.generate(PROMPTS, SP(n=4, max_tokens=10, seed=2))
    for stop in ("e", "fg", "zzz"):
        cut = engine.generate(PROMPTS, SP(n=4, max_tokens=10, seed=2, stop=(stop,)))
        for f, c in zip((c for g in free for c in g), (c for g in cut for c in g)):
            text = letters(f.token_ids)
            end = next((i for i in range(1, len(text) + 1) if stop in text[:i]), None)
            if end is None:
                assert c.token_ids == f.token_ids and c.stop_reason is None and c.finish_reason == "length"
            else:  # the token that completed the string is kept, its log-prob too; the text ends before it
                assert c.token_ids == f.token_ids[:end] and c.logprobs == f.logprobs[:end]
                assert (c.finish_reason, c.stop_reason, c.text) == ("stop", stop, text[:text.index(stop)])



def test_top_logprobs_are_sorted_and_score_the_sampled_token_as_it_was_drawn():
    engine = ServerEngine(tiny_model(), [EOS], 0, None)
    assert engine.generate(PROMPTS, SP(max_tokens=4, seed=2))[0][0].top_logprobs is None
    full = engine.generate(PROMPTS, SP(max_tokens=5, seed=1, logprobs=3))
    for tok, lp, top in zip(full[0][0].token_ids, full[0][0].logprobs, full[0][0].top_logprobs):
        values = list(top.values())
        assert len(top) == 3 and values == sorted(values, reverse=True)
        assert tok not in top or math.isclose(top[tok], lp, abs_tol=1e-6)
