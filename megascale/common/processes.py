"""Process helpers the driver, the executors and the engine's launchers all use: a free local port,
whether a pid is alive, stopping a child in order (SIGTERM, then SIGKILL), and the last line a process logged."""
from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path
from typing import Optional


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: Optional[int]) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited after `grace_s`; reaps it either way."""
    stop_processes([proc], grace_s)


def stop_processes(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to all at once, then SIGKILL to those still running after `grace_s` in total; reaps them all."""
    import time

    running = [p for p in procs if p.poll() is None]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in running:
        try:
            proc.wait(timeout=max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# The prefix of our processes' log lines ("%(asctime)s %(name)s %(levelname)s "), which a one-line error drops.
LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \S+ [A-Z]+ ")


LOG_TAIL_BYTES = 64 * 1024  # a driver's log grows for the weeks its job runs: only its end is read


def last_line(log_file: Path) -> str:
    """The last line a process wrote to its log (where its error is), without the logging prefix, with the
    log's name."""
    try:
        with open(log_file, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            lines = log.read().decode(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return f"{LOG_PREFIX.sub('', lines[-1]) if lines else '(nothing)'} (see {log_file})"
