"""Parallel transformer block (PTB, MegaScale §3.2) vs serial block: formulas and TP communication.

Formulas are recomputed from each block's own weights with a hand-written attention (explicit
causal / sliding-window mask, rotary on (x[:d/2], x[d/2:]) pairs, softmax) and tanh-GeLU MLP;
fp32, tolerance 1e-5 absolute. The communication test counts the collectives one block issues
under TP=2 (with and without sequence parallelism) and checks its output against one device.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from megascale.config import ModelConfig
from megascale.launch import run_ranks
from megascale.model.gpt import GPT, ParallelBlock, SerialBlock
from megascale.parallel.parallelize import apply_tp
from megascale.parallel.topology import Layout

ATOL = 1e-5
BATCH, SEQ = 2, 8


def _cfg(block: str = "serial", window=None) -> ModelConfig:
    return ModelConfig(layers=1, hidden=32, heads=4, ffn=64, vocab=16, seq=SEQ, block=block, window=window)


def _randomise_norms(block: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in block.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=gen))
                m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=gen))


def _rotary(x: torch.Tensor, base: float) -> torch.Tensor:
    d = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(x.shape[-2], dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().float(), angles.sin().float()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def reference_attention(attn: torch.nn.Module, h: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    b, s, hidden = h.shape
    d = hidden // cfg.heads
    q, k, v = (h @ attn.qkv.weight.T).split(hidden, dim=-1)
    q, k, v = (t.view(b, s, cfg.heads, d).transpose(1, 2) for t in (q, k, v))
    q, k = _rotary(q, cfg.rotary_base), _rotary(k, cfg.rotary_base)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (j <= i) & ((i - j < cfg.window) if cfg.window else True)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~allowed, float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, hidden)
    return y @ attn.proj.weight.T


def reference_mlp(mlp: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    a = h @ mlp.fc.weight.T
    gelu = 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))
    return gelu @ mlp.proj.weight.T


@pytest.mark.parametrize("window", [None, 3])
def test_parallel_block_is_x_plus_attn_of_ln_plus_mlp_of_same_ln(window):
    cfg = _cfg("parallel", window)
    torch.manual_seed(0)
    block = ParallelBlock(cfg)
    _randomise_norms(block)
    x = torch.randn(BATCH, SEQ, cfg.hidden)
    h = torch.nn.functional.layer_norm(x, (cfg.hidden,), block.ln.weight, block.ln.bias, block.ln.eps)
    expected = x + reference_attention(block.attn, h, cfg) + reference_mlp(block.mlp, h)
    torch.testing.assert_close(block(x), expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("window", [None, 3])
def test_serial_block_is_attn_residual_then_mlp_residual(window):
    cfg = _cfg("serial", window)
    torch.manual_seed(0)
    block = SerialBlock(cfg)
    _randomise_norms(block)
    x = torch.randn(BATCH, SEQ, cfg.hidden)
    ln = torch.nn.functional.layer_norm
    x1 = x + reference_attention(block.attn, ln(x, (cfg.hidden,), block.ln_1.weight, block.ln_1.bias), cfg)
    expected = x1 + reference_mlp(block.mlp, ln(x1, (cfg.hidden,), block.ln_2.weight, block.ln_2.bias))
    torch.testing.assert_close(block(x), expected, rtol=0, atol=ATOL)


COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single")


def _count_block_collectives(ctx) -> dict:
    counts = {name: 0 for name in COLLECTIVES}
    for name in COLLECTIVES:  # this forked rank's own torch.distributed
        original = getattr(dist, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)
        setattr(dist, name, counted)

    out = {}
    for block in ("serial", "parallel"):
        for sp in (False, True):
            cfg = _cfg(block)
            torch.manual_seed(0)
            model = GPT(cfg)
            reference = model.blocks["0"]
            x = torch.randn(BATCH, SEQ, cfg.hidden)
            grad = torch.randn(BATCH, SEQ, cfg.hidden)
            expected = reference(x).detach()
            apply_tp(model, dataclasses.replace(ctx, sequence_parallel=sp), {})
            sharded = model.blocks["0"]  # same object, its linears swapped for TP ones
            if sp:
                x, grad, expected = (t.chunk(ctx.tp.size, dim=1)[ctx.tp.rank] for t in (x, grad, expected))
            x = x.clone().requires_grad_()
            for name in counts:
                counts[name] = 0
            y = sharded(x)
            forward = dict(counts)
            y.backward(grad)
            backward = {k: counts[k] - forward[k] for k in counts}
            out[(block, sp)] = {"forward": forward, "backward": backward, "y": (y.detach(), expected)}
    return out


@pytest.fixture(scope="module")
def tp_runs():
    return run_ranks(_count_block_collectives, Layout(tp=2))


def test_tp_block_outputs_match_single_device(tp_runs):
    for rank, runs in enumerate(tp_runs):
        for key, run in runs.items():
            torch.testing.assert_close(*run["y"], rtol=0, atol=ATOL, msg=f"rank {rank} {key}")


def test_ptb_under_tp_all_reduces_once_per_block_where_serial_block_all_reduces_twice(tp_runs):
    for runs in tp_runs:
        assert runs[("serial", False)]["forward"] == {"all_reduce": 2, "all_gather_single": 0,
                                                      "reduce_scatter_single": 0}
        assert runs[("parallel", False)]["forward"] == {"all_reduce": 1, "all_gather_single": 0,
                                                        "reduce_scatter_single": 0}
        # Backward mirrors it: one all-reduce per TP entry (copy_to_tp).
        assert runs[("serial", False)]["backward"]["all_reduce"] == 2
        assert runs[("parallel", False)]["backward"]["all_reduce"] == 1


def test_ptb_under_sequence_parallel_gathers_and_reduce_scatters_once_per_block(tp_runs):
    for runs in tp_runs:
        for phase in ("forward", "backward"):
            assert runs[("serial", True)][phase] == {"all_reduce": 0, "all_gather_single": 2,
                                                     "reduce_scatter_single": 2}
            assert runs[("parallel", True)][phase] == {"all_reduce": 0, "all_gather_single": 1,
                                                       "reduce_scatter_single": 1}
