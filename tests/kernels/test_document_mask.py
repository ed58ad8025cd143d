"""Document-masked attention (data.document_mask) on every kernel path against a dense reference."""
import importlib
import math

import pytest
import torch
from megascale.kernels import DocumentMask, attention, attention_backend

attn_mod = importlib.import_module("megascale.kernels.attention")

B, H, S, D = 2, 4, 32, 8
# Row 0: three documents; row 1 continues row 0's last document, then two more (a document that spans
# rows is two pieces: a row never sees the one before it).
DOCUMENT_IDS = torch.tensor([[0] * 5 + [1] * 19 + [2] * 8, [2] * 11 + [3] + [4] * 20])


def reference(q, k, v, document_ids, window=None):
    """softmax(q·k / sqrt(d)) v over the block-diagonal causal mask, k/v heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    i = torch.arange(q.shape[-2])
    dist = i[:, None] - i[None, :]
    allowed = (dist >= 0) & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
    if window is not None:
        allowed &= dist < window
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def qkv(kv_heads=H, seq=S, requires_grad=True):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, seq, D, generator=g, requires_grad=requires_grad)
    k, v = (torch.randn(B, kv_heads, seq, D, generator=g, requires_grad=requires_grad) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("kv_heads", [H, 2])
@pytest.mark.parametrize("window", [None, 4])
def test_sdpa_with_documents_matches_the_dense_reference_forward_and_backward(kv_heads, window):
    q, k, v = qkv(kv_heads)
    documents = DocumentMask(DOCUMENT_IDS)
    assert attention_backend(q, window, documents) == "sdpa"
    got = attention(q, k, v, window, documents)
    want = reference(q, k, v, DOCUMENT_IDS, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    dout = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_single_document_is_plain_causal_attention():
    q, k, v = qkv()
    torch.testing.assert_close(attention(q, k, v, documents=DocumentMask(torch.zeros(B, S, dtype=torch.long))),
                               attention(q, k, v), atol=1e-6, rtol=1e-6)


def test_the_first_token_of_a_document_sees_only_itself():
    q, k, v = qkv()
    out = attention(q, k, v, documents=DocumentMask(DOCUMENT_IDS))
    torch.testing.assert_close(out[0, :, 5], v[0, :, 5])  # row 0's second document starts at 5
    torch.testing.assert_close(out[1, :, 0], v[1, :, 0])  # every row starts a piece


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kv_heads, window", [(H, None), (2, 5)])
def test_flex_block_mask_path_matches_the_dense_reference(kv_heads, window):
    # The CUDA path, run eagerly on CPU (forward only: FlexAttention has no CPU backward).
    q, k, v = qkv(kv_heads, requires_grad=False)
    got = attn_mod._flex(q, k, v, window, DocumentMask(DOCUMENT_IDS))
    torch.testing.assert_close(got, reference(q, k, v, DOCUMENT_IDS, window), atol=1e-5, rtol=1e-5)


def test_flash_varlen_call_convention(monkeypatch):
    # flash-attn's varlen entry point, stood in for by per-piece causal SDPA: checks the flattened
    # [tokens, heads, dim] layout, the piece offsets and the window we hand it.
    seen = {}

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, window_size):
        seen.update(cu=cu_q.tolist(), max=(max_q, max_k), causal=causal, window_size=window_size,
                    shapes=(tuple(q.shape), tuple(k.shape)), same=cu_q is cu_k)
        out = torch.empty_like(q)
        bounds = cu_q.tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            piece = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]
            window = None if window_size == (-1, -1) else window_size[0] + 1
            out[start:end] = attn_mod._sdpa(*piece, attn_mod._effective_window(end - start, window))[0].transpose(0, 1)
        return out

    monkeypatch.setattr(attn_mod, "_flash_attn_varlen_func", fake_varlen)
    q, k, v = qkv(2, requires_grad=False)
    got = attn_mod._flash(q, k, v, 4, DocumentMask(DOCUMENT_IDS))
    torch.testing.assert_close(got, reference(q, k, v, DOCUMENT_IDS, 4), atol=1e-5, rtol=1e-5)
    assert seen == {"cu": [0, 5, 24, 32, 43, 44, 64], "max": (S, S), "causal": True, "window_size": (3, 0),
                    "shapes": ((B * S, H, D), (B * S, 2, D)), "same": True}


@pytest.mark.parametrize("dtype, flash, want", [
    (torch.bfloat16, True, "flash_attn"),  # varlen
    (torch.float32, True, "flex"),
    (torch.bfloat16, False, "flex"),
])
def test_cuda_dispatch_with_documents(dtype, flash, want):
    assert attn_mod.select_backend("cuda", dtype, None, flash, documents=True) == want
    assert attn_mod.select_backend("cpu", dtype, None, flash, documents=True) == "sdpa"


def test_each_form_of_the_mask_is_built_once_for_all_layers():
    q, k, v = qkv(requires_grad=False)
    documents = DocumentMask(DOCUMENT_IDS)
    attention(q, k, v, documents=documents)
    first = documents.dense(None, q.device)
    attention(q, k, v, documents=documents)
    assert documents.dense(None, q.device) is first


def test_document_ids_of_another_shape_are_refused():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"document_ids \(2, 16\) do not match"):
        attention(q, k, v, documents=DocumentMask(DOCUMENT_IDS[:, :16]))
