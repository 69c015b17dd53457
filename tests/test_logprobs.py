"""Chunked log-probs through the output head equal the plain full-logits computation, and packed attention as CUDA
runs it (by length and shared prefix, a causal flag) equals the padded masks a CPU uses (values and gradients).

    python -m pytest -q tests/test_logprobs.py
"""
import random

import pytest
import torch
from conftest import sequence_logprobs, tiny_model

import minigrpo.model
from minigrpo.lora import inject_lora, lora_layers
from minigrpo.model import packed_logprobs, plan_packed_row
from minigrpo.packing import Sample, collate


def full_logits_logprobs(model, ids, attn, temperature):
    """The textbook way: the whole (B, L-1, V) log_softmax, as the trainer computed it before."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # (B, L-1, V)
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, L-1, V)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1), entropy.detach()


def lora_grads(model, fn, weights):
    model.zero_grad()
    logp, entropy = fn()
    (logp * weights).sum().backward()
    return logp, entropy, [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_chunked_logprobs_entropy_and_gradients_equal_the_full_logits(arch, monkeypatch):
    monkeypatch.setattr(minigrpo.model, "CHUNK_LOGITS", 3 * 500)  # 3 tokens a chunk: chunk edges inside rows
    model = tiny_model(arch, vocab=500)
    inject_lora(model, r=2, alpha=4)
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(std=0.2)
    ids = torch.randint(2, 500, (3, 11))
    attn = torch.ones_like(ids)
    attn[1, 7:], attn[2, 4:] = 0, 0  # right padding
    weights = torch.randn(3, 10) * attn[:, 1:]
    new = lora_grads(model, lambda: sequence_logprobs(model, ids, attn, 0.7), weights)
    ref = lora_grads(model, lambda: full_logits_logprobs(model, ids, attn, 0.7), weights)
    for a, b in zip(new[:2], ref[:2]):
        torch.testing.assert_close(a * attn[:, 1:], b * attn[:, 1:], atol=1e-5, rtol=0)
    for a, b in zip(new[2], ref[2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert not new[1].requires_grad


def packed_row():
    """Three prompts (two of one length) and their completions, each prompt's first one continuing its run: runs of
    one length under several prefixes, three of one (length, prefix) from two prompts, one-token completions."""
    rng, seqs = random.Random(0), []
    for P, lengths in ((5, [2, 3, 3, 1, 5]), (3, [4, 5, 2, 1]), (5, [1, 3, 4])):
        prompt = [rng.randrange(2, 32) for _ in range(P)]
        seqs += [Sample(prompt + [rng.randrange(2, 32) for _ in range(n)], P, [0.0] * n, 1.0) for n in lengths]
    return collate(seqs, torch.device("cpu"))[0]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_attention_as_cuda_runs_it_equals_the_padded_masks(arch, monkeypatch, checkpointing):
    model = tiny_model(arch)
    inject_lora(model, r=2, alpha=4)
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(std=0.2)
    if checkpointing:  # the layers get the plan, its flags too, again in the backward
        model.activation_checkpointing_enable({"use_reentrant": False})
        model.train()
    ids, pos, where, targets = packed_row()
    cpu = plan_packed_row(pos, torch.device("cpu"))
    by_length = sorted((len(idx), idx.shape[1], keys.shape[1] - idx.shape[1]) for idx, keys, _ in cpu)  # (k, L, Q)
    assert by_length == [(1, 2, 3), (1, 4, 5), (1, 6, 0), (2, 1, 5), (2, 5, 5), (2, 7, 0), (3, 3, 5)]  # Q: the longest
    weights = torch.randn(targets.shape)
    run = lambda: lora_grads(model, lambda: packed_logprobs(model, ids, pos, where, targets, 0.7), weights)  # noqa: E731
    masks = run()
    monkeypatch.setattr(minigrpo.model, "FLAG_DEVICES", ("cpu",))  # as on CUDA (SDPA makes each flag a mask here)
    plan = plan_packed_row(pos, torch.device("cpu"))
    groups = sorted((len(idx), idx.shape[1], keys.shape[1] - idx.shape[1]) for idx, keys, _ in plan)  # (k, L, q)
    assert groups == [(1, 1, 3), (1, 1, 5), (1, 2, 3), (1, 4, 5), (1, 5, 3), (1, 5, 5), (1, 6, 0), (2, 7, 0), (3, 3, 5)]
    assert all(type(mask).__name__ == "CausalBias" for idx, keys, mask in plan if keys.shape[1] > idx.shape[1])
    flags = run()
    for a, b in zip(flags[:2] + tuple(flags[2]), masks[:2] + tuple(masks[2])):  # log-probs, entropies, LoRA gradients
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
