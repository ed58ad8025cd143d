"""The torch-native peer of `megascale bench peers`, composed the TorchTitan way: a plain transformer module
(TorchTitan's names), then `apply_pp` (a stage per virtual stage, `ScheduleInterleaved1F1B`), `apply_tp`
(DTensor plans with sequence parallelism, `parallelize_module`) and `apply_fsdp` (FSDP2 `fully_shard` over DP),
each a short step. Gloo on the CPU; AdamW; gradients clipped over the whole model as megascale does.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from megascale.bench.peers import mapped_weights, reference_state, source_of
from megascale.config import JobConfig, ModelConfig
from megascale.parallel.pipeline import stage_layers
from megascale.parallel.topology import ParallelContext


class Attention(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.head_dim = m.hidden // m.heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(m.hidden, m.hidden, bias=False) for _ in range(4))
        freqs = torch.outer(torch.arange(m.seq, dtype=torch.float64),
                            m.rotary_base ** -(torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        self.register_buffer("rope", torch.cat([freqs, freqs], dim=-1).float(), persistent=False)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Rotary positions on halves (x[:d/2], x[d/2:]), as GPT-NeoX and megatron (not TorchTitan's pairs)."""
        half = x.shape[-1] // 2
        turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.rope.cos() + turned * self.rope.sin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: a TP shard holds its share of them.
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(self.rotate(q), self.rotate(k), v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.w1, self.w2 = nn.Linear(m.hidden, m.ffn, bias=False), nn.Linear(m.ffn, m.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class TransformerBlock(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(m.hidden, eps=m.norm_eps), Attention(m)
        self.ffn_norm, self.feed_forward = nn.LayerNorm(m.hidden, eps=m.norm_eps), FeedForward(m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """A pipeline stage sets the parts it does not hold to None (TorchTitan's manual split)."""

    def __init__(self, m: ModelConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(m.vocab, m.hidden)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(m) for i in range(m.layers)})
        self.norm, self.output = nn.LayerNorm(m.hidden, eps=m.norm_eps), nn.Linear(m.hidden, m.vocab, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h)) if self.output is not None else h


# megascale GPT name -> this module's, per layer and outside the layers; the fused qkv is split in three.
LAYER_NAMES = {"ln_1.weight": "attention_norm.weight", "ln_1.bias": "attention_norm.bias",
               "attn.proj.weight": "attention.wo.weight", "ln_2.weight": "ffn_norm.weight",
               "ln_2.bias": "ffn_norm.bias", "mlp.fc.weight": "feed_forward.w1.weight",
               "mlp.proj.weight": "feed_forward.w2.weight"}
OUTER_NAMES = {"wte.weight": "tok_embeddings.weight", "ln_f.weight": "norm.weight", "ln_f.bias": "norm.bias",
               "lm_head.weight": "output.weight"}


def torch_native_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """megascale's 1-rank GPT state dict in this module's names (MHA: q, k and v are equal thirds)."""

    def per_layer(layer: str, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if name == "attn.qkv.weight":
            return {f"layers.{layer}.attention.{part}.weight": v for part, v in zip(("wq", "wk", "wv"), t.chunk(3))}
        return {f"layers.{layer}.{LAYER_NAMES[name]}": t}

    return mapped_weights(state, OUTER_NAMES, per_layer)


def apply_pp(model: Transformer, cfg: JobConfig, pp_rank: int) -> list[tuple[int, Transformer]]:
    """(stage index, module) of each virtual stage this rank holds: stage v*pp + pp_rank, as megascale's."""
    p, stages = cfg.parallelism, []
    last = p.pp * p.vpp - 1
    for v in range(p.vpp):
        index = v * p.pp + pp_rank
        stage = Transformer.__new__(Transformer)
        nn.Module.__init__(stage)
        keep = stage_layers(cfg.model.layers, p.pp, p.vpp, index)
        stage.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in keep})
        stage.tok_embeddings = model.tok_embeddings if index == 0 else None
        stage.norm, stage.output = (model.norm, model.output) if index == last else (None, None)
        stages.append((index, stage))
    return stages


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """TorchTitan's TP plan with sequence parallelism: activations between blocks are sharded by sequence."""
    outer = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
             "norm": SequenceParallel(),
             "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    parallelize_module(model, tp_mesh, {k: v for k, v in outer.items() if getattr(model, k) is not None})
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(), "attention": gather,
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(), "feed_forward": gather,
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, pipelined: bool) -> None:
    """FSDP2 per block, then the rest; a pipeline keeps parameters gathered between its microbatches."""
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=not pipelined)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=not pipelined)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None) -> None:
    """The global gradient norm over DTensor shards and pipeline stages (TorchTitan's clip_grad_norm_)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if pp_group is not None:
        norm = norm.square()
        dist.all_reduce(norm, group=pp_group)
        norm = norm.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)


def train_torch_native(ctx: ParallelContext, cfg: JobConfig, steps: int) -> dict:
    """Trains `steps` steps; returns this rank's step times and (last pipeline stage) losses."""
    p = cfg.parallelism
    model = Transformer(cfg.model)
    model.load_state_dict(torch_native_weights(reference_state(cfg)))
    mesh = None if ctx.layout.world_size == 1 else init_device_mesh("cpu", (p.pp, p.dp, p.tp),
                                                                    mesh_dim_names=("pp", "dp", "tp"))
    stages = apply_pp(model, cfg, ctx.pp.rank) if p.pp > 1 else [(0, model)]
    for _, stage in stages:
        if p.tp > 1:
            apply_tp(stage, mesh["tp"])
        if p.dp > 1:
            apply_fsdp(stage, mesh["dp"], pipelined=p.pp > 1)
    params = [q for _, stage in stages for q in stage.parameters()]
    decay = [q for q in params if q.dim() > 1]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": [q for q in params if q.dim() == 1],
                                                       "weight_decay": 0.0}],
                                  lr=cfg.optimizer.lr, betas=cfg.optimizer.betas, eps=cfg.optimizer.eps,
                                  weight_decay=cfg.optimizer.weight_decay, foreach=True)
    microbatches = cfg.batch.global_ // cfg.batch.micro // p.dp

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    schedule = None
    if p.pp > 1:
        pipeline = [PipelineStage(stage, index, p.pp * p.vpp, torch.device("cpu"), group=mesh["pp"].get_group())
                    for index, stage in stages]
        schedule = ScheduleInterleaved1F1B(pipeline, microbatches, loss_fn=loss_fn)  # scales grads by 1/microbatches
        first, last = any(i == 0 for i, _ in stages), any(i == p.pp * p.vpp - 1 for i, _ in stages)
    source, losses, times = source_of(cfg, ctx), [], []
    for _ in range(steps):
        started = time.perf_counter()
        tokens, labels = source.next_batch()
        optimizer.zero_grad()
        if schedule is not None:
            step_losses: list[torch.Tensor] = []
            schedule.step(*([tokens] if first else []), target=labels if last else None, losses=step_losses)
            loss = torch.stack(step_losses).detach().mean() if last else None
        else:
            loss = torch.zeros(())
            for i, (x, y) in enumerate(zip(tokens.chunk(microbatches), labels.chunk(microbatches))):
                if p.dp > 1:
                    model.set_requires_gradient_sync(i == microbatches - 1)
                part = loss_fn(model(x), y) / microbatches
                part.backward()
                loss += part.detach()
        if cfg.optimizer.clip_grad:
            clip_grad_norm(params, cfg.optimizer.clip_grad, mesh["pp"].get_group() if p.pp > 1 else None)
        optimizer.step()
        times.append(time.perf_counter() - started)
        if loss is not None:
            losses.append(float(loss))
    return {"losses": losses or None, "step_times": times}
