"""The loss and advantages against hand-computed cases (T1-T12).

    python -m pytest -q tests/test_grpo.py
"""
import math

import pytest
import torch

from minigrpo.grpo import Batch, LossConfig, advantages, combine_metrics, grpo_loss, zero_std_groups
from minigrpo.run import RunSettings, parse_config

close = lambda a, b, tol=1e-6: torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64),
                                                          torch.as_tensor(b, dtype=torch.float64), rtol=0, atol=tol)



def loss_of(logp, old, behav, adv, mask, loss_type="grpo", eps_low=0.2, eps_high=None, tis_cap=None,
            max_new_tokens=None, num_seqs=None, num_tokens=None):
    """grpo_loss with the tensors and settings spelled out, as the hand computations name them."""
    batch = Batch(behav, adv, mask, old=old, num_seqs=num_seqs, num_tokens=num_tokens)
    return grpo_loss(logp, batch, LossConfig(loss_type, eps_low, eps_high, tis_cap), max_new_tokens)

def test_t1_scaled_advantage_uses_unbiased_std():
    close(advantages(torch.tensor([1., 0, 0, 1]), 4, eps=0), [0.8660254, -0.8660254, -0.8660254, 0.8660254])
    torch.testing.assert_close(advantages(torch.tensor([1., 0, 0, 1]), 4, eps=1e-6)[0], torch.tensor(0.8660239), rtol=1e-5, atol=0)


def test_t2_asymmetric_group_and_scale_invariance():
    close(advantages(torch.tensor([1., 0, 0, 0]), 4, eps=0), [1.5, -0.5, -0.5, -0.5])
    close(advantages(torch.tensor([1., -1, -1, -1]), 4, eps=0), [1.5, -0.5, -0.5, -0.5])


def test_t3_zero_std_groups_give_exact_zeros_and_are_counted():
    for scale in (True, False):
        for r in ([1., 1, 1, 1], [0., 0, 0, 0], [0.1, 0.1, 0.1, 0.1]):
            adv = advantages(torch.tensor(r), 4, scale_rewards=scale)
            assert torch.equal(adv, torch.zeros(4))
    batch = torch.tensor([1., 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0])
    zero = zero_std_groups(batch, 4)
    assert zero.float().mean().item() == 0.5
    assert batch.view(-1, 4)[~zero].numel() == 8


def test_group_of_one_is_rejected():
    with pytest.raises(ValueError, match="at least 2"):
        advantages(torch.tensor([1.0, 0.0]), 1)


def test_t4_dr_grpo_advantage_is_centred_not_scaled():
    close(advantages(torch.tensor([1., 0, 0, 0]), 4, scale_rewards=False), [0.75, -0.25, -0.25, -0.25])


@pytest.mark.parametrize("eps_high, expected", [(0.2, [-1.2, 0.8, 1.5, -0.5, -2.2]), (0.28, [-1.28, 0.8, 1.5, -0.5, -2.2])])
def test_t5_clipped_surrogate_per_token(eps_high, expected):
    r = torch.tensor([1.5, 0.5, 1.5, 0.5, 1.1])
    A = torch.tensor([1., -1, -1, 1, 2])
    logp = torch.log(r).requires_grad_()
    zeros = torch.zeros(5, 1)
    # one token per sequence, dapo with num_tokens=1 sums the per-token losses; check them one by one
    for i in range(5):
        loss, m = loss_of(logp[i:i + 1, None], zeros[i:i + 1], zeros[i:i + 1], A[i:i + 1], torch.ones(1, 1),
                            "dapo", 0.2, eps_high)
        close(loss.item(), expected[i], 1e-6)
        grad, = torch.autograd.grad(loss, logp)
        assert (grad[i] == 0) == (i in (0, 1)), "clipped tokens carry no gradient, unclipped ones do"
    _, m = loss_of(logp[:, None], zeros, zeros, A, torch.ones(5, 1), "dapo", 0.2, 0.2)
    close(m["clip_ratio/low"], 0.2)
    close(m["clip_ratio/high"], 0.2)


@pytest.mark.parametrize("loss_type, expected", [("grpo", 1.5), ("dapo", 10 / 6), ("dr_grpo", 0.625)])
def test_t6_aggregation_and_padding_does_not_matter(loss_type, expected):
    # with ratio 1 the per-token loss is -A: A = -1 gives losses [1, 1], A = -2 gives [2, 2, 2, 2]
    loss, _ = loss_of(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 4), torch.tensor([-1., -2]),
                        torch.tensor([[1., 1, 0, 0], [1, 1, 1, 1]]), loss_type, max_new_tokens=8)
    close(loss.item(), expected)
    garbage = torch.tensor([[0., 0, 5.0, -7.0], [0, 0, 0, 0]])  # padded positions hold arbitrary values
    mask = torch.tensor([[1., 1, 0, 0], [1, 1, 1, 1]])
    loss, _ = loss_of(garbage, garbage, garbage, torch.tensor([-1., -2]), mask, loss_type, max_new_tokens=8)
    close(loss.item(), expected)


