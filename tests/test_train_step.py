"""The trainer's step on a tiny model: every loss type and option runs, packed micro-batches equal unpacked ones.

    python -m pytest -q tests/test_train_step.py
"""
import random

import pytest
import torch
from conftest import sequence_logprobs, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from minigrpo.lora import inject_lora, lora_layers
from minigrpo.model import packed_logprobs
from minigrpo.run import RunSettings
from minigrpo.packing import Sample, collate, micro_batches
from train import TrainConfig, train_step


def sequences(model, n=12, G=4, seed=0):
    """n completions of n / G prompts, with the model's own behaviour log-probs, as a generator at the same weights
    records them. G=1: every sequence has a prompt of its own."""
    rng = random.Random(seed)
    seqs = []
    for i in range(n):
        if i % G == 0:
            prompt = [rng.randrange(2, 32) for _ in range(rng.randrange(2, 6))]
        ids = prompt + [rng.randrange(2, 32) for _ in range(rng.randrange(1, 8))]
        t = torch.tensor([ids])
        with torch.no_grad():
            logp = sequence_logprobs(model, t, torch.ones_like(t), 1.0)[0][0, len(prompt) - 1:].tolist()
        seqs.append(Sample(ids, len(prompt), logp, 1.0 if i % 2 else -1.0))
    return seqs


@pytest.mark.parametrize("options", [dict(loss_type="grpo"), dict(loss_type="dapo"), dict(loss_type="dr_grpo"),
                                     dict(old_logp="recompute"), dict(tis_cap=2.0)])
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


def row_tokens(mb):
    """The length of a micro-batch's packed row: each prompt once, then every completion."""
    return sum(len(p) for p in {tuple(s.ids[:s.prompt_len]) for s in mb}) + sum(len(s.ids) - s.prompt_len for s in mb)


def test_micro_batches_cover_each_sequence_once_within_the_token_budget():
    rng = random.Random(0)
    prompts = [[p] * rng.randrange(1, 40) for p in range(25)]
    seqs = [Sample(p + [0] * rng.randrange(5, 300), len(p), [], 0.0) for p in prompts for _ in range(8)]
    batches = micro_batches(seqs, budget=1024)
    assert sorted(id(s) for mb in batches for s in mb) == sorted(id(s) for s in seqs)
    assert all(row_tokens(mb) <= 1024 for mb in batches)
    assert sum(len({tuple(s.ids[:s.prompt_len]) for s in mb}) for mb in batches) < len(seqs) / 2, "prompts shared"
    assert len(batches) <= sum(row_tokens(mb) for mb in batches) // 1024 + 2, "first-fit decreasing leaves little room"
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


@pytest.mark.parametrize("G", [1, 3])  # a prompt per sequence; prompts shared by 3 completions
def test_packed_sequences_see_only_themselves(arch, G):
    model, seqs = lora_model(arch), sequences(tiny_model(), n=6, G=G)
    (ids, pos, where, targets), batch = collate(seqs, torch.device("cpu"))
    assert ids.shape[1] == sum(len(s.ids) for s in seqs) - (G - 1) * sum(s.prompt_len for s in seqs[::G])
    logp, entropy = packed_logprobs(model, ids, pos, where, targets, 0.7)  # (6, T)
    for i, s in enumerate(seqs):
        alone = torch.tensor([s.ids])
        a_logp, a_entropy = sequence_logprobs(model, alone, torch.ones_like(alone), 0.7)
        n = len(s.ids) - s.prompt_len
        torch.testing.assert_close(logp[i, :n], a_logp[0, s.prompt_len - 1:], atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy[i, :n], a_entropy[0, s.prompt_len - 1:], atol=1e-5, rtol=0)
        assert logp[i, n:].eq(0).all() and batch.mask[i].sum() == n
    leaky, _ = packed_logprobs(model, ids, torch.arange(ids.shape[1])[None], where, targets, 0.7)
    assert (leaky - logp).mul(batch.mask).abs().max() > 1e-3, "attending across sequences would show"


def test_a_forward_reads_its_packed_layout_once_for_all_its_layers(monkeypatch, arch):
    import minigrpo.model as m
    model, seqs = lora_model(arch), sequences(tiny_model(), n=4, G=2)
    (ids, pos, where, targets), _ = collate(seqs, torch.device("cpu"))
    built, run_plan = [], m.run_plan
    monkeypatch.setattr(m, "run_plan", lambda L, spans, dev: built.append(L) or run_plan(L, spans, dev))
    packed_logprobs(model, ids, pos, where, targets, 1.0)
    assert model.config.num_hidden_layers == 2 and built and len(built) == len(set(built)), "once, not once a layer"
    packed_logprobs(model, ids, pos, where, targets, 1.0)  # the next forward reads them again
    assert len(built) == 2 * len(set(built))


