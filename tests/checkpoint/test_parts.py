"""Save and restore planning without ranks: parts' state dicts through a shard image and back."""
from __future__ import annotations

import random

import numpy as np
import torch

from megascale.checkpoint import RngState
from megascale.checkpoint.host_buffer import HostBuffer
from megascale.checkpoint.reshard import Sources
from megascale.checkpoint.restore_plan import Assembly
from megascale.checkpoint.save_plan import SavePlan
from megascale.checkpoint.shard_format import read_shard
from megascale.checkpoint.stateful import ParamLayout, ShardedFlat, Split


class Shard:
    """A ZeRO-like part: two parameters, of which this rank holds [a[2:6], b[0:3]] in flat tensors."""

    def __init__(self, fill: float):
        self.master = torch.full((7,), fill)
        self.step = 0
        self.loaded = None

    def state_dict(self) -> dict:
        pieces = [("a", 2, 4, 0), ("b", 0, 3, 4)]
        params = {"a": ParamLayout((8,)), "b": ParamLayout((2, 3), Split(dim=1, parts=2))}
        return {"step": self.step, "shard": ShardedFlat({"master": self.master}, pieces, params),
                "note": ["text", {"nested": torch.arange(3)}]}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


def image_of(plan: SavePlan, step: int) -> HostBuffer:
    buffer = HostBuffer(plan.size)
    header, tensors = plan.capture({"step": step, "key": "pp0-tp0-dp0", "coords": [0, 0, 0]})
    plan.write(buffer.bytes, header, tensors, torch.device("cpu"))
    return buffer


def assembly_of(plan: SavePlan) -> Assembly:
    """Restoring the one shard pp0-tp0-dp0 onto the layout it was saved from."""
    manifest = {"tensors": {sid: {name: {**layout.to_json(), "pp": [0]} for name, layout in flat.params.items()}
                            for sid, flat in plan.sharded.items()}, "config": {"model": {}}}
    return Assembly(plan, manifest, Sources([(0, 0, 0)], own=0, same_cut=True), tp_rank=0)


def test_part_states_round_trip_through_a_shard_image():
    saved = Shard(fill=0.0)
    saved.master.copy_(torch.arange(7.0))
    saved.step = 5
    image = image_of(SavePlan({"opt": saved}, {"step": 0, "key": "pp0-tp0-dp0"}), step=5)
    meta, tensors = read_shard(image.fd)
    target = Shard(fill=-1.0)
    assembly = assembly_of(SavePlan({"opt": target}, {}))
    assembly.add(0, 5, meta, tensors)
    image.close()
    assert assembly.uncovered() is None
    state = assembly.states()["opt"]
    assert state["step"] == 5 and state["note"][0] == "text"
    assert torch.equal(state["note"][1]["nested"], torch.arange(3))
    assert torch.equal(state["shard"].tensors["master"], torch.arange(7.0))
    assert state["shard"].pieces == target.state_dict()["shard"].pieces  # cut as the target's


def test_random_streams_continue_exactly():
    rng = RngState(torch.device("cpu"))
    plan = SavePlan({"rng": rng}, {})
    image = image_of(plan, step=1)
    draws = (torch.rand(3), random.random(), np.random.rand())
    meta, tensors = read_shard(image.fd)
    image.close()
    own = assembly_of(plan)
    own.add(0, 1, meta, tensors)
    rng.load_state_dict(own.states()["rng"])
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(draws[0], again[0]) and draws[1:] == again[1:]
