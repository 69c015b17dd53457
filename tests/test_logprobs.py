"""Chunked log-probs through the output head equal the plain full-logits computation (values and gradients).

    python -m pytest -q tests/test_logprobs.py
"""
import torch
from conftest import sequence_logprobs, tiny_model

import minigrpo.model
from minigrpo.lora import inject_lora, lora_layers


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
