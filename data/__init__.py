"""Training data: `megascale data prepare` turns local text into token shards, and one loader
process per node streams shuffled, packed batches to that node's ranks through shared memory.

    from megascale.data import make_batch_source, DataError

Light on purpose: the node loader process imports this package and must not pay for torch, so
the torch-side names (make_batch_source, Batch, ShardBatchSource) load on first use.
"""
from __future__ import annotations


class DataError(ValueError):
    """Data that cannot be trained on; the message is one line naming the problem."""


_LAZY = ("make_batch_source", "Batch", "ShardBatchSource")


def __getattr__(name: str):
    if name in _LAZY:
        from megascale.data import source

        return getattr(source, name)
    raise AttributeError(f"module 'megascale.data' has no attribute {name!r}")


__all__ = ["Batch", "DataError", "ShardBatchSource", "make_batch_source"]
