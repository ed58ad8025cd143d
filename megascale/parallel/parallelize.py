"""Applies 3D parallelism to a single-device GPT (either arch): pipeline split, tensor (+sequence)
parallel sharding, activation recomputation, precision, then the ZeRO optimizer over data parallel.

The GPT may be built on the meta device: then a stage materialises only its own layers, and a
TP-sharded weight exists in full only while its slice is cut (one weight at a time), so no rank
ever holds the whole model.

Each step is its own function; the tensor-parallel layout is a plan (module name ->
style), not code inside the model.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from megascale.config import JobConfig
from megascale.model.gpt import GPT, FusedLinear, ParallelBlock
from megascale.parallel.comm import EnterTP, ExitTP
from megascale.parallel.pipeline import split_into_chunks
from megascale.parallel.recompute import apply_recompute
from megascale.parallel.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelCrossEntropy, VocabParallelEmbedding,
    shard_in_features, shard_out_features,
)
from megascale.parallel.topology import ParallelContext
from megascale.parallel.zero import DistributedOptimizer

# A style turns a single-device module into its TP form; `overlap_chunks` > 1 pipelines
# sequence-parallel communication with the GEMM (tp_overlap.py).
Style = Callable[[nn.Module, ParallelContext, int], nn.Module]
TP_OVERLAP_CHUNKS = 2


def colwise(enter: bool = True) -> Style:
    """Output features split over TP; a FusedLinear (q|k|v with GQA's fewer k/v heads, SwiGLU's
    gate|up) section by section, so each rank computes whole heads and matching gate/up columns."""
    def apply(linear: nn.Module, ctx: ParallelContext, overlap_chunks: int) -> nn.Module:
        sections = linear.sections if isinstance(linear, FusedLinear) else None
        weight = shard_out_features(linear.weight.detach(), ctx.tp, sections)
        return ColumnParallelLinear(weight, EnterTP(ctx.tp, ctx.sequence_parallel) if enter else None, overlap_chunks)
    return apply


def rowwise(exit: bool = True) -> Style:
    def apply(linear: nn.Module, ctx: ParallelContext, overlap_chunks: int) -> nn.Module:
        weight = shard_in_features(linear.weight.detach(), ctx.tp)
        return RowParallelLinear(weight, ExitTP(ctx.tp, ctx.sequence_parallel) if exit else None, overlap_chunks)
    return apply


def enter_tp(_: nn.Module, ctx: ParallelContext, overlap_chunks: int) -> nn.Module:
    return EnterTP(ctx.tp, ctx.sequence_parallel)


def exit_tp(_: nn.Module, ctx: ParallelContext, overlap_chunks: int) -> nn.Module:
    return ExitTP(ctx.tp, ctx.sequence_parallel)


# Serial block: each branch enters and exits the TP region on its own.
SERIAL_BLOCK_PLAN: dict[str, Style] = {
    "attn.qkv": colwise(),
    "attn.proj": rowwise(),
    "mlp.fc": colwise(),
    "mlp.proj": rowwise(),
}
# PTB: one shared entry (fan_out) and one shared reduction (merge) for both branches.
PARALLEL_BLOCK_PLAN: dict[str, Style] = {
    "fan_out": enter_tp,
    "attn.qkv": colwise(enter=False),
    "mlp.fc": colwise(enter=False),
    "attn.proj": rowwise(exit=False),
    "mlp.proj": rowwise(exit=False),
    "merge": exit_tp,
}


def materialize(chunk: GPT, module: nn.Module, prefix: str = "") -> None:
    """Gives `module`'s parameters still on the meta device their initial values. In place
    (`swap_tensors`), so a parameter tied elsewhere stays one object."""
    for name, p in module.named_parameters(prefix=prefix):
        if p.is_meta:
            torch.utils.swap_tensors(p, nn.Parameter(chunk.init_value(name, p.shape)))


def _replace(root: nn.Module, path: str, style: Style, ctx: ParallelContext, overlap_chunks: int) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, style(getattr(parent, name), ctx, overlap_chunks))


def apply_tp(chunk: GPT, ctx: ParallelContext, shared: dict, overlap: bool = False) -> None:
    """Shards one pipeline chunk over the TP group (in place). `shared` maps tied weights across calls."""
    overlap_chunks = TP_OVERLAP_CHUNKS if overlap else 0
    for index, block in chunk.blocks.items():
        plan = PARALLEL_BLOCK_PLAN if isinstance(block, ParallelBlock) else SERIAL_BLOCK_PLAN
        for path, style in plan.items():
            materialize(chunk, block.get_submodule(path), f"blocks.{index}.{path}")
            _replace(block, path, style, ctx, overlap_chunks)
    vocab_start = ctx.tp.rank * (chunk.cfg.vocab // ctx.tp.size)
    if chunk.wte is not None:
        materialize(chunk, chunk.wte, "wte")
        full = chunk.wte.weight
        shared[id(full)] = shard_out_features(full.detach(), ctx.tp)
        chunk.wte = VocabParallelEmbedding(shared[id(full)], ctx.tp, ctx.sequence_parallel)
    if chunk.lm_head is not None:
        materialize(chunk, chunk.lm_head, "lm_head")
        full = chunk.lm_head.weight
        weight = shared[id(full)] if id(full) in shared else shard_out_features(full.detach(), ctx.tp)
        chunk.lm_head = ColumnParallelLinear(weight, EnterTP(ctx.tp, ctx.sequence_parallel), overlap_chunks)
        chunk.criterion = VocabParallelCrossEntropy(ctx.tp, vocab_start)


def mark_sequence_parallel_norms(chunk: nn.Module) -> None:
    """Under SP each rank's norms see only its tokens: their grads are summed over TP."""
    for module in chunk.modules():
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__ == "FusedLayerNorm":
            for p in module.parameters():
                p.sequence_parallel = True