T7 = {"grpo": (0.0, [-0.1767767, 0.1178511]), "dapo": (0.1414214, [-0.1414214, 0.1414214]),
      "dr_grpo": (0.0625, [-0.0625, 0.0625])}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_t7_end_to_end_gradients_on_policy(loss_type):
    scale = loss_type != "dr_grpo"
    adv = advantages(torch.tensor([1., 0]), 2, scale_rewards=scale, eps=0)
    close(adv, [0.7071068, -0.7071068] if scale else [0.5, -0.5])
    mask = torch.tensor([[1., 1, 0], [1, 1, 1]])
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    loss, m = loss_of(logp, logp.detach(), logp.detach(), adv, mask, loss_type, max_new_tokens=4)
    loss.backward()
    value, (g1, g2) = T7[loss_type]
    close(loss.item(), value)
    close(logp.grad, [[g1, g1, 0], [g2, g2, g2]])
    assert m["ratio/mean"] == 1.0


def test_t7_dr_grpo_with_scaled_advantages():
    adv = advantages(torch.tensor([1., 0]), 2, eps=0)
    mask = torch.tensor([[1., 1, 0], [1, 1, 1]])
    loss, _ = loss_of(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), adv, mask, "dr_grpo", max_new_tokens=4)
    close(loss.item(), 0.0883883)


def test_t8_importance_weights_are_truncated_per_token():
    old, behav, mask = torch.tensor([[-0.1, -1.0, -2.0]]), torch.tensor([[-0.2, -0.5, -3.0]]), torch.ones(1, 3)
    logp = old.clone().requires_grad_()  # ratio 1: each token's loss is -w * A with A = 1
    loss, m = loss_of(logp, old, behav, torch.tensor([1.0]), mask, "dapo", tis_cap=2.0)
    close(loss.item(), -(1.1051709 + 0.6065307 + 2.0) / 3)  # w = min(pi_old / mu, 2)
    close(m["is/mean"], (1.1051709 + 0.6065307 + 2.7182818) / 3)
    close(m["is/frac_capped"], 1 / 3)


@pytest.mark.parametrize("behav, loss_value", [(-1.5, -1.8221188), (-2.0, -2.2103418)])
def test_t9_recompute_mode_weights_by_truncated_is(behav, loss_value):
    logp = torch.tensor([[-0.9]], requires_grad=True)
    old = torch.tensor([[-1.0]], requires_grad=True)
    behav_t = torch.tensor([[behav]], requires_grad=True)
    loss, _ = loss_of(logp, old, behav_t, torch.tensor([1.0]), torch.ones(1, 1), "dapo", 0.2, 0.28, tis_cap=2.0)
    loss.backward()
    close(loss.item(), loss_value)
    close(logp.grad.item(), loss_value)
    assert old.grad is None and behav_t.grad is None


def test_t9_behaviour_mode_clips_the_same_token():
    logp = torch.tensor([[-0.9]], requires_grad=True)
    behav = torch.tensor([[-1.5]])
    loss, _ = loss_of(logp, behav, behav, torch.tensor([1.0]), torch.ones(1, 1), "dapo", 0.2, 0.28)
    loss.backward()
    close(loss.item(), -1.28)
    assert logp.grad.item() == 0.0


def test_t10_ratio_metrics():
    log_ratio = torch.tensor([[0.1, -0.2]])
    _, m = loss_of(log_ratio, torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), "dapo")
    close([m["ratio/mean"], m["ratio/min"], m["ratio/max"], m["health/mismatch_kl"]],
          [0.9619508, 0.8187308, 1.1051709, 0.0119508])


def test_t12_staleness_filter_is_strict():
    assert [RunSettings(max_staleness=4).is_fresh(10, v) for v in (10, 7, 6, 5)] == [True, True, True, False]


def test_the_masked_metrics_equal_the_same_formulas_over_the_valid_tokens_alone():
    """The metrics are masked sums (no boolean indexing, which would make a GPU's host wait): padding that is far off in
    every way (ratio, clip, v) must change none of them. Reference: each formula over the valid tokens, indexed out."""
    torch.manual_seed(1)
    B, T = 4, 6
    mask = (torch.rand(B, T) < 0.6).float()
    mask[:, 0] = 1
    behav, adv = -torch.rand(B, T), torch.tensor([1.0, -1.0, 0.5, -2.0])
    old = behav + 0.8 * torch.randn(B, T)
    for ratio in (None, 1.2, 0.8):  # random; every valid ratio above 1, then below (padding's ratio is 1)
        logp = old + (0.5 * torch.randn(B, T) if ratio is None else math.log(ratio) + 0.05 * torch.rand(B, T))
        check_masked_metrics(torch.where(mask.bool(), logp, behav + 9.0), old, behav, adv, mask)  # padding far off


