"""Hugging Face weights into megascale, at any layout: `check_hf_dir` (before any rank starts: the
directory fits the job's `model` section), `load_hf_weights` (a rank's share into its optimizer's
fp32 master weights, then its parameters), and `import_rank` (`megascale import`: a step-0
checkpoint at the job's layout, which the job resumes from).

A rank reads only the tensors of its own pipeline stage (safetensors maps files; nothing else loads).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open

from megascale.checkpoint.stateful import ParamLayout, ShardedFlat
from megascale.config import ConfigError, JobConfig, ModelConfig
from megascale.interop.hf import (
    IGNORED_SUFFIXES, Rule, check_fits, from_hf, fused_sections, neox_bias_shape, rules,
)
from megascale.parallel.tensor_parallel import shard_in_features, shard_out_features
from megascale.parallel.topology import Group, ParallelContext

INIT_PREFIX = "hf:"  # checkpoint.init_from: hf:DIR
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
OUTPUT_EMBEDDINGS = ("lm_head.weight", "embed_out.weight")


def hf_dir_of(init_from: str) -> Path:
    """DIR of `checkpoint.init_from: hf:DIR` (the prefix is checked by config.validate)."""
    return Path(init_from.removeprefix(INIT_PREFIX)).expanduser()


class HFDirectory:
    """A transformers `save_pretrained` directory: config.json and safetensors weights, in one file or
    in shards listed by model.safetensors.index.json."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.where = f"{self.path}/config.json"
        try:
            self.config = json.loads((self.path / "config.json").read_text())
        except FileNotFoundError:
            raise ConfigError(f"{self.path}: no config.json (not a transformers save_pretrained directory)") from None
        except ValueError as e:
            raise ConfigError(f"{self.where}: not valid JSON ({e})") from None
        try:
            if (self.path / INDEX).is_file():
                self.files = {name: self.path / file for name, file in
                              json.loads((self.path / INDEX).read_text())["weight_map"].items()}
            elif (self.path / SINGLE).is_file():
                with safe_open(self.path / SINGLE, framework="pt") as f:
                    self.files = {name: self.path / SINGLE for name in f.keys()}
            else:
                raise ConfigError(f"{self.path}: no {SINGLE} or {INDEX} (only safetensors weights are read)")
        except (ValueError, KeyError, SafetensorError) as e:
            raise ConfigError(f"{self.path}: unreadable weights ({type(e).__name__}: {e})") from None

    def _tensor(self, name: str, shape_only: bool):
        if name not in self.files:
            raise ConfigError(f"{self.path} holds no tensor {name}")
        try:
            with safe_open(self.files[name], framework="pt") as f:
                return tuple(f.get_slice(name).get_shape()) if shape_only else f.get_tensor(name).float()
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{self.files[name]}: cannot read {name} ({e})") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensor(name, shape_only=True)

    def read(self, name: str) -> torch.Tensor:
        return self._tensor(name, shape_only=False)


def _expected_shapes(m: ModelConfig, rule: Rule, ours: dict[str, tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The shape each of `rule.theirs` must have for the job's model."""
    if rule.kind == "zero":
        return [neox_bias_shape(m, rule.theirs[0])]
    shape = ours[rule.ours]
    if rule.kind == "fused":
        return [(rows, *shape[1:]) for rows in fused_sections(m, rule.ours)]
    return [shape] * len(rule.theirs)


def check_hf_dir(m: ModelConfig, path: str | Path) -> None:
    """ConfigError (one line naming the field) unless `path` holds a transformers model megascale computes
    exactly with the `model` section `m`: its config, every tensor's shape, zero biases, a PTB's norms."""
    from megascale.model.gpt import GPT

    hf = HFDirectory(path)
    check_fits(m, hf.config, hf.where)
    with torch.device("meta"):
        ours = {name: tuple(t.shape) for name, t in GPT(m).state_dict().items()}
    expected: set[str] = set()
    for rule in rules(m):
        for name, shape in zip(rule.theirs, _expected_shapes(m, rule, ours)):
            if hf.shape(name) != shape:
                raise ConfigError(f"{hf.path} {name} has shape {list(hf.shape(name))} but the job's model section "
                                  f"needs {list(shape)}")
        if rule.kind in ("zero", "shared"):  # small tensors, all read here rather than by every rank
            from_hf(m, rule, hf.read, str(hf.path))
        expected.update(rule.theirs)
    # Some saves of a tied model keep the output embedding too; transformers ignores it when tying.
    ignored = IGNORED_SUFFIXES + (OUTPUT_EMBEDDINGS if m.tied_embeddings else ())
    unknown = sorted(name for name in set(hf.files) - expected if not name.endswith(ignored))
    if unknown:
        raise ConfigError(f"{hf.path} holds {unknown[0]}, which megascale's model.arch={m.arch} has no place for")


def _tp_slice(full: torch.Tensor, layout: ParamLayout, tp: Group) -> torch.Tensor:
    """This TP rank's slice of a full weight, cut as tensor parallelism cut the parameter."""
    if layout.split is None:
        return full
    if layout.split.dim == 0:
        return shard_out_features(full, tp, layout.split.sections).detach()
    return shard_in_features(full, tp).detach()


@torch.no_grad()
def load_hf_weights(optimizer, ctx: ParallelContext, m: ModelConfig, path: str | Path) -> None:
    """Sets this rank's weights to the transformers model's in `path` (checked by `check_hf_dir`), through
    the optimizer's own state: fp32 master weights from the file, zero moments, step 0."""
    hf = HFDirectory(path)
    by_name = {rule.ours: rule for rule in rules(m) if rule.ours}
    flat: ShardedFlat = optimizer.state_dict()["shard"]
    tensors = {key: torch.zeros_like(t) for key, t in flat.tensors.items()}
    for name, start, length, at in flat.pieces:
        # A tied embedding's copy on the last pipeline stage is the input embedding.
        rule = by_name[name] if name in by_name else by_name["wte.weight"]
        full = from_hf(m, rule, hf.read, str(hf.path))
        local = _tp_slice(full, flat.params[name], ctx.tp).reshape(-1)
        tensors["master"][at:at + length] = local[start:start + length].to(tensors["master"].device)
    optimizer.load_state_dict({"step": 0, "shard": ShardedFlat(tensors, flat.pieces, flat.params)})


def import_rank(ctx: ParallelContext, cfg: JobConfig) -> Optional[int]:
    """One rank of `megascale import`: the job's training state at step 0 with the weights of
    checkpoint.init_from, saved as a checkpoint at checkpoint.uri; returns the committed step."""
    from megascale.checkpoint import Checkpointer
    from megascale.train import Trainer, checkpoint_parts

    trainer = Trainer(cfg, ctx)
    checkpointer = Checkpointer(cfg, ctx, checkpoint_parts(trainer))
    try:
        load_hf_weights(trainer.optimizer, ctx, cfg.model, hf_dir_of(cfg.checkpoint.init_from))
        checkpointer.save(0)
        return checkpointer.flush()
    finally:
        checkpointer.close()
        trainer.close()


def checked_init_from(cfg: JobConfig) -> JobConfig:
    """`cfg` with checkpoint.init_from's directory absolute (ranks may start elsewhere), once it fits the
    job's `model` section (preflight: a mismatch is one line before any rank starts)."""
    path = hf_dir_of(cfg.checkpoint.init_from).resolve()
    if not path.is_dir():
        raise ConfigError(f"checkpoint.init_from={cfg.checkpoint.init_from}: no such directory")
    check_hf_dir(cfg.model, path)
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, init_from=f"{INIT_PREFIX}{path}"))
