"""Activation recomputation (`train.recompute`), applied to a built model (TorchTitan's `apply_ac`).

- `selective`: what Megatron-core's selective recompute offers (`recompute_modules` core_attn,
  layernorm and the MLP activation): cheap work whose outputs are large runs again in backward.
  - Each attention core (softmax(QK^T)V with its causal, sliding-window and document masks) keeps
    only q, k, v, through torch.utils.checkpoint.
  - Each block's norms (LayerNorm / RMSNorm; the parallel block's one shared norm) and its MLP
    activation (GeLU, or SwiGLU's SiLU(gate) * up, ffn wide) run without a graph and keep only
    their input. Their outputs are still saved by the GEMMs that read them (QKV, FC1, FC2 need
    them for the weight gradient), so a checkpoint around the norm alone would save nothing:
    as Megatron-core's CheckpointWithoutOutput does, the block's forward hook frees the output's
    storage once the block has run (the saved tensors keep their shape, not their bytes), and a
    hook on the gradient of the block's output rebuilds it, before any GEMM of the block runs
    backward. Under sequence parallelism the norm's output is all-gathered before the GEMM, which
    then saves the gathered copy: that copy is freed too and gathered again in backward, by every
    TP rank at the same point of the same graph. (A serial block with `overlap.tp` gathers inside
    its pipelined GEMM, whose gathered copy stays saved; only the local shard is freed there.)
- `full`: each transformer block keeps only its input and runs again in backward; Megatron-LM's
  "uniform" granularity with one layer per chunk. Under TP the block's collectives run again in
  backward; every TP rank walks the same autograd graph in the same order and stops recomputing
  at the same point, so their collectives still pair up.

Modules are neither wrapped nor renamed (the checkpoint is torch's hook-based composable entry
point; a norm or activation gets an instance `forward`), so parameter names, which ZeRO shards
and checkpoints are keyed by, stay the model's own. The attention core's recomputation restores
the RNG state, so dropout draws the same masks; norms and activations draw none.
"""
from __future__ import annotations

from typing import Iterable, Literal

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint

from megascale.parallel.comm import EnterTP

Recompute = Literal["none", "selective", "full"]


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__ == "FusedLayerNorm"


def discarded_output_modules(block: nn.Module) -> list[nn.Module]:
    """The modules of a block whose outputs `selective` frees: its norms and its MLP activation."""
    return [m for m in block.children() if _is_norm(m)] + [block.mlp.act]


def recomputed_modules(chunks: Iterable[nn.Module], mode: Recompute) -> list[nn.Module]:
    """The modules `mode` recomputes: every block, or every block's attention core, norms and MLP activation."""
    if mode == "none":
        return []
    blocks = [block for chunk in chunks for block in chunk.blocks.values()]
    if mode == "full":
        return blocks
    return [m for block in blocks for m in [block.attn.core, *discarded_output_modules(block)]]


def _owns_storage(t: torch.Tensor) -> bool:
    """Whether `t` is its storage's only content, so the storage can be freed and refilled as a whole."""
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return whole and t.is_contiguous() and t.storage_offset() == 0


class _Freed:
    """One output freed after its block's forward, with how to rebuild it in backward."""

    def __init__(self, output: torch.Tensor):
        self.output = output  # its storage is emptied; the tensor keeps the shape saved tensors refer to

    def free(self) -> None:
        self.output.untyped_storage().resize_(0)

    def restore(self, value: torch.Tensor) -> None:
        # Storage-level, so the version counter the saved tensors check does not move.
        storage = self.output.untyped_storage()
        storage.resize_(value.untyped_storage().nbytes())
        storage.copy_(value.untyped_storage())