def mark_tied_embeddings(chunks: list[GPT], ctx: ParallelContext) -> None:
    """With pp > 1 the first and last stages hold separate copies of a tied embedding;
    their gradients are summed over the embedding group, and the norm counts one copy."""
    if not chunks[0].cfg.tied_embeddings or ctx.layout.pp == 1:
        return
    for chunk in chunks:
        if chunk.wte is not None:
            chunk.wte.weight.shared_embedding = True
        if chunk.lm_head is not None:
            chunk.lm_head.weight.shared_embedding = True
            chunk.lm_head.weight.duplicate_of_first_stage = True


def compute_dtype(cfg: JobConfig, device: torch.device) -> torch.dtype:
    choice = cfg.precision.dtype
    if choice == "auto":
        choice = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if choice == "bf16" else torch.float32


def unique_named_parameters(chunks: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    seen, out = set(), []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
    return out


def parallelize(model: GPT, ctx: ParallelContext, cfg: JobConfig) -> tuple[list[GPT], DistributedOptimizer]:
    """The list of steps that turns a single-device GPT into this rank's share of the job."""
    chunks = shard_model(model, ctx, cfg)
    optimizer = DistributedOptimizer(unique_named_parameters(chunks), ctx, cfg.optimizer,
                                     bucket_mb=cfg.parallelism.grad_bucket_mb, overlap=cfg.parallelism.overlap.dp,
                                     zero=cfg.parallelism.zero)
    optimizer.attach(chunks)
    return chunks, optimizer


def shard_model(model: GPT, ctx: ParallelContext, cfg: JobConfig) -> list[GPT]:
    """This rank's pipeline chunks of `model`, TP-sharded, materialised (initialised) and on the device."""
    chunks = split_into_chunks(model, ctx)
    if ctx.tp.size > 1:
        shared: dict = {}
        for chunk in chunks:
            apply_tp(chunk, ctx, shared, overlap=cfg.parallelism.overlap.tp)
    for chunk in chunks:
        materialize(chunk, chunk)  # what TP did not shard: norms, and every weight when tp == 1
    if ctx.sequence_parallel and ctx.tp.size > 1:
        for chunk in chunks:
            mark_sequence_parallel_norms(chunk)
    mark_tied_embeddings(chunks, ctx)
    apply_recompute(chunks, cfg.train.recompute)
    dtype = compute_dtype(cfg, ctx.device)
    for chunk in chunks:
        chunk.to(device=ctx.device, dtype=dtype)
    return chunks
