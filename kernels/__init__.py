"""Attention and fused-op kernels with pure-PyTorch fallbacks."""

from .attention import attention, attention_backend
from .norm import LayerNorm, fused_backend, gelu

__all__ = ["LayerNorm", "attention", "attention_backend", "fused_backend", "gelu"]
