"""Self-checks off the critical path, without a cluster: which faults restart at once with their node checked
beside the new ranks, and what a background result does (the end-to-end runs are in test_recovery.py)."""
from __future__ import annotations

import json
import time

from megascale.common.messages import Ack
from megascale.config import from_dict
from megascale.driver.recovery import policy, selfcheck
from megascale.driver.recovery_record import BackgroundCheck, Fault, Recovery
from megascale.driver.state import JobRecord, NodeSlot


def config(**control):
    return from_dict({"name": "j", "model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
                      "parallelism": {"dp": 2}, "batch": {"micro": 1, "global": 2},
                      "cluster": {"nodes": 2}, "control": control})


def record() -> JobRecord:
    return JobRecord(job="j", config={}, run_dir="/r", incarnation=1,
                     nodes=[NodeSlot("n0", "active", 0), NodeSlot("n1", "active", 1)])


class Store:
    """The few JobStore calls background self-checks make: commands sent, results by node."""

    def __init__(self):
        self.sent: list[tuple[str, str, dict]] = []
        self.results: dict[str, Ack] = {}

    def send(self, node: str, op: str, args: dict) -> int:
        self.sent.append((node, op, args))
        return len(self.sent)

    def take_injection(self, node: str) -> dict:
        return {}

    def selfchecks(self) -> dict[str, Ack]:
        return self.results


def result(store: Store, node: str, ok: bool, failed: tuple[str, ...] = ()) -> None:
    report = json.dumps({"nodes": [{"node": node, "failed": list(failed)}]})
    store.results[node] = Ack(job="j", node=node, seq=len(store.sent), op="diagnose", ok=ok, detail=report)


def test_only_faults_with_a_node_local_cause_or_a_dead_node_are_checked_beside_the_restart():
    def plan(kind: str, gone=lambda node: False, **detail) -> tuple[list[str], list[str]]:
        recovery = Recovery(Fault(kind, "n1", "m", detail), timeline=None)  # type: ignore[arg-type]
        return selfcheck.plan(record(), recovery, config(), gone=gone)

    assert plan("rank_failed", exit_code=-9) == ([], ["n1"])  # kill -9, the OOM killer
    assert plan("rank_failed", exit_code=-11) == ([], ["n1"])  # a segfault
    assert plan("nan_loss") == ([], ["n1"]) and plan("rank_error", error="oom") == ([], ["n1"])
    assert plan("rank_failed", exit_code=1) == (["n0", "n1"], [])  # an exception: maybe a peer's timeout, check first
    assert plan("rank_failed", exit_code=-6) == (["n0", "n1"], [])  # SIGABRT: the NCCL watchdog aborts the peers
    for kind in ("hang", "rank_error", "unresponsive"):
        assert plan(kind) == (["n0", "n1"], [])
    assert plan("node_dead", gone=lambda node: node == "n1") == ([], ["n0"])  # the dead node's peer, beside
    assert plan("rank_failed", gone=lambda node: node == "n1", exit_code=-9) == ([], ["n0"])  # its node died too
    recovery = Recovery(Fault("rank_failed", "n1", "m", {"exit_code": -9}), timeline=None)
    assert selfcheck.plan(record(), recovery, config(selfcheck=False), gone=lambda node: False) == ([], [])


def test_a_failed_background_check_is_a_fault_that_evicts_without_counting_a_restart():
    rec, cfg, store, events = record(), config(), Store(), []
    event = lambda etype, message, rec, **kw: events.append(message)  # noqa: E731
    selfcheck.send_background(rec, cfg, store, "n1")
    assert store.sent[0][1:] == ("diagnose", {**selfcheck.request(cfg, {}), "background": True})
    assert selfcheck.background_fault(rec, cfg, store, event) is None and "n1" in rec.checking  # still running
    result(store, "n1", ok=False, failed=("gemm.flops",))
    fault = selfcheck.background_fault(rec, cfg, store, event)
    assert fault.kind == "selfcheck_failed" and fault.node == "n1" and "(gemm.flops)" in fault.message
    assert rec.checking == {}

    rec.restarts = cfg.control.max_restarts  # the check's own eviction is not a restart more
    recovery = Recovery(fault, timeline=None)
    recovery.bad["n1"] = fault.detail["why"]
    decision, reason = policy.decide(rec, recovery, [], cfg)
    assert decision == "restart" and "evicting n1 (self-check failed: gemm.flops)" in reason, reason


def test_a_passing_background_check_keeps_the_node_and_retry_checks_once_more():
    rec, cfg, store, events = record(), config(crashed_selfcheck="retry"), Store(), []
    event = lambda etype, message, rec, **kw: events.append(message)  # noqa: E731
    selfcheck.send_background(rec, cfg, store, "n1")
    result(store, "n1", ok=False, failed=("gemm.flops",))
    assert selfcheck.background_fault(rec, cfg, store, event) is None  # retried instead
    assert len(store.sent) == 2 and rec.checking["n1"].retried
    result(store, "n1", ok=True)
    assert selfcheck.background_fault(rec, cfg, store, event) is None and rec.checking == {}
    assert events[-1] == "n1 passed its background self-check: kept", events

    selfcheck.send_background(rec, cfg, store, "n0", retried=True)  # a peer of the fault's node: no second check
    result(store, "n0", ok=False, failed=("gemm.flops",))
    assert selfcheck.background_fault(rec, cfg, store, event).node == "n0" and len(store.sent) == 3

    rec.checking["n0"] = BackgroundCheck(seq=99, sent=time.time() - 1000)  # never answered
    assert selfcheck.background_fault(rec, cfg, store, event) is None and rec.checking == {}
    assert "no result of n0's background self-check; kept" in events
