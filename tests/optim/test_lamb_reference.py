"""`lamb_step` / `adamw_step` on one flat shard against per-tensor references.

LAMB reference (You et al. 2019, apex FusedLAMB semantics: adam_w_mode, bias correction,
grad averaging, no grad clipping inside the step, use_nvlamb=False), per parameter w:
  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
  u = (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + wd w
  r = ||w|| / ||u||  if wd != 0 and ||w|| > 0 and ||u|| > 0, else 1
  w = w - lr r u
All in fp32 for 3 steps; tolerance 1e-6 absolute (values are O(1)).
"""
from __future__ import annotations

import threading
from itertools import pairwise

import torch

from megascale.optim.update import Segments, adamw_step, lamb_step

LR, BETAS, EPS, STEPS = 0.05, (0.9, 0.999), 1e-6, 3
ATOL = 1e-6
# (shape, weight decay): a matrix, a vector without decay (ratio 1), a 3-d tensor, an all-zero
# decayed vector (||w|| = 0 at step 1: ratio 1), a decayed tensor with zero grads (u = wd w).
PARAMS = [((3, 4), 0.01), ((5,), 0.0), ((2, 3, 2), 0.1), ((4,), 0.01), ((2, 2), 0.01)]
PADDING = 3


def _tensors(seed: int = 0) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(shape, generator=gen) for shape, _ in PARAMS]
    weights[0].mul_(0.1)  # ||w|| / ||u|| ~ 0.1: far from the ratio-1 branch
    weights[3].zero_()
    grads = [[torch.randn(shape, generator=gen) for shape, _ in PARAMS] for _ in range(STEPS)]
    for g in grads:
        g[4].zero_()
    return weights, grads


def reference_lamb(weights: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    weights = [w.clone() for w in weights]
    m = [torch.zeros_like(w) for w in weights]
    v = [torch.zeros_like(w) for w in weights]
    b1, b2 = BETAS
    for t, step_grads in enumerate(grads, start=1):
        for i, ((_, wd), g) in enumerate(zip(PARAMS, step_grads)):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            u = (m[i] / (1 - b1**t)) / ((v[i] / (1 - b2**t)).sqrt() + EPS) + wd * weights[i]
            w_norm, u_norm = weights[i].norm(), u.norm()
            ratio = w_norm / u_norm if wd != 0 and w_norm > 0 and u_norm > 0 else 1.0
            weights[i] = weights[i] - LR * ratio * u
    return weights


def _flat(tensors: list[torch.Tensor], pad_value: float) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors] + [torch.full((PADDING,), pad_value)])


def _layout() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """segment_ids (padding gets id == num_segments), per-element decay, per-segment decayed flag."""
    sizes = [torch.Size(shape).numel() for shape, _ in PARAMS]
    segment_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)] + [torch.full((PADDING,), len(PARAMS))])
    decay = torch.cat([torch.full((n,), wd) for n, (_, wd) in zip(sizes, PARAMS)] + [torch.zeros(PADDING)])
    decayed = torch.tensor([wd != 0 for _, wd in PARAMS])
    return segment_ids, decay, decayed


def _unflatten(flat: torch.Tensor) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape, _ in PARAMS:
        n = torch.Size(shape).numel()
        out.append(flat[offset:offset + n].view(shape))
        offset += n
    return out