def check_masked_metrics(logp, old, behav, adv, mask):
    B, T = mask.shape
    _, m = loss_of(logp, old, behav, adv, mask, "dapo", tis_cap=2.0)
    valid = mask.bool()
    r, A = torch.exp(logp - old)[valid], adv[:, None].expand(B, T)[valid]
    is_ratio, log_v = torch.exp(old - behav)[valid], (logp - behav)[valid]
    v = torch.exp(log_v)
    expected = {"tokens": valid.sum(), "ratio/mean": r.mean(), "ratio/min": r.min(), "ratio/max": r.max(),
                "clip_ratio/low": ((r < 0.8) & (A < 0)).float().mean(), "clip_ratio/high": ((r > 1.28) & (A > 0)).float().mean(),
                "is/mean": is_ratio.mean(), "is/frac_capped": (is_ratio > 2.0).float().mean(), "health/v_mean": v.mean(),
                "health/v_sq_mean": (v * v).mean(), "health/mismatch_kl": ((v - 1) - log_v).mean(),
                "health/far_frac": (log_v.abs() > math.log(2)).float().mean()}
    assert m.keys() == expected.keys()
    for k in expected:
        close(m[k], expected[k], tol=1e-5)
    assert 0 < m["health/far_frac"] < 1 and 0 < m["is/frac_capped"] < 1, "the cases are exercised"


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_with_the_global_normaliser_match_the_full_batch(loss_type):
    torch.manual_seed(0)
    B, T = 6, 5
    mask = (torch.rand(B, T) < 0.7).float()
    mask[:, 0] = 1
    logp = (-torch.rand(B, T)).requires_grad_()
    old, adv = logp.detach() - 0.1 * torch.rand(B, T), torch.randn(B)
    full, _ = loss_of(logp, old, old, adv, mask, loss_type, max_new_tokens=T)
    g_full, = torch.autograd.grad(full, logp)
    kw = dict(num_seqs=B, num_tokens=mask.sum(), max_new_tokens=T)
    parts = [loss_of(logp[s], old[s], old[s], adv[s], mask[s], loss_type, **kw) for s in (slice(0, 2), slice(2, 6))]
    total = sum(p[0] for p in parts)
    g_parts, = torch.autograd.grad(total, logp)
    close(total.item(), full.item())
    close(g_parts, g_full)
    merged = combine_metrics([p[1] for p in parts])
    _, whole = loss_of(logp, old, old, adv, mask, loss_type, max_new_tokens=T)
    assert merged["tokens"] == whole["tokens"]
    assert math.isclose(merged["ratio/mean"], whole["ratio/mean"], rel_tol=1e-6)
    assert merged["ratio/max"] == whole["ratio/max"]


def test_unknown_loss_type_is_named(capsys):
    with pytest.raises(SystemExit):
        parse_config(LossConfig, argv=["--loss_type", "ppo"])
    assert "invalid choice: 'ppo'" in capsys.readouterr().err


def health_of(log_v: list[float]) -> dict:
    """grpo_loss's metrics, as floats, for sampled tokens with these log(pi_theta / mu)."""
    logp = torch.tensor([log_v]) - 1.0
    m = loss_of(logp, None, logp - torch.tensor([log_v]), torch.zeros(1), torch.ones(1, len(log_v)))[1]
    return {k: v.item() for k, v in m.items()}


def test_health_of_equal_weights_is_perfect():
    m = combine_metrics([health_of([0.0] * 5)])
    close([m["health/ess_frac"], m["health/mismatch_kl"], m["health/far_frac"]], [1.0, 0.0, 0.0])


def test_mismatch_kl_is_never_negative_where_float32_rounds_v_to_1():
    # log v about 6e-8 after health_of's float32 round trip (a vLLM log-prob a rounding away from the trainer's): exp
    # rounds v to exactly 1, so (v - 1) - log v, unclamped, is -6e-8 a token; a KL is >= 0, and a test failed on -4e-10
    assert health_of([3e-8] * 4)["health/mismatch_kl"] == 0.0
    assert health_of([1e-6] * 4)["health/mismatch_kl"] > 0  # above the rounding it still counts


def test_health_of_a_known_mismatch_combines_across_micro_batches():
    # log v = ln 3 on one token, 0 on the other: v = (3, 1), ESS/N = 4^2 / (2 * 10) = 0.8,
    # k3 = ((3 - 1 - ln 3) + 0) / 2 = 0.45069, and one token of two is more than 2x off
    m = combine_metrics([health_of([math.log(3)]), health_of([0.0])])
    close([m["health/ess_frac"], m["health/mismatch_kl"], m["health/far_frac"]], [0.8, (2 - math.log(3)) / 2, 0.5])
    assert "health/v_sq_mean" not in m
