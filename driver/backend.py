"""Where nodes come from. The driver sees only this interface; local processes and Kubernetes pods
implement it, so recovery logic never asks which one it is talking to.

A node is one executor daemon with a node id. The driver decides which ids are active and
which are spares (`pool.py`); a backend only starts, stops, lists and evicts them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


@dataclass
class NodeLaunch:
    """Everything an executor needs to join the job, whatever starts it."""
    job: str
    redis_url: str
    kafka: str
    run_dir: str
    heartbeat_s: float
    env: dict[str, str] = field(default_factory=dict)
    network: str = "loopback"  # cluster.network: `emulated` puts each local node in a network namespace
    link_gbit: float = 2.0
    standby: int = 0  # control.standby_ranks: warm rank processes per training node (ranks_per_node when idle)
    ranks_per_node: int = 0


@dataclass
class NodeInfo:
    node: str
    alive: bool
    host: str
    where: str  # how to find it: "pid 1234", a pod name


class Backend(ABC):
    @abstractmethod
    def start(self, nodes: list[str]) -> None:
        """Start one executor per node id (ids are new: a backend never sees one twice)."""

    @abstractmethod
    def stop(self, nodes: list[str], grace_s: float = 10.0) -> None:
        """Stop these nodes' executors (they stop their ranks first); idempotent."""

    @abstractmethod
    def list(self) -> dict[str, NodeInfo]:
        """Every node this backend started for the job, alive or not."""

    @abstractmethod
    def evict(self, node: str) -> None:
        """Stop the node and keep its machine out of this job (Kubernetes: anti-affinity; the operator cordons
        the machine only if it failed its self-check)."""

    def forget_evicted(self, nodes: list[str]) -> None:
        """Drops what the backend keeps per evicted node for these, which the job record no longer names (weeks
        of evictions must not grow it); the machines they ran on stay avoided."""

    @abstractmethod
    def log_files(self, node: str) -> list[Path]:
        """Readable logs of a node, executor first, for `megascale logs` (empty if not local files)."""

    def exited_before_reporting(self, nodes: list[str]) -> Optional[str]:
        """Why one of these nodes, which never reported, never will: its process ended (with what it said last);
        None while each may still report, or where only a timeout can tell (Kubernetes restarts a pod)."""
        return None

    def why_not_started(self, nodes: list[str]) -> Optional[str]:
        """Why these nodes never reported, when the backend knows better than "no heartbeat" (Kubernetes: pods a
        gang scheduler never placed); None otherwise."""
        return None


def make_backend(kind: str, launch: NodeLaunch, client) -> Backend:
    if kind == "local":
        from .local import LocalBackend

        return LocalBackend(launch, client)
    raise ValueError(f"cluster.backend={kind!r}: no such backend")
