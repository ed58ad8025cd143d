"""Two-phase checkpointing of stateful parts (state_dict / load_state_dict): host-memory snapshots on
the critical path, persisted by a per-node keeper process, committed by a manifest; restore from
host memory or one reader per DP group.

Exports load lazily: the keeper process imports this package and must not pay for torch.
"""
from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Checkpointer": "megascale.checkpoint.checkpointer",
    "RngState": "megascale.checkpoint.stateful",
    "Stateful": "megascale.checkpoint.stateful",
    "CheckpointError": "megascale.checkpoint.storage",
    "CorruptShard": "megascale.checkpoint.storage",
    "OtherFormat": "megascale.checkpoint.storage",
    "StorageUnreadable": "megascale.checkpoint.storage",
    "check_checkpoint_uri": "megascale.checkpoint.storage",
    "committed_steps": "megascale.checkpoint.storage",
    "open_storage": "megascale.checkpoint.storage",
    "shutdown_keeper": "megascale.checkpoint.client",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megascale.checkpoint' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = list(_EXPORTS)
