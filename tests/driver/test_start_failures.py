"""A node that cannot start fails the job at once, saying why, instead of after control.start_timeout_s of silence."""
from __future__ import annotations

import re
import subprocess
import sys
import time

from control_plane_support import job_yaml
from megascale.driver.services import JobHandle


def test_an_executor_refusing_its_environment_fails_the_job_at_once_with_its_own_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASCALE_RANK_MALLOC", "tcmalloc")  # every executor inherits it and stops at start
    config = job_yaml(tmp_path, "badnode", steps=5)  # control.start_timeout_s: 90
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "megascale.cli", "run", config, "--quiet"], capture_output=True,
                         text=True, timeout=120)
    took = time.monotonic() - started
    final = JobHandle.load("badnode").final
    assert run.returncode == 1 and final["state"] == "Failed", (run.returncode, final, run.stderr[-2000:])
    assert re.fullmatch(r"node n\d's executor exited with code 2 before it reported: MEGASCALE_RANK_MALLOC="
                        r"'tcmalloc': must be one of jemalloc, system \(see .*/nodes/n\d/executor.log\)",
                        final["reason"]), final["reason"]
    shown = "".join(run.stdout.split())  # the display wraps long lines at the terminal's width
    assert "".join(final["reason"].split()) in shown and "Traceback" not in run.stdout + run.stderr
    assert took < 45, f"took {took:.0f} s: waited for the start timeout"
