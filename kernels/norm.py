"""LayerNorm (NVIDIA apex's fused kernel when it can run), RMSNorm and GeLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _apex_fused_layer_norm() -> type[nn.Module] | None:
    """apex's FusedLayerNorm class, or None.

    Looked up on each call (cheap once imported) rather than at import time, so a
    test can swap `apex` in sys.modules. Requiring `apex.normalization` rejects
    the unrelated PyPI package that is also called `apex`.
    """
    if not torch.cuda.is_available():
        return None
    try:
        from apex.normalization import FusedLayerNorm
    except Exception:  # noqa: BLE001 -- missing, the wrong `apex`, or built against another torch
        return None
    return FusedLayerNorm


def fused_backend() -> str:
    """Which LayerNorm implementation `LayerNorm` builds: "apex" or "torch" (for logs)."""
    return "torch" if _apex_fused_layer_norm() is None else "apex"


def LayerNorm(hidden: int, eps: float = 1e-5) -> nn.Module:
    """LayerNorm over the last dim with affine weight and bias."""
    fused = _apex_fused_layer_norm()
    if fused is not None:
        return fused(hidden, eps=eps)
    return nn.LayerNorm(hidden, eps=eps)


class RMSNorm(nn.RMSNorm):
    """RMSNorm with Llama's rounding: normalised in fp32, cast back, then scaled by the weight.

    nn.RMSNorm (and apex's fused kernel) scale before casting back; in bf16 that rounds
    differently from transformers' LlamaRMSNorm, which exported weights must reproduce.
    """

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__(hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), self.normalized_shape, eps=self.eps).to(x.dtype)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """Tanh-approximated GeLU, as in GPT-2 / Megatron.

    Always torch: its tanh GeLU is already one elementwise kernel, and apex only
    ships bias-GeLU fused into a Linear (apex.fused_dense), not standalone.
    """
    return F.gelu(x, approximate="tanh")
