"""Stopping a service by a recorded pid: only while that pid is still the service (pids are reused)."""
from __future__ import annotations

import subprocess
import sys

from megascale.driver.services import pid_alive, stop_service


def test_stop_service_kills_only_a_process_still_serving_the_recorded_port():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--port", "46123"])
    try:
        stop_service(proc.pid, "51999")  # someone else's process now holds that pid
        assert proc.poll() is None and pid_alive(proc.pid)
        stop_service(proc.pid, "46123")
        assert proc.wait(timeout=10) is not None
        stop_service(proc.pid, "46123")  # gone already: nothing to do, no error
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
