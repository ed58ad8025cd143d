"""What a checkpoint is made of: parts with `state_dict` / `load_state_dict` (the trainer's step, the
optimizer, the data source, the random streams), and the state the checkpointer treats specially: a
ZeRO shard's flat tensors, pieces of named parameters, which it reassembles for another layout.

Model chunks are not a part: under ZeRO their parameters are copies the optimizer all-gathers from
its fp32 master shard, which is the optimizer's state; saving them too would add a sixth (bf16) to a
third (fp32) to every checkpoint, only to be overwritten on restore.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Optional, Protocol

import numpy as np
import torch


class Stateful(Protocol):
    """A checkpoint part. `state_dict` values may be tensors, `ShardedFlat`s, and JSON values
    (dicts, lists, strings, numbers) nested in dicts and lists. A rank restores everything but
    ShardedFlats from one old shard: its own, or after a layout change the one reshard.slice_sources
    names (so per-rank state such as random streams continues some old rank's)."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Split:
    """How tensor parallelism cut a parameter: into `parts` slices along `dim`. A fused weight (q|k|v,
    with GQA's fewer k/v rows; SwiGLU's gate|up; stacked along dim 0) has `sections`, the full sizes of
    its sub-matrices, each cut separately: what restoring onto another tp needs to map it."""

    dim: int
    parts: int
    sections: Optional[tuple[int, ...]] = None


@dataclass(frozen=True)
class ParamLayout:
    """A parameter as the model defines it (`shape`) and how this job's TP cut it (None: replicated)."""

    shape: tuple[int, ...]
    split: Optional[Split] = None

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "split": asdict(self.split) if self.split else None}


@dataclass
class ShardedFlat:
    """Flat tensors of equal length holding pieces of named parameters: a ZeRO shard's master weights
    and moments. A piece (name, start, length, offset) is elements start..start+length of parameter
    `name` (flattened, as this TP rank holds it) at offset.. of every tensor. Pieces are mapped by
    name and range through each parameter's full shape and TP split on restore, so the old shards
    may have been cut for another tp / pp / vpp / dp."""

    tensors: dict[str, torch.Tensor]
    pieces: list[tuple[str, int, int, int]]
    params: dict[str, ParamLayout]

    @property
    def numel(self) -> int:
        return sum(length for _, _, length, _ in self.pieces)


class RngState:
    """This process's random streams: torch (and CUDA on a GPU), Python and NumPy. After a layout
    change a rank continues the streams of the old rank reshard.slice_sources assigns it."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        version, keys, gauss = random.getstate()
        name, mt, pos, has_gauss, cached = np.random.get_state()
        state = {"torch": torch.get_rng_state(), "python": [version, list(keys), gauss],
                 "numpy": [name, mt.tolist(), int(pos), int(has_gauss), float(cached)]}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)
        version, keys, gauss = state["python"]
        random.setstate((version, tuple(keys), gauss))
        name, mt, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(mt, dtype=np.uint32), pos, has_gauss, cached))
