"""Save planning: where each tensor of a rank's parts goes in its shard image, decided once from the
parts' state dicts, and the snapshot that follows the plan (phase 1, on the training critical path).

A part's state becomes JSON with each tensor replaced by {"$tensor": entry} and each ShardedFlat by
{"$sharded": {"id", "tensors": {key: entry}, "pieces"}}; the tensors' bytes follow the header in
the plan's order. Restore planning reads the same structure back.
"""
from __future__ import annotations

from typing import Any, Collection, Mapping

import torch

from megascale.checkpoint.shard_format import Entry, header_json, header_room, lay_out, pad_header
from megascale.checkpoint.stateful import ShardedFlat, Stateful
from megascale.checkpoint.storage import CheckpointError, CorruptShard

TENSOR, SHARDED = "$tensor", "$sharded"


def flatten(states: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, ShardedFlat], dict]:
    """(tensors by entry name, ShardedFlats by id, the states as JSON with markers in their places).
    An entry name or id is the path to the value, dot-joined."""
    tensors: dict[str, torch.Tensor] = {}
    sharded: dict[str, ShardedFlat] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors[path] = value
            return {TENSOR: path}
        if isinstance(value, ShardedFlat):
            sharded[path] = value
            names = {key: f"{path}.{key}" for key in value.tensors}
            tensors.update({names[key]: t for key, t in value.tensors.items()})
            # Its parameters' full shapes and splits are the manifest's (`tensor_table`), not every shard's.
            return {SHARDED: {"id": path, "tensors": names, "pieces": [list(p) for p in value.pieces]}}
        if isinstance(value, dict):
            return {str(k): walk(v, f"{path}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(value)]
        return value

    tree = {name: walk(state, name) for name, state in states.items()}
    return tensors, sharded, tree


def check_header(meta: Any, names: Collection[str]) -> None:
    """CorruptShard unless `meta` (a shard header's metadata) holds the parts tree as `flatten` writes
    it, each marker naming tensors among `names` (the shard's): a header whose checksum matches can
    still be malformed (written by a bug, or by hand), and restore must fall back, not fail midway."""
    if not isinstance(meta, dict) or not isinstance(meta.get("parts"), dict):
        raise CorruptShard("the shard header holds no parts")
    stack = [meta["parts"]]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        if not isinstance(node, dict):
            continue
        if TENSOR in node and node[TENSOR] not in names:
            raise CorruptShard(f"the shard header names tensor {node[TENSOR]!r} but holds none")
        if SHARDED in node:
            entry = node[SHARDED]
            if not (isinstance(entry, dict) and isinstance(entry.get("id"), str)
                    and isinstance(entry.get("tensors"), dict) and isinstance(entry.get("pieces"), list)
                    and all(isinstance(v, str) and v in names for v in entry["tensors"].values())
                    and all(_is_piece(p) for p in entry["pieces"])):
                raise CorruptShard(f"malformed {SHARDED} entry in the shard header: {str(entry)[:80]}")
        else:
            stack.extend(node.values())


def _is_piece(piece: Any) -> bool:
    """[parameter name, start, length, offset], as ShardedFlat.pieces."""
    return (isinstance(piece, list) and len(piece) == 4 and isinstance(piece[0], str)
            and all(isinstance(n, int) and n >= 0 for n in piece[1:]))


def tensor_table(stages: list[dict]) -> dict:
    """The manifest's record of every ShardedFlat parameter: full shape, TP split, and the pipeline
    ranks holding it; `stages`: each stage's {"pp": rank, "params": SavePlan.sharded_params()}."""
    table: dict = {}
    for stage in stages:
        for sid, params in stage["params"].items():
            for name, layout in params.items():
                table.setdefault(sid, {}).setdefault(name, {**layout, "pp": []})["pp"].append(stage["pp"])
    return table


class SavePlan:
    """The fixed layout of this rank's shard image: a header room, then every tensor's bytes."""

    def __init__(self, parts: Mapping[str, Stateful], meta: dict):
        """`meta`: what every header carries besides the parts' state (sizes the header room)."""
        self.parts = parts
        tensors, self.sharded, tree = flatten(self.states())
        self.entries: list[Entry] = lay_out(tensors)
        self.data_bytes = self.entries[-1].end if self.entries else 0
        self.tree = tree  # the parts' structure, which restore fills
        self.room = header_room(self._header_json(tree, meta))

    @property
    def size(self) -> int:
        return self.room + self.data_bytes

    def states(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def sharded_params(self) -> dict[str, dict]:
        """Each ShardedFlat's parameters as the manifest records them (full shape and TP split)."""
        return {sid: {name: layout.to_json() for name, layout in flat.params.items()}
                for sid, flat in self.sharded.items()}

    def capture(self, meta: dict) -> tuple[bytes, dict[str, torch.Tensor]]:
        """(header bytes, tensors) of the parts' state now; grows the room if the header outgrew it
        (the caller then needs a larger buffer: `size` changed)."""
        tensors, _, tree = flatten(self.states())
        found = {(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()}
        changed = sorted({name for name, *_ in found ^ {(e.name, e.dtype, e.shape) for e in self.entries}})
        if changed:
            raise CheckpointError(f"checkpoint tensor {changed[0]} changed shape or dtype since the job started")
        raw = self._header_json(tree, meta)
        header = pad_header(raw, self.room)
        if header is None:
            self.room = header_room(raw)
            header = pad_header(raw, self.room)
        return header, tensors

    def _header_json(self, tree: dict, meta: dict) -> bytes:
        try:
            return header_json(self.entries, {**meta, "parts": tree})
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint state is not JSON-serialisable: {e}") from None

    def write(self, image: torch.Tensor, header: bytes, tensors: dict[str, torch.Tensor],
              device: torch.device) -> None:
        """Copies header and tensors into `image` (uint8, `size` bytes); device copies run as DMA and are
        finished on return (the keeper must see finished bytes)."""
        image[:self.room].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        data, cuda = image[self.room:], device.type == "cuda"
        for e in self.entries:
            data[e.begin:e.end].view(e.dtype).view(e.shape).copy_(tensors[e.name], non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(device)
