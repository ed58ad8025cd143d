"""Attention and fused-op kernels with pure-PyTorch fallbacks."""

from .attention import DocumentMask, attention, attention_backend
from .norm import LayerNorm, RMSNorm, fused_backend, gelu

__all__ = ["DocumentMask", "LayerNorm", "RMSNorm", "attention", "attention_backend", "fused_backend", "gelu"]
