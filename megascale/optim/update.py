"""LAMB and AdamW updates on a flat shard of many parameters.

ZeRO-2 hands each rank a contiguous slice of a flat buffer, so one shard holds
pieces of several parameters and one parameter may span several ranks. LAMB's
trust ratio needs per-*parameter* norms: each rank sums squares per parameter
segment (`segment_ids`), and `reduce_norms` adds the partial sums of the other
shard holders (DP ranks, and TP ranks for TP-sharded parameters).

LAMB follows apex FusedLAMB (adam_w_mode, bias correction, use_nvlamb=False):
  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
  u = m_hat / (sqrt(v_hat) + eps) + wd * w
  w -= lr * (||w|| / ||u||) * u   where wd != 0 and both norms are non-zero, else w -= lr * u
"""
from __future__ import annotations

from typing import Callable

import torch

NormReducer = Callable[[torch.Tensor], torch.Tensor]


def segment_sum_of_squares(x: torch.Tensor, segment_ids: torch.Tensor, num_segments: int) -> torch.Tensor:
    # One extra segment collects padding, then is dropped.
    out = torch.zeros(num_segments + 1, dtype=torch.float32, device=x.device)
    out.index_add_(0, segment_ids, x.float().square())
    return out[:num_segments]


def adam_direction(grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
                   betas: tuple[float, float], eps: float) -> torch.Tensor:
    """Updates the moments in place; returns the bias-corrected Adam direction."""
    beta1, beta2 = betas
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    m_hat = exp_avg / (1 - beta1**step)
    v_hat = exp_avg_sq / (1 - beta2**step)
    return m_hat / (v_hat.sqrt() + eps)


def lamb_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
              step: int, lr: float, betas: tuple[float, float], eps: float, decay: torch.Tensor,
              segment_ids: torch.Tensor, segment_decayed: torch.Tensor, reduce_norms: NormReducer) -> None:
    """One LAMB step on a flat fp32 shard.

    `decay` is the per-element weight decay; `segment_decayed[i]` says whether parameter i
    has weight decay (only those get a trust ratio, as in apex).
    """
    num_segments = segment_decayed.numel()
    update = adam_direction(grad, exp_avg, exp_avg_sq, step, betas, eps) + decay * param
    sums = torch.stack([
        segment_sum_of_squares(param, segment_ids, num_segments),
        segment_sum_of_squares(update, segment_ids, num_segments),
    ])
    param_norm, update_norm = reduce_norms(sums).sqrt()
    use_trust = segment_decayed & (param_norm > 0) & (update_norm > 0)
    trust = torch.where(use_trust, param_norm / update_norm.clamp(min=1e-30), torch.ones_like(param_norm))
    trust = torch.cat([trust, trust.new_ones(1)])  # the padding segment
    param.sub_(lr * trust[segment_ids] * update)


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, betas: tuple[float, float], eps: float, decay: torch.Tensor, **_) -> None:
    """One AdamW step (decoupled weight decay, as torch.optim.AdamW)."""
    param.mul_(1 - lr * decay)
    param.sub_(lr * adam_direction(grad, exp_avg, exp_avg_sq, step, betas, eps))
