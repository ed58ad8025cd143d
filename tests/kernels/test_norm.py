import math
import sys
import types

import torch
from megascale.kernels import LayerNorm, RMSNorm, fused_backend, gelu
from torch import nn


def test_layernorm_falls_back_to_torch_and_matches_formula():
    assert fused_backend() == "torch"
    ln = LayerNorm(16, eps=1e-5)
    assert type(ln) is nn.LayerNorm
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.5, 0.5)
    x = torch.randn(4, 7, 16)
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    want = (x - mean) / torch.sqrt(var + 1e-5) * ln.weight + ln.bias
    torch.testing.assert_close(ln(x), want, atol=1e-5, rtol=1e-5)


def test_gelu_matches_tanh_formula():
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    want = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    torch.testing.assert_close(gelu(x), want)


def test_unrelated_pypi_apex_is_ignored(monkeypatch):
    # PyPI's `apex` is a plain module with no `normalization` subpackage.
    monkeypatch.setitem(sys.modules, "apex", types.ModuleType("apex"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fused_backend() == "torch"
    assert type(LayerNorm(8)) is nn.LayerNorm


def test_nvidia_apex_used_only_with_cuda(monkeypatch):
    class FakeFusedLayerNorm(nn.LayerNorm):
        pass

    apex = types.ModuleType("apex")
    apex.__path__ = []  # a package, so `apex.normalization` resolves
    normalization = types.ModuleType("apex.normalization")
    normalization.FusedLayerNorm = FakeFusedLayerNorm
    apex.normalization = normalization
    monkeypatch.setitem(sys.modules, "apex", apex)
    monkeypatch.setitem(sys.modules, "apex.normalization", normalization)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fused_backend() == "torch"
    assert type(LayerNorm(8)) is nn.LayerNorm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fused_backend() == "apex"
    ln = LayerNorm(8, eps=1e-6)
    assert type(ln) is FakeFusedLayerNorm and ln.eps == 1e-6


def _llama_rms_norm(x, weight, eps):
    """transformers' LlamaRMSNorm.forward, line for line: fp32 statistics, cast back, then the weight."""
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(x.dtype)


def test_rmsnorm_matches_llama_formula_in_fp32_and_bitwise_in_bf16():
    norm = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 7, 16) * 3
    torch.testing.assert_close(norm(x), _llama_rms_norm(x, norm.weight, 1e-6), atol=1e-6, rtol=1e-6)
    norm.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    got, want = norm(xb), _llama_rms_norm(xb, norm.weight, 1e-6)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0, rtol=0)
