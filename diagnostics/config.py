"""What the diagnostics suite checks, how long each check may take, and what counts as healthy.

Every bad value raises `ConfigError` with a one-line message naming the field.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megascale.common import typed
from megascale.config import ConfigError

# The five checks of the suite, in the order they run (cheap, single-process ones first so the
# GEMM timing is not disturbed by the collective checks' process start-up).
CHECKS = ("health", "gemm", "loopback", "all_to_all", "all_reduce")
LOCAL_TOR = "local-tor"
_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass
class Threshold:
    """Pass rule for one `check.metric`.

    Relative metrics compare against a baseline: `expected` when configured, otherwise the cluster
    median of the same metric. Absolute metrics (health) use `min_value` / `max_value` only.
    """

    min_ratio: float | None = None  # throughput: pass iff value >= baseline * min_ratio
    max_ratio: float | None = None  # latency: pass iff value <= baseline * max_ratio
    expected: float | None = None  # configured baseline; None = cluster median
    min_value: float | None = None
    max_value: float | None = None

    @property
    def relative(self) -> bool:
        return self.min_ratio is not None or self.max_ratio is not None


def default_thresholds() -> dict[str, Threshold]:
    return {
        "loopback.bandwidth": Threshold(min_ratio=0.5),
        "loopback.latency": Threshold(max_ratio=4.0),
        "loopback.link_bandwidth": Threshold(min_ratio=0.5),  # an emulated node's data link (loopback.py)
        "loopback.link_latency": Threshold(max_ratio=4.0),
        "all_to_all.bus_bandwidth": Threshold(min_ratio=0.5),
        "all_reduce.bus_bandwidth": Threshold(min_ratio=0.5),
        "all_reduce.latency": Threshold(max_ratio=4.0),
        "all_reduce.pair_bus_bandwidth": Threshold(min_ratio=0.5),
        "gemm.flops": Threshold(min_ratio=0.7),
        "health.device_memory": Threshold(min_value=1.0),  # fraction of the requested bytes verified
        "health.host_memory": Threshold(min_value=1.0),  # GB available
        "health.checkpoint_disk": Threshold(min_value=5.0),  # GB free
        "health.shm": Threshold(min_value=0.5),  # GB free
        "health.ecc_uncorrected": Threshold(max_value=0),
        "health.xid": Threshold(max_value=0),
    }


def default_budgets() -> dict[str, float]:
    # Seconds per unit of work: loopback per interface, gemm per device, all_to_all and health
    # per node, all_reduce per collective run (one ToR group or one pair). GEMM keeps its best 10 ms block:
    # 0.3 s gives ~20 of them, as sure a measure as 2 s on a device that is slow from the start (a throttled
    # clock, a bad HBM stack), and keeps the driver's self-check of an 8-GPU node near 2 s.
    return {"health": 5.0, "gemm": 0.3, "loopback": 2.0, "all_to_all": 6.0, "all_reduce": 5.0}


@dataclass
class DiagnosticsConfig:
    budget_s: float = 60.0  # per node: the whole suite gets budget_s * len(nodes)
    checks: tuple[str, ...] = CHECKS
    budgets: dict[str, float] = field(default_factory=default_budgets)
    thresholds: dict[str, Threshold] = field(default_factory=default_thresholds)
    interfaces: tuple[str, ...] | None = None  # None = every up interface with an IPv4 address
    loopback_mb: float = 256.0  # upper bound on bytes per bulk transfer; the time window ends it first
    all_to_all_mb: float = 4.0  # per rank
    all_reduce_mb: float = 16.0
    gemm_size: int = 0  # 0 = 8192 (bf16) on GPU, 384 (fp32) on CPU
    alloc_mb: float = 256.0  # device memory test
    checkpoint_dir: str = "."
    shm_path: str = "/dev/shm"
    backend: str = "auto"  # auto | gloo | nccl
    collective_timeout_s: float = 20.0  # every collective; a hung peer fails the check after this
    spawn_grace_s: float = 15.0  # time a collective run's processes get to start and meet on the store
    isolate: bool = True  # re-pair nodes to name the bad one when a pair all-reduce fails
    allow_fault_injection: bool = False  # tests only: honour NodeSpec.faults

    def validate(self) -> DiagnosticsConfig:
        _positive("budget_s", self.budget_s)
        if not self.checks:
            raise ConfigError("checks is empty; choose from " + ",".join(CHECKS))
        for name in self.checks:
            if name not in CHECKS:
                raise ConfigError(f"checks: unknown check {name!r}; choose from {','.join(CHECKS)}")
        for name, seconds in self.budgets.items():
            if name not in CHECKS:
                raise ConfigError(f"budgets.{name}: unknown check; choose from {','.join(CHECKS)}")
            _positive(f"budgets.{name}", seconds)
        for key in ("loopback_mb", "all_to_all_mb", "all_reduce_mb", "alloc_mb", "collective_timeout_s",
                    "spawn_grace_s"):
            _positive(key, getattr(self, key))
        if not isinstance(self.gemm_size, int) or self.gemm_size < 0:
            raise ConfigError(f"gemm_size={self.gemm_size!r} must be an integer >= 0 (0 = auto)")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"backend={self.backend!r} must be one of auto, gloo, nccl")
        known = default_thresholds()
        for key, th in self.thresholds.items():
            if key not in known:
                raise ConfigError(f"thresholds.{key}: unknown metric; choose from {','.join(known)}")
            _validate_threshold(key, th, known[key])
        return self

    def budget(self, check: str) -> float:
        return self.budgets.get(check, default_budgets()[check])

    def threshold(self, key: str) -> Threshold:
        return self.thresholds.get(key) or default_thresholds()[key]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DiagnosticsConfig:
        """Build from a YAML-style mapping, e.g. a job config's `diagnostics:` section."""
        cfg = cls()
        for key, value in data.items():
            if key == "thresholds":
                for metric, fields in (value or {}).items():
                    for name, v in (fields or {}).items():
                        cfg.set(f"thresholds.{metric}.{name}", v)
            elif key == "budgets":
                for name, v in (value or {}).items():
                    cfg.set(f"budgets.{name}", v)
            else:
                cfg.set(key, value)
        return cfg.validate()

    def set(self, key: str, value: Any) -> None:
        """Set one dotted field (`gemm_size`, `budgets.gemm`, `thresholds.gemm.flops.min_ratio`)."""
        parts = key.split(".")
        if parts[0] == "thresholds":
            if len(parts) != 4:
                raise ConfigError(f"{key}: expected thresholds.<check>.<metric>.<field>")
            metric, name = ".".join(parts[1:3]), parts[3]
            if metric not in default_thresholds():
                raise ConfigError(f"{key}: unknown metric {metric!r}; choose from {','.join(default_thresholds())}")
            if name not in typed.hints(Threshold):
                raise ConfigError(f"{key}: unknown field {name!r}; "
                                  "choose from min_ratio,max_ratio,expected,min_value,max_value")
            th = dataclasses.replace(self.threshold(metric))
            setattr(th, name, _read(key, typed.hints(Threshold)[name], value))
            self.thresholds = {**self.thresholds, metric: th}
        elif parts[0] == "budgets":
            if len(parts) != 2 or parts[1] not in CHECKS:
                raise ConfigError(f"{key}: expected budgets.<check> with check in {','.join(CHECKS)}")
            self.budgets = {**self.budgets, parts[1]: _read(key, float, value)}
        elif len(parts) == 1 and key in _SETTINGS:
            setattr(self, key, _read(key, _SETTINGS[key], value))
        else:
            raise ConfigError(f"{key}: unknown diagnostics setting")

    def apply_overrides(self, overrides: list[str]) -> DiagnosticsConfig:
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
            self.set(key.strip(), value.strip())
        return self.validate()


