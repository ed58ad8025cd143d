"""A decoder-only transformer for one device, of two families (`model.arch`):

- gpt: LayerNorm and a GeLU MLP;
- llama: RMSNorm and a SwiGLU MLP (the math of transformers' LlamaForCausalLM, or
  MistralForCausalLM with a window).

Both: rotary positions, grouped-query attention when `kv_heads` < `heads`, no linear biases,
serial or parallel (PTB) blocks, full or sliding-window causal attention (optionally kept inside
the documents packed into a row), optional tied embeddings.

It knows nothing of parallelism. `megascale.parallel.parallelize` shards it by
swapping modules (TorchTitan style); the seams it relies on are only names:
`attn.qkv`, `attn.core`, `attn.proj`, `mlp.fc`, `mlp.act`, `mlp.proj`, `wte`, `lm_head`, `criterion`,
a parallel block's `fan_out` / `merge`, and the `sections` of a `FusedLinear`. Built under
`torch.device("meta")` it allocates nothing; each parameter's initial value depends only on the
seed and its name (`init_value`), so a rank can create just the parameters, and slices, it owns.
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from megascale.config import ModelConfig
from megascale.kernels import DocumentMask, LayerNorm, RMSNorm, attention, gelu


def rotary_tables(seq: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    # On the CPU explicitly: a model built on the meta device still needs real tables.
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float64, device="cpu"), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates pairs (x[..., :d/2], x[..., d/2:]) of `[batch, heads, seq, head_dim]` by position."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class FusedLinear(nn.Linear):
    """Projections of one input stacked in one weight (q|k|v, gate|up), computed by one GEMM.
    `sections` are their output widths: whatever splits the weight splits each section alike."""

    def __init__(self, in_features: int, sections: tuple[int, ...]):
        super().__init__(in_features, sum(sections), bias=False)
        self.sections = sections


class CoreAttention(nn.Module):
    """softmax(QK^T / sqrt(d)) V under the causal (sliding-window, document) mask; no parameters.
    A module of its own so it can be recomputed in backward (`train.recompute: selective`)."""

    def __init__(self, window: int | None):
        super().__init__()
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: DocumentMask | None = None) -> torch.Tensor:
        return attention(q, k, v, self.window, documents)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.hidden // cfg.heads
        self.heads, self.kv_heads = cfg.heads, cfg.num_kv_heads
        self.core = CoreAttention(cfg.window)
        kv_width = self.kv_heads * self.head_dim
        self.qkv = FusedLinear(cfg.hidden, (cfg.hidden, kv_width, kv_width))
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.resid_drop = nn.Dropout(cfg.dropout)
        cos, sin = rotary_tables(cfg.seq, self.head_dim, cfg.rotary_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, documents: DocumentMask | None = None) -> torch.Tensor:
        qkv = self.qkv(x)
        # Heads are read off the projection's width, so a TP shard (which holds the same
        # share of q and of k/v heads) just has fewer of them.
        batch, seq, width = qkv.shape
        kv_width = width * self.kv_heads // (self.heads + 2 * self.kv_heads)
        q, k, v = qkv.split([width - 2 * kv_width, kv_width, kv_width], dim=-1)
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)
        y = self.core(q, k, v, documents).transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_drop(self.proj(y))


class GeLU(nn.Module):
    """GPT's MLP activation. This and `SwiGLUGate` are modules so that `train.recompute: selective` can
    find them (the 4h-wide activation it recomputes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu(x)


class SwiGLUGate(nn.Module):
    """SiLU(gate) * up, of gate|up side by side in the last dimension."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class MLP(nn.Module):
    """GPT's MLP: proj(GeLU(fc(x)))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc, self.act = nn.Linear(cfg.hidden, cfg.ffn, bias=False), GeLU()
        self.proj = nn.Linear(cfg.ffn, cfg.hidden, bias=False)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resid_drop(self.proj(self.act(self.fc(x))))


class SwiGLU(nn.Module):
    """Llama's MLP: proj(SiLU(gate(x)) * up(x)), gate and up fused in `fc`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc, self.act = FusedLinear(cfg.hidden, (cfg.ffn, cfg.ffn)), SwiGLUGate()
        self.proj = nn.Linear(cfg.ffn, cfg.hidden, bias=False)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resid_drop(self.proj(self.act(self.fc(x))))


# What `model.arch` chooses: the norm and the MLP.
NORM = {"gpt": LayerNorm, "llama": RMSNorm}
FEED_FORWARD = {"gpt": MLP, "llama": SwiGLU}


def norm(cfg: ModelConfig) -> nn.Module:
    return NORM[cfg.arch](cfg.hidden, eps=cfg.norm_eps)


class SerialBlock(nn.Module):
    """x + Attn(LN(x)), then + MLP(LN(·))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1, self.attn = norm(cfg), Attention(cfg)
        self.ln_2, self.mlp = norm(cfg), FEED_FORWARD[cfg.arch](cfg)

    def forward(self, x: torch.Tensor, documents: DocumentMask | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), documents)
        return x + self.mlp(self.ln_2(x))


