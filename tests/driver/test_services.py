"""Stopping a service by a recorded pid: only while that pid is still the service (pids are reused)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from megascale.common.processes import pid_alive
from megascale.driver.services import JobHandle, stop_service


def test_stop_service_kills_only_a_process_still_serving_the_recorded_port():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--port", "46123"])
    try:
        deadline = time.monotonic() + 30
        while "46123" not in psutil.Process(proc.pid).cmdline():  # until exec: the fork still shows ours
            assert time.monotonic() < deadline
            time.sleep(0.05)
        stop_service(proc.pid, "51999")  # someone else's process now holds that pid
        assert proc.poll() is None and pid_alive(proc.pid)
        stop_service(proc.pid, "46123")
        assert proc.wait(timeout=10) is not None
        stop_service(proc.pid, "46123")  # gone already: nothing to do, no error
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_handle_whose_pids_now_belong_to_newer_processes_is_not_live():
    """After a reboot the recorded pids may name other processes: the job is over, not running."""
    born = psutil.Process(os.getpid()).create_time()
    mine = JobHandle(job="j", redis_url="redis://127.0.0.1:1", kafka="127.0.0.1:2", run_dir="/r", config_path="/c",
                     supervisor_pid=os.getpid(), started=time.time())
    assert mine.live()
    reused = JobHandle(job="j", redis_url="redis://127.0.0.1:1", kafka="127.0.0.1:2", run_dir="/r", config_path="/c",
                       supervisor_pid=os.getpid(), started=born - 100, driver_pid=os.getpid(), driver_started=born - 50)
    assert not reused.live()
