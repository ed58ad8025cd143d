"""Reading the `timings` records on `<job>.metrics`: StepTimings dicts batched by node.

The message itself is `megascale.common.messages.Timings` (the one schema module the driver and the
executors share); this module adds what only the metrics side needs: which records are usable,
and the canonical segment names.
"""
from __future__ import annotations

from typing import Optional

from megascale.common.messages import MessageError, Timings, WrongKind, valid_timings
from megascale.common.messages import decode as decode_message
from megascale.common.messages import encode as encode_message

# megascale.timers.SEGMENTS, spelled out: the driver and the dashboard must not import torch
# just to name them (a test keeps the two equal).
SEGMENTS = ("data", "forward", "backward", "optimizer", "comm_tp", "comm_pp", "comm_dp",
            "exposed_tp", "exposed_pp", "exposed_dp")


class RecordError(ValueError):
    """A record that is not a valid timings batch; the text says why, in one line."""


def encode(batch: Timings) -> bytes:
    return encode_message(batch)


def decode(raw: bytes | str) -> Optional[Timings]:
    """The batch in `raw`, less unusable records; None for another kind on the same topic (a `metric`)."""
    try:
        batch = decode_message(raw, expect=Timings)
    except WrongKind:
        return None
    except MessageError as e:
        raise RecordError(str(e)) from None
    batch.records = [r for r in batch.records if valid_timings(r)]
    return batch  # type: ignore[return-value]


def segment_names(records: list[dict]) -> list[str]:
    """The timer segments in canonical order, then any others the records carry."""
    extra = sorted({name for r in records for name in r["segments"]} - set(SEGMENTS))
    return list(SEGMENTS) + extra