class _FreedOutput(_Freed):
    """A norm's or activation's output: `run(x)` again, this time with a graph for its own backward."""

    def __init__(self, run, x: torch.Tensor, params: tuple[nn.Parameter, ...]):
        self.run, self.x, self.params = run, x, params
        self.leaf = self.graph = None
        super().__init__(_WithoutGraph.apply(self, x, *params))

    def recompute(self) -> None:
        self.leaf = self.x.detach().requires_grad_()
        with torch.enable_grad():
            self.graph = self.run(self.leaf)

    def rebuild(self) -> None:
        self.recompute()
        self.restore(self.graph)

    def backward(self, grad: torch.Tensor) -> tuple:
        if self.graph is None:  # not freed (nothing of the block saved it), so not rebuilt
            self.recompute()
        grads = torch.autograd.grad(self.graph, (self.leaf, *self.params), grad, allow_unused=True)
        self.x = self.leaf = self.graph = None
        return grads


class _Regathered(_Freed):
    """The sequence-parallel all-gather of a freed output, gathered again from the rebuilt one."""

    def __init__(self, output: torch.Tensor, enter: EnterTP, source: _FreedOutput):
        super().__init__(output)
        self.enter, self.source = enter, source

    def rebuild(self) -> None:
        with torch.no_grad():
            self.restore(self.enter(self.source.output))


class _WithoutGraph(torch.autograd.Function):
    """y = run(x) computed without a graph, so nothing but x is kept; backward differentiates the
    graph that `_FreedOutput.rebuild` made. The parameters are inputs so that their gradients
    accumulate as they would without recomputation."""

    @staticmethod
    def forward(ctx, freed: _FreedOutput, x: torch.Tensor, *params: nn.Parameter) -> torch.Tensor:
        ctx.freed = freed
        return freed.run(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return (None, *ctx.freed.backward(grad))


class DiscardOutputs:
    """`selective`'s norms and activations of a set of blocks: what each block's forward frees."""

    def __init__(self):
        self.freed: list | None = None  # of the block running forward, else None

    def attach(self, block: nn.Module) -> None:
        block.register_forward_pre_hook(self._begin)
        block.register_forward_hook(self._end)
        for module in discarded_output_modules(block):
            module.forward = self._without_graph(module, module.forward)
        for module in block.modules():
            if isinstance(module, EnterTP):
                module.register_forward_hook(self._gathered)

    def _without_graph(self, module: nn.Module, run):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if self.freed is None or not torch.is_grad_enabled():  # validation, or outside a block
                return run(x)
            freed = _FreedOutput(run, x, tuple(module.parameters()))
            if _owns_storage(freed.output):
                self.freed.append(freed)
            return freed.output
        return forward

    def _gathered(self, enter: EnterTP, args: tuple, output: torch.Tensor) -> None:
        if self.freed is None or output.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr():
            return  # outside a block, or an alias (no sequence parallelism): freeing the source frees it
        source = args[0].untyped_storage().data_ptr()
        for freed in self.freed:
            if isinstance(freed, _FreedOutput) and freed.output.untyped_storage().data_ptr() == source:
                if _owns_storage(output):
                    self.freed.append(_Regathered(output, enter, freed))
                return

    def _begin(self, _block: nn.Module, _args: tuple) -> None:
        self.freed = []

    def _end(self, _block: nn.Module, _args: tuple, output: torch.Tensor) -> None:
        freed, self.freed = self.freed, None
        if not freed or not output.requires_grad:
            return
        for f in freed:
            f.free()

        def rebuild(_grad: torch.Tensor) -> None:
            # In forward order: a gathered output is rebuilt from the norm output rebuilt before it.
            for f in freed:
                f.rebuild()
            freed.clear()
        output.register_hook(rebuild)


def apply_recompute(chunks: Iterable[nn.Module], mode: Recompute) -> None:
    """Makes backward recompute what `mode` names instead of keeping its activations."""
    chunks = list(chunks)
    if mode == "selective":
        discard = DiscardOutputs()
        for chunk in chunks:
            for block in chunk.blocks.values():
                discard.attach(block)
                checkpoint(block.attn.core, use_reentrant=False)
        return
    for module in recomputed_modules(chunks, mode):
        checkpoint(module, use_reentrant=False)
