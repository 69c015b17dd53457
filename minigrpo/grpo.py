"""The GRPO family of losses as pure functions of tensors.

    A_i    = (r_i - mean_g r) / (std_g r + eps)          group-normalised advantage (unbiased std; 0 if std = 0)
    ratio  = pi_theta / pi_old                          policy ratio, per token
    w      = min(pi_old / mu, tis_cap)                  truncated importance weight (1 when pi_old is mu)
    l_t    = -w * min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A)

and the per-token losses l are summed over valid tokens and divided by a normaliser that depends on loss_type:
    grpo     1/B sum_i (sum_t l_it / |o_i|)      sequence mean of token means          (DeepSeekMath)
    dapo     sum_it l_it / sum_i |o_i|           token mean over the whole batch        (DAPO)
    dr_grpo  sum_it l_it / (B * max_new_tokens)  a constant, so no length bias          (Dr. GRPO)
B and sum_i |o_i| are those of the whole optimizer batch, given as Batch.num_seqs / num_tokens when micro-batching.

Off-policy health over the sampled tokens, v = pi_theta / mu (mu: the sampler; slime and prime-rl report the same):
    health/ess_frac         (sum v)^2 / (N sum v^2)   effective sample size over the N tokens: 1 when v is constant
    health/mismatch_kl      mean((v - 1) - log v)     k3 estimate of KL(mu || pi_theta), each term clamped at 0
    health/far_frac         share of |log v| > ln 2   tokens whose probability differs by more than 2x"""
import math
from dataclasses import dataclass

import torch

from minigrpo.run import LossConfig


def advantages(rewards: torch.Tensor, G: int, scale_rewards: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards (N*G,) in group order -> advantages (N*G,). Zero-std groups get exactly 0, never NaN."""
    if G < 2:
        raise ValueError(f"GRPO needs at least 2 completions per group, got G={G}")
    r = rewards.double().view(-1, G)  # (N, G), float64: a huge finite reward cannot overflow the mean or std
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps if scale_rewards else 1)  # ddof=1, the majority convention
    return torch.where(zero_std_groups(r, G)[:, None], 0.0, adv).view(-1).float()


def zero_std_groups(rewards: torch.Tensor, G: int) -> torch.Tensor:
    """(N,) bool: which groups have all-equal rewards (no learning signal; DAPO drops them)."""
    return (rewards.view(-1, G) == rewards.view(-1, G)[:, :1]).all(1)


@dataclass
class Batch:
    behav: torch.Tensor  # (B, T) mu: the sampler's log-probs of the sampled tokens
    adv: torch.Tensor  # (B,) advantages
    mask: torch.Tensor  # (B, T) 1 on completion tokens, 0 on the prompt and past the end
    old: torch.Tensor | None = None  # (B, T) pi_old; None: mu itself (the behaviour policy)
    num_seqs: int | None = None  # the whole optimizer batch's normalisers (None: this batch's own)
    num_tokens: int | None = None


def grpo_loss(logp: torch.Tensor, batch: Batch, cfg: LossConfig, max_new_tokens: int | None = None):
    """logp (B, T): the trainer's log-probs, the only input with a gradient. Returns (loss, metrics)."""
    mask, A = batch.mask.to(logp.dtype), batch.adv.detach()[:, None].to(logp.dtype)  # (B, T), (B, 1)
    behav_logp, old_logp = batch.behav.detach(), (batch.behav if batch.old is None else batch.old).detach()  # mu, pi_old
    ratio = torch.exp((logp - old_logp) * mask)  # (B, T); its log is 0 on padding, so it stays finite
    per_token = -torch.min(ratio * A, ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * A)  # (B, T) l_t with w = 1
    if cfg.tis_cap is not None:  # truncated importance sampling, per token, without gradient: l_t = -w * min(...)
        per_token = (is_ratio := torch.exp((old_logp - behav_logp) * mask)).clamp(max=cfg.tis_cap) * per_token  # pi_old / mu

    B, masked = batch.num_seqs or logp.shape[0], per_token * mask  # masked (B, T): l_it on the valid tokens, 0 elsewhere
    if cfg.loss_type == "grpo":
        loss = (masked.sum(1) / mask.sum(1).clamp(min=1)).sum() / B
    else:  # dapo's normaliser counts the batch's tokens, dr_grpo's is a constant
        loss = masked.sum() / (batch.num_tokens or mask.sum().clamp(min=1) if cfg.loss_type == "dapo" else B * max_new_tokens)

    with torch.no_grad():  # 0-d tensors, as masked sums: no host sync (train_step reads them all once a step)
        valid, n, log_v = mask.bool(), mask.sum(), logp - behav_logp  # v = pi_theta / mu: the health signals above
        v, mean = torch.exp(log_v.clamp(-40, 40)), lambda x: torch.where(valid, x, 0).float().sum() / n.clamp(min=1)  # noqa: E731
        metrics = {"tokens": n, "ratio/mean": mean(ratio), "health/v_mean": mean(v), "health/v_sq_mean": mean(v * v),
                   "ratio/min": ratio.masked_fill(~valid, math.inf).min(), "ratio/max": ratio.masked_fill(~valid, -math.inf).max(),
                   "clip_ratio/low": mean((ratio < 1 - cfg.eps_low) & (A < 0)),
                   "clip_ratio/high": mean((ratio > 1 + cfg.eps_high) & (A > 0)),
                   "health/mismatch_kl": mean((v - 1 - log_v).clamp(min=0)),  # each term >= 0; float32 dips below near v = 1
                   "health/far_frac": mean(log_v.abs() > math.log(2))}  # combine_metrics adds health/ess_frac
        if cfg.tis_cap is not None:
            metrics |= {"is/mean": mean(is_ratio), "is/frac_capped": mean(is_ratio > cfg.tis_cap)}
    return loss, metrics


def combine_metrics(parts: list[dict]) -> dict:
    n = sum(p["tokens"] for p in parts)  # the rest: token-weighted means, or the min / max over the parts
    out = {"tokens": n} | {k: (min if k.endswith("/min") else max)(p[k] for p in parts) if k.endswith(("/min", "/max"))
                           else sum(p[k] * p["tokens"] for p in parts) / max(n, 1) for k in parts[0] if k != "tokens"}
    out["health/ess_frac"] = out["health/v_mean"] ** 2 / max(out.pop("health/v_sq_mean"), 1e-30)  # ESS / N, all parts
    return out
