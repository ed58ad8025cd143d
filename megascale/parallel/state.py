"""Full (unsharded over TP) parameters of this rank's pipeline stage, by global name."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from megascale.parallel.parallelize import unique_named_parameters
from megascale.parallel.tensor_parallel import unshard
from megascale.parallel.topology import ParallelContext


@torch.no_grad()
def full_stage_parameters(chunks: list[nn.Module], ctx: ParallelContext) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in unique_named_parameters(chunks):
        if getattr(p, "tensor_parallel", False) and ctx.tp.size > 1:
            shards = [torch.empty_like(p) for _ in range(ctx.tp.size)]
            dist.all_gather(shards, p.contiguous(), group=ctx.tp.pg)
            out[name] = unshard(shards, p.tp_dim, p.tp_sections).float().cpu()
        else:
            out[name] = p.detach().float().cpu().clone()
    return out
