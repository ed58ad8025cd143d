"""Fault recovery (MegaScale §4-§6), used by the driver's reconcile loop:

- detection.py: faults (and success) from heartbeats, node liveness, stragglers; hang.py: the hang clock
- localization.py: which rank a hang waits for, from the flight recorders
- selfcheck.py: the suspects and their group peers run the diagnostics suite
- policy.py: restart, pause or give up, and which nodes to evict for spares
- shrink.py: the dp and nodes of the next incarnation when nodes are short (control.no_spare)
- timings.py: each recovery's MTTR phases, and ETTR
- recoverer.py: a recovery step by step, each step awaited through the job record

The recovery record itself (Fault, Recovery) is part of the job record: driver/recovery_record.py, driver/state.py.
"""
from . import shrink, timings
from .detection import Liveness, StragglerWatch, all_succeeded
from .hang import HangClock, checkpoint_waits, progress
from .localization import HangReport, localize_hang
from .recoverer import Recoverer

__all__ = ["HangClock", "HangReport", "Liveness", "Recoverer", "StragglerWatch", "all_succeeded",
           "checkpoint_waits", "localize_hang", "progress", "shrink", "timings"]