class ParallelBlock(nn.Module):
    """PTB: y = x + Attn(LN(x)) + MLP(LN(x)); both branches read one norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln = norm(cfg)
        self.attn, self.mlp = Attention(cfg), FEED_FORWARD[cfg.arch](cfg)
        # Identities on one device. Under TP both branches enter the TP region through
        # one `fan_out` and their partial sums are combined by one `merge`: half the
        # communication of a serial block.
        self.fan_out, self.merge = nn.Identity(), nn.Identity()

    def forward(self, x: torch.Tensor, documents: DocumentMask | None = None) -> torch.Tensor:
        h = self.fan_out(self.ln(x))
        return x + self.merge(self.attn(h, documents) + self.mlp(h))


class CrossEntropy(nn.Module):
    """Mean token loss; labels of -100 are ignored."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        block = ParallelBlock if cfg.block == "parallel" else SerialBlock
        # Its own weight: nn.Embedding's initialisation (normal_) on the meta device imports torch._dynamo, seconds
        # in every new rank process; reset_parameters below initialises every parameter anyway.
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden, _weight=torch.empty(cfg.vocab, cfg.hidden))
        self.drop = nn.Dropout(cfg.dropout)
        # Keyed by global layer index, so parameter names survive pipeline splits.
        self.blocks = nn.ModuleDict({str(i): block(cfg) for i in range(cfg.layers)})
        self.ln_f = norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.criterion = CrossEntropy()
        if cfg.tied_embeddings:
            self.lm_head.weight = self.wte.weight
        if not self.wte.weight.is_meta:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            p.copy_(self.init_value(name, p.shape))

    def init_value(self, name: str, shape: torch.Size) -> torch.Tensor:
        """Parameter `name`'s initial value (fp32, CPU), from the seed and the name alone."""
        if self.cfg.tied_embeddings and name == "lm_head.weight":
            name = "wte.weight"  # a pipeline's last stage holds its own copy of the tied embedding
        if len(shape) == 1:
            return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
        # GPT-2: residual projections scaled down by depth so the stream's variance stays flat.
        std = self.cfg.init_std / math.sqrt(2 * self.cfg.layers) if name.endswith("proj.weight") else self.cfg.init_std
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=gen) * std

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        # A pipeline stage deletes the parts it does not own (sets them to None), so
        # each part is optional: tokens or hidden states in, hidden states, logits or loss out.
        # `document_ids` [batch, seq] (equal = same document) keep attention inside documents.
        documents = None if document_ids is None else DocumentMask(document_ids)
        if self.wte is not None:
            x = self.drop(self.wte(x))
        for block in self.blocks.values():
            x = block(x, documents)
        if self.lm_head is None:
            return x
        logits = self.lm_head(self.ln_f(x))
        return logits if labels is None else self.criterion(logits, labels)

    def num_flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward = 3x forward), attention included."""
        c = self.cfg
        kv_width = c.num_kv_heads * (c.hidden // c.heads)
        attn_weights = 2 * c.hidden * c.hidden + 2 * c.hidden * kv_width  # q and proj; k and v
        mlp_weights = (3 if c.arch == "llama" else 2) * c.hidden * c.ffn  # SwiGLU: gate, up, proj
        dense = 2 * (attn_weights + mlp_weights) * c.layers + 2 * c.hidden * c.vocab
        span = min(c.window or c.seq, c.seq)
        attn = 2 * 2 * c.layers * c.hidden * span  # QK^T and AV, ~span keys per query
        return 3 * (dense + attn)
