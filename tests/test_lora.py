"""Hand-written LoRA: the math, the trainable set, and round trips with the real peft package both ways.

    python -m pytest -q tests/test_lora.py
"""
import json
import os

import peft
import pytest
import torch
import torch.nn as nn
from conftest import tiny_model

from minigrpo.lora import (DEFAULT_TARGETS, LoRALinear, adapter_config, adapter_digest, adapter_files, inject_lora,
                           load_adapter, load_lora_state_dict, lora_layers, lora_state_dict)
from minigrpo.storage import Storage

IDS = torch.tensor([[3, 7, 1, 9, 4, 2, 8, 5]])


def randomize_b(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * 0.1)


def test_forward_matches_the_hand_computed_example():
    base = nn.Linear(2, 2, bias=False)
    base.weight.data = torch.eye(2)
    layer = LoRALinear(base, r=1, alpha=2)
    layer.lora_A.data, layer.lora_B.data = torch.tensor([[1., 2]]), torch.tensor([[0.5], [-1]])
    x = torch.tensor([1., 1])
    torch.testing.assert_close(layer(x), torch.tensor([4., -5]))  # (W + (alpha/r) B A) x, W = I: [[2, 2], [-2, -3]] x


def test_a_bf16_layer_keeps_its_input_for_the_backward_not_a_float32_copy():
    """Same gradients as autograd through x.float(), but the saved tensors hold x itself (half the bytes)."""
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(64, 32, bias=False).to(torch.bfloat16).requires_grad_(False), r=4, alpha=8)
    nn.init.normal_(layer.lora_B)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x)
    assert [t.dtype for t in saved if t.numel() == x.numel()] == [torch.bfloat16], "x kept once, in bf16"
    out.float().square().sum().backward()
    mine = [x.grad, layer.lora_A.grad, layer.lora_B.grad]
    x.grad = layer.lora_A.grad = layer.lora_B.grad = None
    h = (x.float() @ layer.lora_A.T) * layer.scaling  # autograd's own way
    (layer.base(x) + (h @ layer.lora_B.T).to(torch.bfloat16)).float().square().sum().backward()
    for a, b in zip(mine, [x.grad, layer.lora_A.grad, layer.lora_B.grad]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # h comes out in bf16 here; A's gradient is still float32
        layer(x[0, 0].detach()).float().sum().backward()  # and one 1-D input
    assert layer.lora_A.grad.dtype == torch.float32


def test_fresh_adapter_is_identity(arch):
    model = tiny_model(arch)
    before = model(IDS).logits
    inject_lora(model, r=4, alpha=8)
    assert torch.equal(model(IDS).logits, before)


def test_only_lora_parameters_train_and_every_target_is_wrapped(arch):
    model = tiny_model(arch)
    inject_lora(model, r=2, alpha=4)
    assert len(lora_layers(model)) == 2 * len(DEFAULT_TARGETS)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A" in n or ".lora_B" in n for n in trainable)


def test_save_writes_peft_names_and_loads_back(tmp_path, arch):
    model = tiny_model(arch)
    inject_lora(model, r=4, alpha=8)
    randomize_b(model)
    Storage(str(tmp_path)).put_many(adapter_files(lora_state_dict(model), adapter_config(4, 8, DEFAULT_TARGETS, "tiny")))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    keys = lora_state_dict(model).keys()
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys
    other = tiny_model(arch)
    inject_lora(other, r=4, alpha=8)
    load_adapter(other, str(tmp_path))
    torch.testing.assert_close(other(IDS).logits, model(IDS).logits)


def test_adapter_of_another_shape_is_refused_with_the_reason(tmp_path):
    model = tiny_model()
    inject_lora(model, r=4, alpha=8)
    Storage(str(tmp_path)).put_many(adapter_files(lora_state_dict(model), adapter_config(4, 8, DEFAULT_TARGETS, "tiny")))
    other = tiny_model()
    inject_lora(other, r=2, alpha=8)
    with pytest.raises(ValueError, match="do not fit rank 4"):  # a higher rank than the layers'
        load_adapter(other, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_adapter(other, str(tmp_path / "missing"))


def test_a_checkpoints_adapter_must_cover_every_layer():
    model = tiny_model()
    inject_lora(model, r=4, alpha=8)
    partial = {k: v for k, v in lora_state_dict(model).items() if "q_proj" not in k}
    with pytest.raises(ValueError, match="missing .*q_proj"):
        load_lora_state_dict(model, partial)


def test_our_adapter_loads_in_peft_with_the_same_logits(tmp_path, arch):
    model = tiny_model(arch)
    inject_lora(model, r=4, alpha=8)
    randomize_b(model)
    Storage(str(tmp_path)).put_many(adapter_files(lora_state_dict(model), adapter_config(4, 8, DEFAULT_TARGETS, "tiny")))
    theirs = peft.PeftModel.from_pretrained(tiny_model(arch), str(tmp_path)).eval()
    torch.testing.assert_close(theirs(IDS).logits, model(IDS).logits, atol=1e-5, rtol=1e-5)


def test_peft_adapter_loads_in_ours_with_the_same_logits(tmp_path, arch):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(DEFAULT_TARGETS), init_lora_weights=False)
    theirs = peft.get_peft_model(tiny_model(arch), config).eval()
    theirs.save_pretrained(str(tmp_path))
    assert os.path.isfile(tmp_path / "adapter_model.safetensors")
    ours = tiny_model(arch)
    inject_lora(ours, r=4, alpha=8)
    load_adapter(ours, str(tmp_path))
    torch.testing.assert_close(ours(IDS).logits, theirs(IDS).logits, atol=1e-5, rtol=1e-5)
    assert not torch.equal(ours(IDS).logits, tiny_model(arch)(IDS).logits), "the adapter must change the output"


@pytest.mark.parametrize("use_rslora", [False, True])
def test_rslora_round_trips_with_peft_in_both_directions(tmp_path, use_rslora):
    """rsLoRA scales by alpha / sqrt(r): 8 / 2 = 4 here, where plain LoRA scales by 8 / 4 = 2."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(DEFAULT_TARGETS), init_lora_weights=False,
                             use_rslora=use_rslora)
    theirs = peft.get_peft_model(tiny_model(), config).eval()
    theirs.save_pretrained(str(tmp_path / "theirs"))
    ours = tiny_model()
    inject_lora(ours, r=4, alpha=8, use_rslora=use_rslora)
    assert load_adapter(ours, str(tmp_path / "theirs")) == adapter_digest(
        (tmp_path / "theirs" / "adapter_model.safetensors").read_bytes())
    torch.testing.assert_close(ours(IDS).logits, theirs(IDS).logits, atol=1e-5, rtol=1e-5)
    Storage(str(tmp_path / "ours")).put_many(adapter_files(lora_state_dict(ours), adapter_config(4, 8, DEFAULT_TARGETS, "tiny", use_rslora)))
    back = peft.PeftModel.from_pretrained(tiny_model(), str(tmp_path / "ours")).eval()
    torch.testing.assert_close(back(IDS).logits, theirs(IDS).logits, atol=1e-5, rtol=1e-5)


def test_an_adapter_of_a_lower_rank_or_another_scaling_loads_with_its_own_as_in_vllm(tmp_path):
    model = tiny_model()
    inject_lora(model, r=2, alpha=8, use_rslora=True)
    randomize_b(model)
    Storage(str(tmp_path)).put_many(adapter_files(lora_state_dict(model), adapter_config(2, 8, DEFAULT_TARGETS, "tiny", use_rslora=True)))
    plain = tiny_model()
    inject_lora(plain, r=4, alpha=8)
    load_adapter(plain, str(tmp_path))  # rank 2 zero-padded to 4, scaling 8 / sqrt(2) in place of 8 / 4
    torch.testing.assert_close(plain(IDS).logits, model(IDS).logits)
