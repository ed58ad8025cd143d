"""The suite's result: one row per measurement, judged against a baseline; a versioned JSON schema.

Bump SCHEMA_VERSION whenever a field is added, removed, renamed or changes meaning.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field

from .config import Threshold

SCHEMA_VERSION = 1
PASS, FAIL, SKIP, PENDING = "pass", "fail", "skip", "pending"


@dataclass
class CheckResult:
    check: str  # health | gemm | loopback | all_to_all | all_reduce
    metric: str  # e.g. bandwidth; `check.metric` names the threshold
    nodes: list[str]  # nodes the measurement involved
    target: str  # interface, device, "pair:a+b", "tor:<label>", path
    value: float | None
    unit: str
    status: str = PENDING  # pass | fail | skip (pending only before judging)
    baseline: float | None = None
    baseline_source: str = "none"  # configured | median | absolute | none
    threshold: float | None = None  # the number value was compared with
    comparison: str = ""  # ">=" or "<="
    elapsed_s: float = 0.0
    budget_s: float = 0.0
    detail: str = ""

    @property
    def key(self) -> str:
        return f"{self.check}.{self.metric}"


@dataclass
class NodeStatus:
    node_id: str
    host: str
    topology: str
    devices: list[int]
    passed: bool
    failed: list[str]  # `check.metric` of its failing rows (named-by-isolation counts too)


@dataclass
class IsolationResult:
    topology: str
    suspects: list[str]  # nodes whose first-round pair failed
    bad_nodes: list[str]
    pairs: list[list]  # [node_a, node_b, round, passed] in the order tested


@dataclass
class Report:
    schema_version: int
    passed: bool
    started_at: str  # ISO 8601, UTC
    elapsed_s: float
    budget_s: float
    backend: str  # gloo | nccl
    device: str  # cpu | cuda
    bad_nodes: list[str]
    nodes: list[NodeStatus]
    checks: list[CheckResult]
    isolation: list[IsolationResult] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def failures(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status == FAIL]


def baseline(values: list[float], th: Threshold) -> tuple[float | None, str]:
    """Configured `expected`, else the cluster median; with an even count, the better middle value
    so that one straggler in a small cluster cannot drag the baseline towards itself."""
    if th.expected is not None:
        return th.expected, "configured"
    if not values:
        return None, "none"
    pick = statistics.median_high if th.min_ratio is not None else statistics.median_low
    return pick(values), "median"


def _sig(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.6g}")


def judge(row: CheckResult, base: float | None, source: str, th: Threshold) -> CheckResult:
    """Set row.status from its value and the baseline (relative) or the bounds (absolute)."""
    row.value = _sig(row.value)
    if row.value is None:
        row.status = FAIL
        return row
    if not th.relative:
        row.baseline_source = "absolute"
        ok = True
        if th.min_value is not None:
            row.threshold, row.comparison = th.min_value, ">="
            ok = row.value >= th.min_value
        if th.max_value is not None and ok:
            row.threshold, row.comparison = th.max_value, "<="
            ok = row.value <= th.max_value
        row.status = PASS if ok else FAIL
        return row
    row.baseline, row.baseline_source = _sig(base), source
    if base is None:
        row.status = PASS
        return row
    if th.min_ratio is not None:
        row.threshold, row.comparison = _sig(base * th.min_ratio), ">="
        row.status = PASS if row.value >= row.threshold else FAIL
    else:
        row.threshold, row.comparison = _sig(base * th.max_ratio), "<="
        row.status = PASS if row.value <= row.threshold else FAIL
    return row


def judge_pending(rows: list[CheckResult], thresholds: dict[str, Threshold]) -> None:
    """Judge every pending row against the baseline of its own `check.metric` cohort."""
    cohorts: dict[str, list[CheckResult]] = {}
    for row in rows:
        if row.status == PENDING:
            cohorts.setdefault(row.key, []).append(row)
    for key, group in cohorts.items():
        th = thresholds[key]
        base, source = baseline([r.value for r in group if r.value is not None], th)
        for row in group:
            judge(row, base, source, th)
