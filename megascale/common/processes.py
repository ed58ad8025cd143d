"""Process helpers the driver, the executors and the engine's launchers all use: a free local port,
whether a pid is alive, and stopping a child in order (SIGTERM, then SIGKILL)."""
from __future__ import annotations

import os
import socket
import subprocess
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
