"""Training data: `megascale data prepare` turns local text into token shards, and one
loader process per node streams shuffled, packed batches to that node's ranks through
shared memory.

Light on purpose: the node loader process imports this package, and must not pay for torch.
"""
from __future__ import annotations

from typing import Any


class DataError(ValueError):
    """Data that cannot be trained on; the message is one line naming the problem."""


def make_batch_source(data_cfg: Any, **kwargs: Any):
    """The BatchSource of one rank for `data.source` "text" or "shards"; see `source.make_batch_source`."""
    from megascale.data.source import make_batch_source as make

    return make(data_cfg, **kwargs)


__all__ = ["DataError", "make_batch_source"]
