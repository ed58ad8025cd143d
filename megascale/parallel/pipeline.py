"""Pipeline parallelism: split the model into (virtual) stages and run the
interleaved 1F1B schedule (Narayanan et al. 2021; vpp = 1 is plain 1F1B).

Rank p holds `vpp` model chunks; chunk c is virtual stage c*pp + p, so activations
travel p -> p+1 and wrap from the last rank back to rank 0 for the next chunk.
Every send and receive is its own async operation (no batched send/recv pairs
that serialise both directions); the receive a step will need is posted one step
ahead, so it arrives while the current microbatch computes.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megascale.parallel.comm import InFlight, all_reduce
from megascale.parallel.topology import Group, ParallelContext


def stage_layers(layers: int, pp: int, vpp: int, virtual_stage: int) -> range:
    per_stage = layers // (pp * vpp)
    return range(virtual_stage * per_stage, (virtual_stage + 1) * per_stage)


def split_into_chunks(model: nn.Module, ctx: ParallelContext) -> list[nn.Module]:
    """This rank's model chunks: views of `model` keeping only the parts each stage owns."""
    layout = ctx.layout
    last = layout.pp * layout.vpp - 1
    chunks = []
    for c in range(layout.vpp):
        virtual_stage = c * layout.pp + ctx.pp_rank
        chunk = copy.copy(model)  # shares every submodule; only the module table is its own
        chunk._modules = dict(model._modules)
        chunk._parameters, chunk._buffers = dict(model._parameters), dict(model._buffers)
        layers = stage_layers(len(model.blocks), layout.pp, layout.vpp, virtual_stage)
        chunk.blocks = nn.ModuleDict({str(i): model.blocks[str(i)] for i in layers})
        if virtual_stage != 0:
            chunk.wte = chunk.drop = None
        if virtual_stage != last:
            chunk.ln_f = chunk.lm_head = chunk.criterion = None
        chunks.append(chunk)
    return chunks


@dataclass(frozen=True)
class Op:
    kind: str  # "F" or "B"
    microbatch: int
    chunk: int


