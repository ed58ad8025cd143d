"""What a heartbeat says about the machine: identity and cheap psutil counters."""
from __future__ import annotations

import os
import socket

import psutil

from megascale.common.messages import HostMetrics


def identity() -> tuple[str, str]:
    """(hostname, an IP other nodes can use): the address the default route leaves from, else loopback."""
    host = socket.gethostname()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # UDP connect sends nothing; it only picks a route
            return host, s.getsockname()[0]
    except OSError:
        return host, "127.0.0.1"


def host_metrics() -> HostMetrics:
    mem = psutil.virtual_memory()
    try:
        net = psutil.net_io_counters()
    except (OSError, RuntimeError):  # containers without /proc/net/dev
        net = None
    return HostMetrics(
        cpu_percent=psutil.cpu_percent(interval=None),  # since the previous call: no sleeping here
        mem_percent=mem.percent,
        mem_used_bytes=mem.used,
        load_1m=os.getloadavg()[0],
        net_bytes_sent=net.bytes_sent if net else 0,
        net_bytes_recv=net.bytes_recv if net else 0,
        net_errors=(net.errin + net.errout) if net else 0,
        net_drops=(net.dropin + net.dropout) if net else 0,
    )


# psutil's states of a process that cannot make progress whatever its peers do.
HALTED_STATES = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def halted_state(pid: int) -> str:
    """The OS's word that a process is stopped (SIGSTOP, a debugger) or gone, else "": a rank stopped inside
    a collective has entered it like its waiting peers, so its flight records alone cannot name it."""
    try:
        state = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return psutil.STATUS_DEAD
    except psutil.Error:
        return ""
    return state if state in HALTED_STATES else ""
