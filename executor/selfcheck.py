"""This node's self-check (the driver's `diagnose` command): `megascale diagnose` on the node, in a process of its
own (diagnostics/worker.py), so a check stuck on a broken device is killed at its deadline and the executor lives
on. The process may be started early (`spawn`, as a recovery stops the ranks), its imports done when asked.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# Past the suite's own budget: its process start and torch import, and the report.
GRACE_S = 30.0


@dataclass
class Worker:
    """A diagnostics worker process and the file its report goes to (its own: an older check may still write)."""
    proc: subprocess.Popen
    report: Path

    def close(self) -> None:
        """Ends it unused (the executor exits)."""
        self.proc.kill()
        self.proc.wait()
        self.report.unlink(missing_ok=True)


def spawn(work_dir: Path) -> Worker:
    """A diagnostics worker, loading; it waits for its request on stdin."""
    fd, report = tempfile.mkstemp(prefix="diagnose-", suffix=".json", dir=work_dir)
    with os.fdopen(fd, "w") as out, open(work_dir / "diagnose.log", "a") as err:
        proc = subprocess.Popen([sys.executable, "-m", "megascale.diagnostics.worker", str(os.getpid())],
                                stdin=subprocess.PIPE, stdout=out, stderr=err, text=True)
    return Worker(proc, Path(report))


class SelfCheck:
    """One run of the suite, in `worker` if it is still alive (else a new one); `result()` is None until it
    ended (or was killed at its deadline)."""

    def __init__(self, node: str, work_dir: Path, args: dict, worker: Optional[Worker] = None):
        self.budget_s = float(args.get("budget_s", 60))
        argv = ["diagnose", "--nodes", node, "--json", "--budget-s", str(self.budget_s)]
        if args.get("checks"):
            argv += ["--checks", ",".join(args["checks"])]
        if args.get("ranks_per_node"):
            argv += ["--ranks-per-node", str(args["ranks_per_node"])]
        # Injected faults (chaos tests) reach the suite only where this node allows them.
        if os.environ.get("MEGASCALE_DIAG_ALLOW_FAULTS") == "1":
            for key, value in (args.get("inject") or {}).items():
                argv += ["--inject", f"{node}:{key}={value}"]
        worker = worker if worker is not None and worker.proc.poll() is None else spawn(work_dir)
        self.proc, self.out_path, self.log_path = worker.proc, worker.report, work_dir / "diagnose.log"
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.close()
        self.deadline = time.monotonic() + self.budget_s + GRACE_S
        self._result: Optional[tuple[bool, str]] = None

    def result(self) -> Optional[tuple[bool, str]]:
        """(passed, the JSON report or why the suite could not run) once it ended; None while it runs."""
        if self._result is None and (self.proc.poll() is not None or time.monotonic() >= self.deadline):
            self._result = self._read()
        return self._result

    def _read(self) -> tuple[bool, str]:
        if self.proc.poll() is None:
            self.kill()
            return False, f"diagnostics did not finish within {self.budget_s + GRACE_S:.0f} s"
        report = self.out_path.read_text().strip()
        self.out_path.unlink(missing_ok=True)
        if self.proc.returncode not in (0, 1):  # 1 = a check failed; anything else = it could not run
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
            return False, lines[-1] if lines else f"diagnostics exited with code {self.proc.returncode}"
        return self.proc.returncode == 0, report

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out_path.unlink(missing_ok=True)
