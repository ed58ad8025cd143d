import importlib
import math

import pytest
import torch
from megascale.kernels import attention, attention_backend

# `megascale.kernels.attention` the attribute is the function (the package re-exports
# it over the submodule), so fetch the module itself from the import system.
attn_mod = importlib.import_module("megascale.kernels.attention")

B, H, S, D = 2, 3, 32, 16


def reference(q, k, v, window=None):
    """Dense causal (optionally sliding-window) attention, written out longhand."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    i = torch.arange(q.shape[-2])
    dist = i[:, None] - i[None, :]
    allowed = dist >= 0
    if window is not None:
        allowed &= dist < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def qkv(seed=0, seq=S):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, H, seq, D, generator=g, requires_grad=True) for _ in range(3)
    ]


def grads(fn, q, k, v, window):
    out = fn(q, k, v, window)
    dout = torch.randn_like(out, generator=torch.Generator().manual_seed(1))
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("window", [None, 1, 3, S // 2, S - 1, S])
def test_sdpa_matches_reference(window):
    q, k, v = qkv()
    assert attention_backend(q, window) == "sdpa"
    for got, want in zip(
        grads(attention, q, k, v, window), grads(reference, q, k, v, window)
    ):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [1, 5, S // 2])
def test_flex_path_matches_reference(window):
    # The CUDA-only branch, run eagerly on CPU so its block mask is checked here too.
    # Forward only: FlexAttention has no CPU backward.
    q, k, v = (t.detach() for t in qkv(seq=64))
    torch.testing.assert_close(
        attn_mod._flex(q, k, v, window),
        reference(q, k, v, window),
        atol=1e-5,
        rtol=1e-5,
    )


def test_full_window_equals_causal_and_window_one_is_v():
    q, k, v = qkv()
    torch.testing.assert_close(attention(q, k, v, window=S), attention(q, k, v))
    torch.testing.assert_close(attention(q, k, v, window=1), v)


def test_sliding_window_mask_path_equals_causal_when_window_covers_seq():
    # attention() short-circuits window >= seq to is_causal; the mask itself must agree.
    q, k, v = qkv()
    torch.testing.assert_close(attn_mod._sdpa(q, k, v, S), attention(q, k, v))


def test_mask_is_cached_and_usable_after_inference_mode():
    q, k, v = qkv(seq=24)
    with torch.inference_mode():
        attention(q.detach(), k.detach(), v.detach(), window=4)
    out = attention(q, k, v, window=4)  # reuses the cached mask with autograd on
    out.sum().backward()
    assert attn_mod._causal_mask(
        24, 4, q.device
    ) is attn_mod._causal_mask(24, 4, q.device)


def test_bad_window_rejected():
    q, k, v = qkv()
    with pytest.raises(ValueError):
        attention(q, k, v, window=0)


def test_cpu_dispatch_without_flash_attn(monkeypatch):
    monkeypatch.setattr(attn_mod, "_flash_attn_func", None)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.zeros(1, 1, 8, 4, dtype=dtype)
        assert attention_backend(q) == "sdpa"
        assert attention_backend(q, window=3) == "sdpa"


def test_cpu_dispatch_ignores_flash_attn(monkeypatch):
    monkeypatch.setattr(
        attn_mod, "_flash_attn_func", lambda *a, **kw: pytest.fail("flash on CPU")
    )
    q = torch.zeros(1, 1, 8, 4, dtype=torch.bfloat16)
    assert attention_backend(q, window=3) == "sdpa"


@pytest.mark.parametrize(
    "dtype, window, flash, want",
    [
        (torch.bfloat16, None, True, "flash_attn"),
        (torch.float16, 128, True, "flash_attn"),
        (torch.float32, 128, True, "flex"),  # flash-attn has no fp32 kernels
        (torch.float32, None, True, "sdpa"),
        (torch.bfloat16, 128, False, "flex"),
        (torch.bfloat16, None, False, "sdpa"),
    ],
)
def test_cuda_dispatch_decision(dtype, window, flash, want):
    assert attn_mod.select_backend("cuda", dtype, window, flash) == want


def test_flash_call_convention(monkeypatch):
    # Checks the [b,s,h,d] layout and window_size we hand flash-attn, using SDPA as a stand-in.
    seen = {}

    def fake_flash(q, k, v, causal, window_size):
        seen.update(causal=causal, window_size=window_size, shape=tuple(q.shape))
        w = None if window_size == (-1, -1) else window_size[0] + 1
        return attn_mod._sdpa(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), w
        ).transpose(1, 2)

    monkeypatch.setattr(attn_mod, "_flash_attn_func", fake_flash)
    q, k, v = qkv()
    torch.testing.assert_close(attn_mod._flash(q, k, v, 4), reference(q, k, v, 4))
    assert seen == {"causal": True, "window_size": (3, 0), "shape": (B, S, H, D)}
    attn_mod._flash(q, k, v, None)
    assert seen["window_size"] == (-1, -1)


def test_package_exports_function():
    assert attention is attn_mod.attention


def _grouped_qkv(kv_heads: int, seq=S):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, 4, seq, D, generator=g, requires_grad=True)
    k, v = (torch.randn(B, kv_heads, seq, D, generator=g, requires_grad=True) for _ in range(2))
    return q, k, v


def repeated_kv_reference(q, k, v, window=None):
    """GQA as Llama's repeat_kv writes it: each k/v head copied for its consecutive query heads."""
    group = q.shape[1] // k.shape[1]
    return reference(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), window)


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("window", [None, 5])
def test_grouped_query_attention_matches_repeated_kv_heads(kv_heads, window):
    q, k, v = _grouped_qkv(kv_heads)
    for got, want in zip(grads(attention, q, k, v, window), grads(repeated_kv_reference, q, k, v, window)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_path_handles_grouped_query_attention():
    q, k, v = (t.detach() for t in _grouped_qkv(2, seq=64))
    torch.testing.assert_close(attn_mod._flex(q, k, v, 5), repeated_kv_reference(q, k, v, 5), atol=1e-5, rtol=1e-5)


def test_kv_heads_must_divide_query_heads():
    q, k, v = _grouped_qkv(3)
    with pytest.raises(ValueError, match="k/v heads dividing q heads"):
        attention(q, k, v)
