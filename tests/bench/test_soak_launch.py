"""A soak killed while it launches its job (SIGTERM, as `timeout` or a CI runner sends) still stops that job:
cut short, the launch used to be killed after starting the job's supervisor, which then trained on alone."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

# A child that enters the soak's launched_job on a tiny job, with `megascale bench`'s SIGTERM handling.
LAUNCH_THEN_WAIT = """
import random, signal, sys, time
from pathlib import Path
import megascale.bench.soak as soak

signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
soak.job_config = lambda root, steps: {
    "name": soak.JOB, "model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
    "parallelism": {"dp": 2}, "batch": {"micro": 1, "global": 2}, "cluster": {"nodes": 1},
    "train": {"steps": steps, "run_dir": str(root / "runs")}}
with soak.launched_job(Path(sys.argv[1]), random.Random(0), "test"):
    time.sleep(600)
"""


def _job_processes(root: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(root in part for part in p.info["cmdline"] or ()):
            found.append(p)
    return found


@pytest.mark.slow
def test_a_soak_killed_during_its_launch_stops_the_job_it_started(tmp_path):
    root = str(tmp_path / "soak")
    os.mkdir(root)
    bench = subprocess.Popen([sys.executable, "-c", LAUNCH_THEN_WAIT, root], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any("megascale.driver.supervisor" in p.info["cmdline"] for p in _job_processes(root)):
            assert time.monotonic() < deadline and bench.poll() is None, bench.stdout.read() if bench.poll() else ""
            time.sleep(0.05)
        launching = [p for p in psutil.Process(bench.pid).children() if "launch" in p.cmdline()]
        assert launching, "the supervisor came up after the launch had returned: nothing was cut short"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=180) == 143
        time.sleep(1)
        assert [p.cmdline() for p in _job_processes(root)] == []
    finally:
        if bench.poll() is None:
            bench.kill()
        if _job_processes(root):  # failed: stop the job and its services the way a user would
            subprocess.run([sys.executable, "-m", "megascale.cli", "stop", "bench-soak"], capture_output=True,
                           env={**os.environ, "MEGASCALE_HOME": os.path.join(root, "home")}, timeout=150)
