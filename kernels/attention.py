"""Causal self-attention that picks the fastest kernel available for each call.

flash-attn 2 for fp16/bf16 on CUDA; FlexAttention for sliding windows or document masks on
CUDA otherwise; PyTorch SDPA for everything else (CPU, and full causal on CUDA, where
SDPA already dispatches to its own flash / memory-efficient kernels).

A `DocumentMask` (packed sequences, `data.document_mask`) keeps each query inside its own
document: flash-attn runs each document as its own sequence (varlen), FlexAttention skips the
blocks the mask empties, and SDPA takes a dense boolean mask.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

try:  # optional GPU-only wheel; absent on CPU machines and in CI
    from flash_attn import flash_attn_func as _flash_attn_func
    from flash_attn import flash_attn_varlen_func as _flash_attn_varlen_func
except Exception:  # noqa: BLE001 -- ImportError, or an ABI mismatch with the installed torch
    _flash_attn_func = _flash_attn_varlen_func = None

_HALF = (torch.float16, torch.bfloat16)


def select_backend(
    device_type: str, dtype: torch.dtype, window: int | None, flash_available: bool, documents: bool = False
) -> str:
    """Pure decision function, separate from tensors so it can be tested without a GPU."""
    if device_type == "cuda" and dtype in _HALF and flash_available:
        return "flash_attn"
    if device_type == "cuda" and (window is not None or documents):
        return "flex"
    return "sdpa"


def _effective_window(seq: int, window: int | None) -> int | None:
    if window is None:
        return None
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    # A window covering the whole sequence is plain causal, which has faster kernels.
    return None if window >= seq else window


def attention_backend(q: torch.Tensor, window: int | None = None, documents: DocumentMask | None = None) -> str:
    """Which kernel `attention(q, k, v, window, documents)` will use: "flash_attn", "flex" or "sdpa"."""
    window = _effective_window(q.shape[-2], window)
    return select_backend(q.device.type, q.dtype, window, _flash_attn_func is not None, documents is not None)


# Masks are cached per (seq, window, device). They are built outside inference
# mode so a mask first made during eval can still be saved for backward later.
@functools.lru_cache(maxsize=32)
def _causal_mask(seq: int, window: int | None, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):
        i = torch.arange(seq, device=device)
        dist = i[:, None] - i[None, :]  # query index minus key index
        allowed = dist >= 0  # True = attend
        return allowed if window is None else allowed & (dist < window)


def _mask_mod(window: int | None, document_ids: torch.Tensor | None = None):
    """FlexAttention's form of the mask: causal, within `window`, within one document."""

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx <= q_idx
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        if document_ids is not None:
            keep = keep & (document_ids[b, q_idx] == document_ids[b, kv_idx])
        return keep

    return mask_mod


@functools.lru_cache(maxsize=32)
def _sliding_window_block_mask(seq: int, window: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    with torch.inference_mode(False):
        return create_block_mask(
            _mask_mod(window), B=None, H=None, Q_LEN=seq, KV_LEN=seq, device=device
        )


class DocumentMask:
    """Keeps attention inside the documents packed into each row: query i sees key j only when
    `document_ids[b, i] == document_ids[b, j]` (a document is a contiguous run of its row).

    Made once per forward pass from `document_ids` [batch, seq] and handed to every layer: the
    form a kernel needs is built on its first use and reused by the layers after it.
    """

    def __init__(self, document_ids: torch.Tensor):
        if document_ids.dim() != 2:
            raise ValueError(f"document_ids must be [batch, seq], got {tuple(document_ids.shape)}")
        self.document_ids = document_ids
        self._forms: dict[tuple, object] = {}

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.document_ids.shape)

    def _form(self, key: tuple, build):
        if key not in self._forms:
            self._forms[key] = build()
        return self._forms[key]

    def dense(self, window: int | None, device: torch.device) -> torch.Tensor:
        """SDPA's form: bool [batch, 1, seq, seq], True = attend."""

        def build():
            ids = self.document_ids.to(device)
            same = ids[:, :, None] == ids[:, None, :]
            return (same & _causal_mask(ids.shape[1], window, device)).unsqueeze(1)

        return self._form(("dense", window, device), build)

    def block_mask(self, window: int | None, device: torch.device):
        """FlexAttention's form: a BlockMask whose empty blocks the kernel skips."""
        from torch.nn.attention.flex_attention import create_block_mask

        def build():
            ids = self.document_ids.to(device)
            batch, seq = ids.shape
            return create_block_mask(_mask_mod(window, ids), B=batch, H=None, Q_LEN=seq, KV_LEN=seq, device=device)

        return self._form(("block", window, device), build)

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        """flash-attn varlen's form: int32 offsets of every document piece in the flattened batch
        (a row boundary also ends a piece, so a document split over two rows is two sequences)."""

        def build():
            ids = self.document_ids.to(device)
            starts = torch.ones_like(ids, dtype=torch.bool)
            starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
            offsets = starts.flatten().nonzero().flatten()
            return torch.cat([offsets, offsets.new_tensor([ids.numel()])]).to(torch.int32)

        return self._form(("varlen", device), build)


