"""Causal self-attention that picks the fastest kernel available for each call.

flash-attn 2 for fp16/bf16 on CUDA; FlexAttention for sliding windows on CUDA
otherwise; PyTorch SDPA for everything else (CPU, and full causal on CUDA, where
SDPA already dispatches to its own flash / memory-efficient kernels).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

try:  # optional GPU-only wheel; absent on CPU machines and in CI
    from flash_attn import flash_attn_func as _flash_attn_func
except Exception:  # noqa: BLE001 -- ImportError, or an ABI mismatch with the installed torch
    _flash_attn_func = None

_HALF = (torch.float16, torch.bfloat16)


def select_backend(
    device_type: str, dtype: torch.dtype, window: int | None, flash_available: bool
) -> str:
    """Pure decision function, separate from tensors so it can be tested without a GPU."""
    if device_type == "cuda" and dtype in _HALF and flash_available:
        return "flash_attn"
    if device_type == "cuda" and window is not None:
        return "flex"
    return "sdpa"


def _effective_window(seq: int, window: int | None) -> int | None:
    if window is None:
        return None
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    # A window covering the whole sequence is plain causal, which has faster kernels.
    return None if window >= seq else window


def attention_backend(q: torch.Tensor, window: int | None = None) -> str:
    """Which kernel `attention(q, k, v, window)` will use: "flash_attn", "flex" or "sdpa"."""
    window = _effective_window(q.shape[-2], window)
    return select_backend(q.device.type, q.dtype, window, _flash_attn_func is not None)


# Masks are cached per (seq, window, device). They are built outside inference
# mode so a mask first made during eval can still be saved for backward later.
@functools.lru_cache(maxsize=32)
def _sliding_window_mask(seq: int, window: int, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):
        i = torch.arange(seq, device=device)
        dist = i[:, None] - i[None, :]  # query index minus key index
        return (dist >= 0) & (dist < window)  # True = attend


@functools.lru_cache(maxsize=32)
def _sliding_window_block_mask(seq: int, window: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    with torch.inference_mode(False):
        return create_block_mask(
            mask_mod, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device=device
        )


@functools.cache
def _flex_fn(compile: bool):
    from torch.nn.attention.flex_attention import flex_attention

    # Eager flex_attention materialises the full score matrix; only the compiled
    # version is the fused, block-sparse kernel.
    return torch.compile(flex_attention, dynamic=False) if compile else flex_attention


def _flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int
) -> torch.Tensor:
    block_mask = _sliding_window_block_mask(q.shape[-2], window, q.device)
    return _flex_fn(q.device.type == "cuda")(q, k, v, block_mask=block_mask)


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    # flash-attn wants [b, s, h, d]; window_size counts keys to the left, excluding the query.
    window_size = (-1, -1) if window is None else (window - 1, 0)
    out = _flash_attn_func(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        causal=True,
        window_size=window_size,
    )
    return out.transpose(1, 2)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    if window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = _sliding_window_mask(q.shape[-2], window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """Causal self-attention on [batch, heads, seq, head_dim] tensors, scaled by 1/sqrt(head_dim).

    window=None is full causal; window=w lets query i see keys j with i - w < j <= i.
    """
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"q, k, v must share a shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    window = _effective_window(q.shape[-2], window)
    backend = select_backend(
        q.device.type, q.dtype, window, _flash_attn_func is not None
    )
    if backend == "flash_attn":
        return _flash(q, k, v, window)
    if backend == "flex":
        return _flex(q, k, v, window)
    return _sdpa(q, k, v, window)
