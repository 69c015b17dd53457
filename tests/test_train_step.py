"""The trainer's step on a tiny model: every loss type and option runs, packed micro-batches equal unpacked ones.

    python -m pytest -q tests/test_train_step.py
"""
import random

import pytest
import torch
from conftest import tiny_model

from minigrpo.lora import inject_lora, lora_layers
from minigrpo.model import PACKED_SDPA, enable_checkpointing, packed_logprobs, sequence_logprobs
from minigrpo.run import RunSettings
from train import Sample, TrainConfig, collate, micro_batches, train_step


def sequences(model, n=12, seed=0):
    """Sequences whose behaviour log-probs are the model's own, as a generator at the same weights records them."""
    rng = random.Random(seed)
    seqs = []
    for i in range(n):
        P, T = rng.randrange(2, 6), rng.randrange(1, 8)
        ids = [rng.randrange(2, 32) for _ in range(P + T)]
        t = torch.tensor([ids])
        with torch.no_grad():
            logp = sequence_logprobs(model, t, torch.ones_like(t), 1.0)[0][0, P - 1:].tolist()
        seqs.append(Sample(ids, P, logp, 1.0 if i % 2 else -1.0))
    return seqs


@pytest.mark.parametrize("options", [dict(loss_type="grpo"), dict(loss_type="dapo"), dict(loss_type="dr_grpo"),
                                     dict(old_logp="recompute"), dict(beta=0.1), dict(tis_cap=2.0, is_mode="seq_mask")])
def test_every_option_trains_and_starts_on_policy(options):
    model = tiny_model()
    inject_lora(model, 4, 8)
    seqs = sequences(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = [l.lora_B.detach().clone() for l in lora_layers(model).values()]
    m = train_step(model, opt, seqs, RunSettings(max_new_tokens=8), TrainConfig(micro_batch_tokens=16, **options),
                   torch.device("cpu"))
    assert m["perf/micro_batches"] > 1 and torch.isfinite(torch.tensor(m["loss"])) and m["grad_norm"] > 0
    assert abs(m["ratio/mean"] - 1) < 1e-5, "same weights, same numerics: the first ratio is 1"
    assert any(not torch.equal(b, l.lora_B) for b, l in zip(before, lora_layers(model).values()))


def test_micro_batches_cover_each_sequence_once_within_the_token_budget():
    rng = random.Random(0)
    seqs = [Sample([0] * rng.randrange(5, 300), 1, [], 0.0) for _ in range(200)]
    batches = micro_batches(seqs, budget=1024)
    assert sorted(id(s) for mb in batches for s in mb) == sorted(id(s) for s in seqs)
    assert all(sum(len(s.ids) for s in mb) <= 1024 for mb in batches)
    assert len(batches) <= sum(len(s.ids) for s in seqs) // 1024 + 2, "first-fit decreasing leaves little room"
    long = Sample([0] * 50, 1, [], 0.0)
    assert micro_batches([long], budget=16) == [[long]], "too long: a micro-batch of its own"


def lora_model(arch="qwen2"):
    model = tiny_model(arch)
    inject_lora(model, 4, 8)
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(std=0.1)
    return model


@pytest.mark.parametrize("attention", ["sdpa", PACKED_SDPA])  # transformers' block-diagonal mask; ours, per sequence
def test_packed_sequences_see_only_themselves(arch, attention):
    model, seqs = lora_model(arch), sequences(tiny_model(), n=5)
    model.set_attn_implementation(attention)
    (ids, pos, where), batch = collate(seqs, torch.device("cpu"))
    logp, entropy = packed_logprobs(model, ids, pos, where, 0.7)  # (5, L-1)
    for i, s in enumerate(seqs):
        alone = torch.tensor([s.ids])
        a_logp, a_entropy = sequence_logprobs(model, alone, torch.ones_like(alone), 0.7)
        n = len(s.ids) - 1
        torch.testing.assert_close(logp[i, :n], a_logp[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy[i, :n], a_entropy[0], atol=1e-5, rtol=0)
    leaky, _ = sequence_logprobs(model, ids, None, 0.7, position_ids=torch.arange(ids.shape[1])[None])
    assert (leaky[0, where] - logp).mul(batch.mask).abs().max() > 1e-3, "attending across sequences would show"


def test_packed_step_equals_one_sequence_per_micro_batch():
    results = []
    for budget in (10_000, 1):  # all 12 sequences in one packed row; each sequence alone
        model = lora_model()
        model.set_attn_implementation(PACKED_SDPA)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        m = train_step(model, opt, sequences(tiny_model()), RunSettings(max_new_tokens=8),
                       TrainConfig(micro_batch_tokens=budget, max_grad_norm=1e9), torch.device("cpu"))
        results.append((m, [p.detach().clone() for p in model.parameters() if p.requires_grad]))
    (packed, w_packed), (alone, w_alone) = results
    assert (packed["perf/micro_batches"], alone["perf/micro_batches"]) == (1, 12)
    assert abs(packed["loss"] - alone["loss"]) < 1e-6 and abs(packed["entropy"] - alone["entropy"]) < 1e-5
    for a, b in zip(w_packed, w_alone):  # w - lr * grad: equal weights, equal gradients
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_gradient_checkpointing_gives_the_same_step():
    results = []
    for checkpointing in (False, True):
        model = tiny_model()
        inject_lora(model, 4, 8)
        torch.manual_seed(0)
        with torch.no_grad():
            for layer in lora_layers(model).values():
                layer.lora_B.normal_(std=0.1)
        if checkpointing:
            enable_checkpointing(model)
            assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        m = train_step(model, opt, sequences(model), RunSettings(max_new_tokens=8),
                       TrainConfig(gradient_checkpointing=checkpointing), torch.device("cpu"))
        results.append((m["loss"], [l.lora_A.detach().clone() for l in lora_layers(model).values()]))
        assert not model.training
    assert abs(results[0][0] - results[1][0]) < 1e-6
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_bf16_base_weights_train_float32_lora_with_float32_log_probs():
    model = tiny_model().to(torch.bfloat16)
    inject_lora(model, 4, 8)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if ".lora_" in n)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    m = train_step(model, opt, sequences(model), RunSettings(max_new_tokens=8), TrainConfig(), torch.device("cpu"))
    assert torch.isfinite(torch.tensor([m["loss"], m["grad_norm"]])).all() and m["grad_norm"] > 0
    assert abs(m["ratio/mean"] - 1) < 1e-3  # the behaviour log-probs came from the same bf16 model