@functools.cache
def _flex_fn(compile: bool):
    from torch.nn.attention.flex_attention import flex_attention

    # Eager flex_attention materialises the full score matrix; only the compiled
    # version is the fused, block-sparse kernel.
    return torch.compile(flex_attention, dynamic=False) if compile else flex_attention


def _flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, documents: DocumentMask | None = None
) -> torch.Tensor:
    if documents is None:
        block_mask = _sliding_window_block_mask(q.shape[-2], window, q.device)
    else:
        block_mask = documents.block_mask(window, q.device)
    return _flex_fn(q.device.type == "cuda")(
        q, k, v, block_mask=block_mask, enable_gqa=_grouped(q, k)
    )


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, documents: DocumentMask | None = None
) -> torch.Tensor:
    # flash-attn wants [b, s, h, d] (fewer k/v heads = GQA); window_size counts keys to the
    # left, excluding the query.
    window_size = (-1, -1) if window is None else (window - 1, 0)
    if documents is not None:
        return _flash_varlen(q, k, v, window_size, documents)
    out = _flash_attn_func(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        causal=True,
        window_size=window_size,
    )
    return out.transpose(1, 2)


def _flash_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_size: tuple[int, int], documents: DocumentMask
) -> torch.Tensor:
    # Every document piece is its own causal sequence of the flattened [batch * seq] tokens.
    # max_seqlen is an upper bound (the row length): the exact one would cost a device sync.
    batch, heads, seq, dim = q.shape
    cu_seqlens = documents.cu_seqlens(q.device)

    def tokens(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(batch * seq, t.shape[1], dim)

    out = _flash_attn_varlen_func(
        tokens(q), tokens(k), tokens(v), cu_seqlens, cu_seqlens, seq, seq,
        causal=True, window_size=window_size,
    )
    return out.view(batch, seq, heads, dim).transpose(1, 2)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, documents: DocumentMask | None = None
) -> torch.Tensor:
    gqa = _grouped(q, k)
    if documents is not None:
        mask = documents.dense(window, q.device)
    elif window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        mask = _causal_mask(q.shape[-2], window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _grouped(q: torch.Tensor, k: torch.Tensor) -> bool:
    return q.shape[1] != k.shape[1]


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
    documents: DocumentMask | None = None,
) -> torch.Tensor:
    """Causal self-attention on [batch, heads, seq, head_dim] tensors, scaled by 1/sqrt(head_dim).

    window=None is full causal; window=w lets query i see keys j with i - w < j <= i.
    k and v may have fewer heads than q (grouped-query attention): query head h reads
    k/v head h // (q heads / k heads), as Llama's `repeat_kv` does.
    `documents` further keeps every query inside its own document.
    """
    same_tokens = q.shape[0] == k.shape[0] and q.shape[2:] == k.shape[2:]
    grouped = k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0
    if not (k.shape == v.shape and same_tokens and grouped):
        raise ValueError(
            "q, k, v must share batch, seq and head_dim, with k/v heads dividing q heads; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if documents is not None and documents.shape != (q.shape[0], q.shape[2]):
        raise ValueError(f"document_ids {documents.shape} do not match q's [batch, seq] {tuple(q.shape)}")
    window = _effective_window(q.shape[-2], window)
    backend = select_backend(
        q.device.type, q.dtype, window, _flash_attn_func is not None, documents is not None
    )
    if backend == "flash_attn":
        return _flash(q, k, v, window, documents)
    if backend == "flex":
        return _flex(q, k, v, window, documents)
    return _sdpa(q, k, v, window, documents)
