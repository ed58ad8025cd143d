"""LAMB and AdamW updates on a flat shard of many parameters.

ZeRO-2 hands each rank a contiguous slice of a flat buffer, so one shard holds
pieces of several parameters and one parameter may span several ranks. LAMB's
trust ratio needs per-*parameter* norms: each rank sums squares per parameter
segment (`Segments`), and `reduce_norms` adds the partial sums of the other
shard holders (DP ranks, and TP ranks for TP-sharded parameters).

LAMB follows apex FusedLAMB (adam_w_mode, bias correction, use_nvlamb=False):
  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
  u = m_hat / (sqrt(v_hat) + eps) + wd * w
  w -= lr * (||w|| / ||u||) * u   where wd != 0 and both norms are non-zero, else w -= lr * u
"""
from __future__ import annotations

import math
from typing import Callable

import torch

NormReducer = Callable[[torch.Tensor], torch.Tensor]


class Segments:
    """Which parameter each element of a flat shard belongs to, as runs of consecutive elements.

    A shard is a few long runs (one per parameter piece, then padding with id `count`), so
    per-parameter sums are one vectorised norm per run and per-parameter factors are expanded by
    run length, never gathered element by element.
    """

    def __init__(self, segment_ids: torch.Tensor, count: int):
        ids, lengths = torch.unique_consecutive(segment_ids, return_counts=True)
        self.ids, self.count, self.numel = ids, count, segment_ids.numel()
        self.lengths, self.length_list = lengths, lengths.tolist()

    def sum_of_squares(self, x: torch.Tensor) -> torch.Tensor:
        """Per-parameter sums of x^2 (fp32), padding dropped."""
        norms = torch.stack(torch._foreach_norm(list(x.float().split(self.length_list))))
        out = torch.zeros(self.count + 1, dtype=torch.float32, device=x.device)
        return out.index_add_(0, self.ids, norms.square())[:self.count]

    def expand(self, per_segment: torch.Tensor, padding: float = 1.0) -> torch.Tensor:
        """A per-parameter value for every element of the shard."""
        padded = torch.cat([per_segment, per_segment.new_full((1,), padding)])
        return padded[self.ids].repeat_interleave(self.lengths, output_size=self.numel)


def adam_direction(grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
                   betas: tuple[float, float], eps: float) -> torch.Tensor:
    """Updates the moments in place; returns the bias-corrected Adam direction (a new tensor)."""
    beta1, beta2 = betas
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denominator = exp_avg_sq.div(1 - beta2**step).sqrt_().add_(eps)
    return exp_avg.div(1 - beta1**step).div_(denominator)


def lamb_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
              step: int, lr: float, betas: tuple[float, float], eps: float, decay: torch.Tensor,
              segments: Segments, segment_decayed: torch.Tensor, reduce_norms: NormReducer) -> None:
    """One LAMB step on a flat fp32 shard.

    `decay` is the per-element weight decay; `segment_decayed[i]` says whether parameter i
    has weight decay (only those get a trust ratio, as in apex).
    """
    update = adam_direction(grad, exp_avg, exp_avg_sq, step, betas, eps).addcmul_(decay, param)
    sums = torch.stack([segments.sum_of_squares(param), segments.sum_of_squares(update)])
    param_norm, update_norm = reduce_norms(sums).sqrt()
    use_trust = segment_decayed & (param_norm > 0) & (update_norm > 0)
    trust = torch.where(use_trust, param_norm / update_norm.clamp(min=1e-30), torch.ones_like(param_norm))
    param.sub_(update.mul_(segments.expand(trust)), alpha=lr)


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, betas: tuple[float, float], eps: float, decay: torch.Tensor, **_) -> None:
    """One AdamW step (decoupled weight decay), in torch.optim.AdamW's order of operations: one pass over
    the shard per line and a single temporary, where the Adam direction of LAMB takes three."""
    beta1, beta2 = betas
    param.addcmul_(param, decay, value=-lr)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denominator = exp_avg_sq.sqrt().div_(math.sqrt(1 - beta2**step)).add_(eps)
    param.addcdiv_(exp_avg, denominator, value=-lr / (1 - beta1**step))