# The fields `set` takes whole (budgets and thresholds are set one entry at a time).
_SETTINGS = {name: hint for name, hint in typed.hints(DiagnosticsConfig).items()
             if name not in ("budgets", "thresholds")}
# `--set` values are command-line text ("0.5", "yes", "gemm,health", "none"); YAML values pass as they are.
_TEXT = typed.Rules(text=True)


def _read(key: str, hint: Any, value: Any) -> Any:
    try:
        return typed.read(hint, value, _TEXT)
    except typed.Invalid as e:
        raise ConfigError(f"{key}={value!r} must be {typed.expected_words(e.expected)}") from None


def _positive(key: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"{key}={value!r} must be a number > 0")


def _validate_threshold(key: str, th: Threshold, default: Threshold) -> None:
    name = f"thresholds.{key}"
    for f in dataclasses.fields(Threshold):
        v = getattr(th, f.name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v)):
            raise ConfigError(f"{name}.{f.name}={v!r} must be a number")
    if default.relative:
        if th.min_value is not None or th.max_value is not None:
            raise ConfigError(f"{name}: relative metric; use min_ratio/max_ratio/expected, not min_value/max_value")
        if default.min_ratio is not None:
            if th.max_ratio is not None:
                raise ConfigError(f"{name}.max_ratio: throughput metric; use min_ratio")
            if th.min_ratio is None or not 0 < th.min_ratio <= 1:
                raise ConfigError(f"{name}.min_ratio={th.min_ratio!r} must be in (0, 1]")
        else:
            if th.min_ratio is not None:
                raise ConfigError(f"{name}.min_ratio: latency metric; use max_ratio")
            if th.max_ratio is None or th.max_ratio < 1:
                raise ConfigError(f"{name}.max_ratio={th.max_ratio!r} must be >= 1")
        if th.expected is not None and th.expected <= 0:
            raise ConfigError(f"{name}.expected={th.expected!r} must be > 0")
    else:
        if th.relative or th.expected is not None:
            raise ConfigError(f"{name}: absolute metric; use min_value/max_value")
        if th.min_value is None and th.max_value is None:
            raise ConfigError(f"{name}: needs min_value or max_value")
        if th.min_value is not None and th.min_value < 0:
            raise ConfigError(f"{name}.min_value={th.min_value!r} must be >= 0")
        if th.max_value is not None and th.max_value < 0:
            raise ConfigError(f"{name}.max_value={th.max_value!r} must be >= 0")