def test_packed_rows_need_the_packed_attention():
    model, seqs = lora_model(), sequences(tiny_model(), n=4)
    model.set_attn_implementation("sdpa")  # would let the completions of a prompt see each other
    with pytest.raises(ValueError, match="attn_implementation='minigrpo_packed_sdpa'"):
        packed_logprobs(model, *collate(seqs, torch.device("cpu"))[0], 1.0)


def test_a_branch_sharing_more_than_its_sequence_holds_is_refused():
    model = lora_model()
    ids, pos = torch.tensor([[3, 4, 5, 6]]), torch.tensor([[0, 1, 3, 4]])  # the run at token 2 claims 3 shared tokens
    with pytest.raises(ValueError, match="the run at token 2 shares 3 tokens, its sequence's first run has 2"):
        packed_logprobs(model, ids, pos, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), 1.0)


def test_packed_step_equals_one_sequence_per_micro_batch():
    results = []
    for budget in (10_000, 1):  # all 12 sequences in one packed row; each sequence alone
        model = lora_model()
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
            model.activation_checkpointing_enable({"use_reentrant": False})
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


class DeviceReads(TorchDispatchMode):
    """Records each operation that makes a GPU's host wait for the device: reading a value (.item(), .tolist(), bool(),
    .cpu(), .numpy()) or a shape that depends on values (nonzero, boolean indexing), on a tensor computed on the
    device. The layout collate leaves on the host, and what is computed from it alone, is on the host (tagged `host`);
    .to(a device) gives a tensor of the device's (the CPU stands in for it here, where .to would return the same one)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.reads = []
        for name in ("tolist", "cpu", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _f=getattr(torch.Tensor, name), _n=name, **k:
                                self.read(_n, [t]) or _f(t, *a, **k))
        to = torch.Tensor.to

        def to_device(t, *args, **kwargs):
            out = to(t, *args, **kwargs)
            if any(isinstance(a, (torch.device, str)) for a in (*args, kwargs.get("device"))):
                out = out.clone()
                out.host = False
            return out
        monkeypatch.setattr(torch.Tensor, "to", to_device)

    def read(self, what, tensors):
        if not all(getattr(t, "host", False) for t in tensors):
            self.reads.append(what)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        aten = torch.ops.aten
        if func in (aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
                    aten.equal.default) or (func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default)
                                            and any(t.dtype == torch.bool for t in tensors[1:])):
            self.read(str(func), tensors)
        out = func(*args, **(kwargs or {}))
        if tensors and all(getattr(t, "host", False) for t in tensors):
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    t.host = True
        return out


def test_a_step_reads_the_device_once(monkeypatch):
    """One transfer a step (its metrics and the gradient norm), however many micro-batches: ~15 reads per micro-batch
    before, some between forward and backward (transformers' own check for packed rows among them), each a stall of a
    GPU's queue."""
    import train
    model = lora_model()
    seqs = sequences(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train_step(model, opt, seqs, RunSettings(max_new_tokens=8), TrainConfig(), torch.device("cpu"))  # Adam's state
    for state in opt.state.values():
        state["step"].host = True  # a GPU's Adam keeps its step count on the host
    real_collate, reads = collate, DeviceReads(monkeypatch)

    def host_layout(samples, device, *args):
        (ids, *layout), batch = real_collate(samples, device, *args)
        for t in layout:  # pos, where, targets: built from lists, never on the device
            t.host = True
        return (ids, *layout), batch

    monkeypatch.setattr(train, "collate", host_layout)
    with reads:
        m = train_step(model, opt, seqs, RunSettings(max_new_tokens=8), TrainConfig(micro_batch_tokens=16),
                       torch.device("cpu"))
    assert m["perf/micro_batches"] > 3 and reads.reads == ["tolist"], reads.reads


def test_micro_batches_come_largest_first_so_that_ranks_dealt_them_in_turn_differ_by_one_at_most():
    """train_step deals the micro-batches out to the ranks in turn (rank r: r, r + world, ...). Largest first, the
    ranks' packed tokens differ by at most the largest micro-batch, whatever the spread of sequence lengths."""
    seqs = sequences(tiny_model(), n=96, G=4, seed=1)
    for budget in (16, 32, 64):
        sizes = [row_tokens(mb) for mb in micro_batches(seqs, budget)]
        assert sizes == sorted(sizes, reverse=True) and len(sizes) > 4
        for world in (2, 3, 4, 8):
            tokens = [sum(sizes[r::world]) for r in range(world)]
            assert max(tokens) - min(tokens) <= sizes[0] <= budget, (budget, world, tokens)
