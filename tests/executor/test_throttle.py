"""The slow-rank throttle (`megascale chaos slow-rank`): one process made `factor` times slower, its twin not."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
from megascale.executor.throttle import Throttle

# Counts units of the stand-in rank's work (driver/sim_rank.py: a sleep that stopped time does not count
# towards) done until a deadline.
WORKER = """
import sys, time
from megascale.driver.sim_rank import Work
work, end, done = Work(), time.monotonic() + float(sys.argv[1]), 0
while time.monotonic() < end:
    work(0.02)
    done += 1
print(done)
"""


@pytest.mark.parametrize("factor", [1.5, 3.0])
def test_throttle_slows_one_process_by_its_factor_and_leaves_it_running(factor):
    seconds = 3.0
    free, slowed = (subprocess.Popen([sys.executable, "-c", WORKER, str(seconds)], stdout=subprocess.PIPE, text=True)
                    for _ in range(2))
    throttle = Throttle(slowed.pid, factor, until=time.time() + 60).start()
    try:
        fast_units, slow_units = int(free.communicate(timeout=30)[0]), int(slowed.communicate(timeout=30)[0])
    finally:
        throttle.stop()
    # Both run for the same wall time, the throttled one from a moment later (its start-up is slowed too).
    assert factor * 0.8 < fast_units / slow_units < factor * 1.25, (fast_units, slow_units)
    assert throttle.stopped_s / throttle.elapsed_s == pytest.approx(1 - 1 / factor, abs=0.05)
    assert slowed.returncode == 0  # resumed at the end: never left stopped


def test_throttle_ends_at_its_deadline():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        throttle = Throttle(sleeper.pid, 2.0, until=time.time() + 0.5).start()
        time.sleep(1.0)
        assert not throttle.alive()
        with open(f"/proc/{sleeper.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] != "T"  # not left stopped
        with pytest.raises(ValueError, match="above 1"):
            Throttle(sleeper.pid, 1.0, until=time.time() + 1)
    finally:
        sleeper.kill()
        sleeper.wait()