@dataclass
class NodeSpec:
    """One node as the backend sees it. On the local backend a node is a set of local processes."""

    node_id: str
    host: str = "127.0.0.1"
    devices: tuple[int, ...] = (0,)  # one rank per device; CUDA indices on GPU, labels on CPU
    topology: str = LOCAL_TOR  # switch (ToR) label; all-reduce pairs stay within one label
    interfaces: tuple[str, ...] | None = None  # None = DiagnosticsConfig.interfaces
    faults: dict[str, str] = field(default_factory=dict)  # MEGASCALE_DIAG_* -> value; tests only
    netns: str | None = None  # an emulated network's node: its all-reduce rank runs in this network namespace


def local_nodes(node_ids: list[str], ranks_per_node: int) -> list[NodeSpec]:
    """Nodes of the local backend: all on this host, all under one ToR, disjoint GPUs when present."""
    import torch

    if ranks_per_node < 1:
        raise ConfigError(f"ranks_per_node={ranks_per_node} must be >= 1")
    on_gpu = torch.cuda.is_available()
    if on_gpu and len(node_ids) * ranks_per_node > torch.cuda.device_count():
        raise ConfigError(
            f"ranks_per_node={ranks_per_node} x {len(node_ids)} nodes needs more than the "
            f"{torch.cuda.device_count()} GPUs on this host")
    nodes = []
    for i, node_id in enumerate(node_ids):
        first = i * ranks_per_node if on_gpu else 0
        nodes.append(NodeSpec(node_id, devices=tuple(range(first, first + ranks_per_node))))
    return nodes


def validate_nodes(nodes: list[NodeSpec]) -> None:
    if not nodes:
        raise ConfigError("nodes is empty; pass at least one node")
    seen: set[str] = set()
    local = _local_addresses()
    for i, node in enumerate(nodes):
        where = f"nodes[{i}]"
        if not isinstance(node.node_id, str) or not _NODE_ID.match(node.node_id):
            raise ConfigError(f"{where}.node_id={node.node_id!r} must match [A-Za-z0-9][A-Za-z0-9_.-]*")
        if node.node_id in seen:
            raise ConfigError(f"{where}.node_id={node.node_id!r} is duplicated")
        seen.add(node.node_id)
        if not node.devices or len(set(node.devices)) != len(node.devices):
            raise ConfigError(f"{where}.devices={tuple(node.devices)!r} must be non-empty and unique")
        if any(not isinstance(d, int) or d < 0 for d in node.devices):
            raise ConfigError(f"{where}.devices={tuple(node.devices)!r} must be integers >= 0")
        if not node.topology:
            raise ConfigError(f"{where}.topology is empty")
        if node.host not in local:
            raise ConfigError(f"{where}.host={node.host!r} is not this machine; the local backend runs every node here")


def _local_addresses() -> set[str]:
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    try:
        import psutil

        for addrs in psutil.net_if_addrs().values():
            names.update(a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
    except (ImportError, OSError):  # psutil missing or restricted: loopback still counts
        pass
    names.update(str(ipaddress.ip_address(a)) for a in ("127.0.0.1", "::1"))
    return names