def _virtual_step(k: int, pp: int, vpp: int, backward: bool) -> tuple[int, int]:
    """(microbatch, chunk) of the k-th forward or backward step on any rank."""
    group = k % (pp * vpp)
    chunk = group // pp
    microbatch = (k // (pp * vpp)) * pp + k % pp
    return microbatch, (vpp - 1 - chunk) if backward else chunk


def schedule(pp: int, vpp: int, microbatches: int, pp_rank: int) -> list[Op]:
    """The interleaved-1F1B op order of one pipeline rank."""
    if vpp > 1 and microbatches % pp:
        raise ValueError(f"interleaved 1F1B needs microbatches ({microbatches}) divisible by pp ({pp})")
    total = microbatches * vpp
    if vpp == 1:
        warmup = min(pp - pp_rank - 1, total)
    else:
        warmup = min((pp - pp_rank - 1) * 2 + (vpp - 1) * pp, total)
    fwd = [Op("F", *_virtual_step(k, pp, vpp, False)) for k in range(total)]
    bwd = [Op("B", *_virtual_step(k, pp, vpp, True)) for k in range(total)]
    ops = fwd[:warmup]
    for i in range(total - warmup):
        ops += [fwd[warmup + i], bwd[i]]
    return ops + bwd[total - warmup:]


class _Channel:
    """An ordered stream of tensors to or from one neighbour on one communicator.

    Both ends walk the schedule in the same order, so the i-th send matches the
    i-th receive without tags (as NCCL requires).
    """

    def __init__(self, group: Group, peer_index: int, shape: tuple, dtype: torch.dtype, device: torch.device,
                 async_sends: bool):
        self.group, self.peer = group, group.global_rank(peer_index)
        self.shape, self.dtype, self.device = shape, dtype, device
        self.async_sends = async_sends
        self.pending: list[tuple[torch.Tensor, InFlight]] = []
        self.sends: list[tuple[torch.Tensor, InFlight]] = []

    def post_recv(self) -> None:
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.pending.append((buf, InFlight(dist.irecv(buf, self.peer, group=self.group.pg),
                                           self.group, "recv", self.peer)))

    def recv(self) -> torch.Tensor:
        buf, work = self.pending.pop(0)
        work.wait()
        return buf

    def send(self, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous()
        work = InFlight(dist.isend(tensor, self.peer, group=self.group.pg), self.group, "send", self.peer)
        if self.async_sends:
            self.sends.append((tensor, work))
        else:
            work.wait()

    def finish(self) -> None:
        for _, work in self.sends:
            work.wait()
        self.sends.clear()


def document_ids_on_every_stage(document_ids: torch.Tensor, ctx: ParallelContext, shape: tuple) -> torch.Tensor:
    """The first stage's document ids `shape` [rows, seq] for this step, on every stage: middle stages read
    no data, yet each of their attention layers needs them. An all-reduce to which only the first stage
    contributes (a broadcast in the form the flight recorder knows), once per step."""
    if ctx.pp.size == 1:
        return document_ids.to(ctx.device)
    if ctx.pp.rank == 0:
        shared = document_ids.to(ctx.device, dtype=torch.int64).contiguous()
    else:
        shared = torch.zeros(shape, dtype=torch.int64, device=ctx.device)
    return all_reduce(shared, ctx.pp)


def run_schedule(
    chunks: list[nn.Module],
    ctx: ParallelContext,
    inputs: list[Optional[torch.Tensor]],
    labels: list[Optional[torch.Tensor]],
    loss_weights: list[float],
    activation_shape: tuple,
    dtype: torch.dtype,
    overlap: bool = True,
    document_ids: Optional[list[torch.Tensor]] = None,
    forward_only: bool = False,
) -> torch.Tensor:
    """Runs forward and backward of every microbatch; returns sum_mb(weight_mb * loss_mb) on the last stage.
    `forward_only` (validation) runs the same forward ops in the same order, under no_grad, and no backward.

    `loss_weights[mb]` scales each microbatch's mean loss so the gradients are those of
    the mean over every token of the global batch. `document_ids[mb]`, when given, reach every
    chunk's attention (`data.document_mask`). With `overlap` off every send
    completes before compute continues (receives stay posted one op ahead in both modes:
    in 1F1B a blocking send to a peer that has not posted its receive would deadlock).
    """
    layout, pp = ctx.layout, ctx.layout.pp
    vpp, rank = layout.vpp, ctx.pp_rank
    last_virtual = pp * vpp - 1
    ops = schedule(pp, vpp, len(inputs), rank)
    if forward_only:
        ops = [op for op in ops if op.kind == "F"]
    loss_total = torch.zeros((), device=ctx.device)

    if pp == 1:
        acts_in = grads_in = acts_out = grads_out = None
    else:
        spec = (activation_shape, dtype, ctx.device, overlap)
        acts_in = _Channel(ctx.pp_forward, (rank - 1) % pp, *spec)
        acts_out = _Channel(ctx.pp_forward, (rank + 1) % pp, *spec)
        grads_in = _Channel(ctx.pp_backward, (rank + 1) % pp, *spec)
        grads_out = _Channel(ctx.pp_backward, (rank - 1) % pp, *spec)

    def virtual_stage(op: Op) -> int:
        return op.chunk * pp + rank

    needs_recv = {
        "F": [op for op in ops if op.kind == "F" and virtual_stage(op) != 0],
        "B": [op for op in ops if op.kind == "B" and virtual_stage(op) != last_virtual],
    }
    posted = {"F": 0, "B": 0}

    def post_next(kind: str) -> None:
        # Keep one receive of each kind in flight ahead of the op that consumes it.
        channel = acts_in if kind == "F" else grads_in
        while posted[kind] < len(needs_recv[kind]) and len(channel.pending) < 1:
            channel.post_recv()
            posted[kind] += 1

    if pp > 1:
        post_next("F")
        post_next("B")

    saved: dict[tuple[int, int], tuple[Optional[torch.Tensor], torch.Tensor]] = {}
    for op in ops:
        stage = virtual_stage(op)
        key = (op.microbatch, op.chunk)
        if op.kind == "F":
            if stage == 0:
                x = inputs[op.microbatch]
            else:
                x = acts_in.recv().requires_grad_(not forward_only)
                post_next("F")
            is_last = stage == last_virtual
            documents = {} if document_ids is None else {"document_ids": document_ids[op.microbatch]}
            with ctx.timer.span("forward"), torch.set_grad_enabled(not forward_only):
                out = chunks[op.chunk](x, labels[op.microbatch] if is_last else None, **documents)
            if is_last:
                out = out * loss_weights[op.microbatch]
                loss_total += out.detach()
            else:
                acts_out.send(out)
            if not forward_only:
                saved[key] = (x if stage != 0 else None, out)
        else:
            x, out = saved.pop(key)
            if stage == last_virtual:
                grad = None
            else:
                grad = grads_in.recv()
                post_next("B")
            with ctx.timer.span("backward"):
                torch.autograd.backward(out, grad)
            if stage != 0:
                grads_out.send(x.grad)
    if pp > 1:
        for channel in (acts_out, grads_out):
            channel.finish()
    return loss_total
