"""Activation recomputation (`train.recompute`), applied to a built model (TorchTitan's `apply_ac`).

- `selective`: each attention core (softmax(QK^T)V with its causal, sliding-window and document
  masks) keeps only its inputs q, k, v and runs again in backward; Megatron-LM's selective
  recomputation (`core_attn`), the same on serial and parallel blocks. It holds no collective.
- `full`: each transformer block keeps only its input and runs again in backward; Megatron-LM's
  "uniform" granularity with one layer per chunk. Under TP the block's collectives run again in
  backward; every TP rank walks the same autograd graph in the same order and stops recomputing
  at the same point, so their collectives still pair up.

torch.utils.checkpoint's non-reentrant form through its hook-based (composable) entry point: the
modules are neither wrapped nor renamed, so parameter names, which ZeRO shards and checkpoints are
keyed by, stay the model's own. The CPU RNG state (and that of the inputs' accelerator) is stashed
at forward and restored for the recomputation, so dropout draws the same masks.
"""
from __future__ import annotations

from typing import Iterable, Literal

import torch.nn as nn
from torch.distributed._composable import checkpoint

Recompute = Literal["none", "selective", "full"]


def recomputed_modules(chunks: Iterable[nn.Module], mode: Recompute) -> list[nn.Module]:
    """The modules `mode` recomputes: every block, or every block's attention core."""
    if mode == "none":
        return []
    blocks = [block for chunk in chunks for block in chunk.blocks.values()]
    return blocks if mode == "full" else [block.attn.core for block in blocks]


def apply_recompute(chunks: Iterable[nn.Module], mode: Recompute) -> None:
    """Makes backward recompute what `mode` names instead of keeping its activations."""
    for module in recomputed_modules(chunks, mode):
        checkpoint(module, use_reentrant=False)