def _run_lamb_pieces(weights, grads, cuts: list[int]) -> torch.Tensor:
    """LAMB on the flat shard cut at `cuts` into pieces, one thread each; `reduce_norms` sums the
    pieces' partial per-segment sums (an all-reduce over simulated ZeRO ranks)."""
    segment_ids, decay, decayed = _layout()
    # Padding holds large values and gradients: it must not leak into any parameter's norms.
    param = _flat(weights, 100.0)
    bounds = [0, *cuts, param.numel()]
    pieces = [slice(a, b) for a, b in pairwise(bounds)]
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    barrier = threading.Barrier(len(pieces))
    partial: list = [None] * len(pieces)

    def reducer(index: int):
        def reduce_norms(sums: torch.Tensor) -> torch.Tensor:
            partial[index] = sums.clone()
            barrier.wait()
            total = sum(partial)
            barrier.wait()  # everyone has read before the next step overwrites
            return total
        return reduce_norms

    for step, step_grads in enumerate(grads, start=1):
        grad = _flat(step_grads, 50.0)

        def run(index: int, piece: slice, step: int = step, grad: torch.Tensor = grad) -> None:
            lamb_step(param[piece], grad[piece], exp_avg[piece], exp_avg_sq[piece], step=step, lr=LR, betas=BETAS,
                      eps=EPS, decay=decay[piece], segments=Segments(segment_ids[piece], len(PARAMS)),
                      segment_decayed=decayed, reduce_norms=reducer(index))

        threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(pieces)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in threads)
    return param


def test_lamb_step_on_flat_shard_matches_per_tensor_reference_over_three_steps():
    weights, grads = _tensors()
    got = _run_lamb_pieces(weights, grads, cuts=[])
    for i, (ours, expected) in enumerate(zip(_unflatten(got), reference_lamb(weights, grads))):
        torch.testing.assert_close(ours, expected, rtol=0, atol=ATOL, msg=f"parameter {i} {PARAMS[i]}")
    # The reference's branches were all exercised: trust ratio != 1 on a decayed tensor, and
    # the updates moved every parameter.
    assert all(not torch.equal(a, b) for a, b in zip(_unflatten(got), weights))


def test_lamb_trust_ratio_branches_match_apex():
    """Decayed params get ||w||/||u||; no decay, or a zero-norm weight, get ratio 1 (plain Adam-W step)."""
    weights, grads = _tensors()
    one_step = reference_lamb(weights, grads[:1])
    got = _unflatten(_run_lamb_pieces(weights, grads[:1], cuts=[]))
    # Step 1 of Adam moves each element by ~lr (|m_hat / sqrt(v_hat)| = 1 up to eps): ratio 1 <=> |dw| ~= lr
    # (1e-3 absolute covers eps and the 0.01 * w decay term; ratios here are ~0.1).
    no_decay, zero_weight, decayed = 1, 3, 0
    for i in (no_decay, zero_weight):
        torch.testing.assert_close((got[i] - weights[i]).abs(), torch.full(PARAMS[i][0], LR), rtol=0, atol=1e-3)
        torch.testing.assert_close(got[i], one_step[i], rtol=0, atol=ATOL)
    step = (got[decayed] - weights[decayed]).abs()
    assert (step < LR / 2).all()
    torch.testing.assert_close(got[decayed], one_step[decayed], rtol=0, atol=ATOL)


def test_lamb_split_across_two_shards_with_summed_norms_equals_one_shard():
    """Simulated ZeRO: cut inside parameter 0 and inside parameter 2, so both pieces hold part of them."""
    weights, grads = _tensors()
    whole = _run_lamb_pieces(weights, grads, cuts=[])
    torch.testing.assert_close(_run_lamb_pieces(weights, grads, cuts=[7]), whole, rtol=0, atol=ATOL)
    torch.testing.assert_close(_run_lamb_pieces(weights, grads, cuts=[5, 20]), whole, rtol=0, atol=ATOL)


def test_adamw_step_matches_torch_optim_adamw_over_three_steps():
    weights, grads = _tensors()
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    groups = [{"params": [p], "weight_decay": wd} for p, (_, wd) in zip(params, PARAMS)]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)

    _, decay, _ = _layout()
    flat = _flat(weights, 0.0)
    exp_avg, exp_avg_sq = torch.zeros_like(flat), torch.zeros_like(flat)
    for step, step_grads in enumerate(grads, start=1):
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()
        adamw_step(flat, _flat(step_grads, 0.0), exp_avg, exp_avg_sq, step=step, lr=LR, betas=BETAS, eps=EPS,
                   decay=decay)
    for i, (ours, p) in enumerate(zip(_unflatten(flat), params)):
        torch.testing.assert_close(ours, p.detach(), rtol=0, atol=ATOL, msg=f"parameter {i} {PARAMS[i]}")
