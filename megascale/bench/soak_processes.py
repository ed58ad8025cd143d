"""The soak's processes and what a job leaves behind: which processes belong to the job (its supervisor's tree,
and the executors a killed driver left outside it), what kind each is, what one leak fit follows (a process's
life), and the job's leftovers after it ended."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterable

import psutil

from megascale.common.private_dir import private_temp_dir


def process_kind(cmdline: list[str]) -> str:
    """`python -m megascale.executor.rank ...` -> "executor.rank"; a binary -> its name (redis-server, tansu)."""
    if "-m" in cmdline[:-1]:
        return cmdline[cmdline.index("-m") + 1].removeprefix("megascale.")
    return Path(cmdline[0].split()[0]).name.split("-v")[0]  # "redis-server 127.0.0.1:port", "tansu-v0.6.0-..."


def job_processes(pids: Iterable[int], known: dict[int, psutil.Process]) -> dict[int, psutil.Process]:
    """The processes of `pids`, of those `known` still running, and all their descendants. A killed driver's
    executors outlive it (the next driver adopts them), reparented out of the supervisor's tree: looked for
    only there, they and their ranks went unsampled from a kill-driver to the end of the run."""
    found: dict[int, psutil.Process] = {}
    roots = []  # a known process whose parent is known too is found again below that parent
    for p in known.values():
        with contextlib.suppress(psutil.Error):
            if p.ppid() not in known:
                roots.append(p)
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            roots.append(psutil.Process(pid))
    for p in roots:
        try:
            if p.is_running():  # not a reused pid
                found[p.pid] = p
                found.update((c.pid, c) for c in p.children(recursive=True))
        except psutil.Error:
            continue
    return found


def life_key(pid: int, created: float, cmdline: list[str], threads: int) -> str:
    """What one leak fit follows: a process ("pid@start time": pids are reused). A warm standby still waiting
    (one thread, torch imported) is a life of its own: when it becomes a rank it loads a model, starts
    its groups' threads and opens their sockets, a step up that a fit across both would count as a leak."""
    waiting = "--standby" in cmdline and threads == 1
    return f"{pid}@{created:.2f}" + ("/standby" if waiting else "")


def leftovers(root: Path, shm_before: set[str], tmp_before: set[str]) -> dict[str, int]:
    """What of the job is still there after it ended: processes, shared memory, sockets, temp files."""
    procs = 0
    for p in psutil.process_iter(["cmdline"]):
        if any(str(root) in a for a in p.info["cmdline"] or []):
            procs += 1
    sockets = sum(1 for c in psutil.net_connections("unix") if c.laddr and str(root) in str(c.laddr))
    temp_files = len(temp_names() - tmp_before - {root.name})
    return {"processes": procs, "shm_segments": len(set(os.listdir("/dev/shm")) - shm_before), "sockets": sockets,
            "temp_files": temp_files}


def temp_names() -> set[str]:
    """megascale's names in the temp directory, and those in this user's private directory there (the keepers'
    logs), which is not itself a leftover: it stays, as /tmp/tmux-UID does."""
    private = private_temp_dir()
    return ({n for n in os.listdir(tempfile.gettempdir()) if "megascale" in n and n != private.name}
            | {f"{private.name}/{n}" for n in os.listdir(private)})
