"""A hardware error in a rank's log (an NVIDIA Xid, an uncorrectable ECC error) is evidence of a bad node:
the fault names it first, no self-check is run, and the restart evicts the node (on any backend; on
Kubernetes the operator then cordons its machine: tests/driver/k8s/test_machine_evidence.py)."""
from __future__ import annotations

import time

from megascale.common.messages import ErrorLine, Heartbeat, RankStatus
from megascale.config import from_dict
from megascale.driver.ingest import NodeView
from megascale.driver.pool import NodePool
from megascale.driver.recovery import selfcheck
from megascale.driver.recovery.detection import detect_faults
from megascale.driver.recovery.recoverer import Recoverer
from megascale.driver.recovery_record import Fault, Recovery
from megascale.driver.state import JobRecord, JobState, NodeSlot

from control_plane_support import StubBackend  # noqa: E402 - tests/driver is on sys.path (conftest)

XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."


def config(**control):
    return from_dict({"name": "j", "model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
                      "parallelism": {"dp": 2}, "batch": {"micro": 1, "global": 2},
                      "cluster": {"nodes": 2, "spares": 1}, "control": control})


def record() -> JobRecord:
    return JobRecord(job="j", config={}, run_dir="/r", incarnation=1, next_node=3,
                     nodes=[NodeSlot("n0", "active", 0, True), NodeSlot("n1", "active", 1, True),
                            NodeSlot("n2", "spare", None, True)])


def view(node: str, rank: int, state: str, errors: list[ErrorLine]) -> NodeView:
    hb = Heartbeat(job="j", node=node, host="h", ip="10.0.0.1", boot_id="b", seq=1, time=time.time(),
                   interval_s=1.0, phase="running", incarnation=1,
                   ranks=[RankStatus(rank=rank, local_rank=0, state=state, exit_code=1 if state == "failed" else None)],
                   errors=errors)
    return NodeView(hb, time.monotonic(), time.time())


def test_a_hardware_error_is_the_fault_even_when_its_rank_and_a_peer_failed_too():
    rec, cfg = record(), config()
    views = {"n0": view("n0", 0, "failed", [ErrorLine(0, "comm_error", "NCCL WARN peer closed", 1.0)]),
             "n1": view("n1", 1, "failed", [ErrorLine(1, "hardware_error", XID, 2.0)])}
    faults = detect_faults(rec, views, lambda node: 0.0, cfg)
    fault = faults[0]  # the peer's collateral failure comes second
    assert (fault.kind, fault.node, fault.detail["error"]) == ("rank_error", "n1", "hardware_error")
    assert fault.detail["why"] == f"{selfcheck.HARDWARE_ERROR}: rank 1: {XID}"
    assert [f.kind for f in faults[1:]] == ["rank_failed"]
    recovery = Recovery(fault, timeline=None)
    assert not selfcheck.wanted(fault, cfg)  # the line is the evidence: no check before or beside the restart
    assert selfcheck.plan(rec, recovery, cfg, gone=lambda node: False) == ([], [])


class Host:
    """What Recoverer._decide asks of the reconcile loop."""

    def __init__(self, cfg):
        self.cfg, self.backend, self.events, self.moves = cfg, StubBackend(), [], []
        self.pool = NodePool(self.backend, cfg)
        self.store = self

    def save(self, rec): pass

    def ensure_nodes(self, rec): pass

    def move(self, rec, state, reason): self.moves.append((state, reason))

    def event(self, etype, message, rec, node=None, **detail): self.events.append(message)


def decide(cfg) -> tuple[JobRecord, Host]:
    rec, host = record(), Host(cfg)
    fault = Fault("rank_error", "n1", f"rank 1 on n1 logged a hardware error: {XID}",
                  {"rank": 1, "error": "hardware_error", "why": f"{selfcheck.HARDWARE_ERROR}: rank 1: {XID}"})
    Recoverer(host)._decide(rec, Recovery(fault, timeline=None))
    return rec, host


def test_the_restart_evicts_the_node_for_a_spare_naming_the_line():
    rec, host = decide(config())
    assert host.backend.evicted == ["n1"] and rec.slot("n1").role == "evicted" and rec.slot("n2").index == 1
    assert any(f"evicted n1 ({selfcheck.HARDWARE_ERROR}: rank 1: {XID})" in m for m in host.events), host.events
    assert host.moves[-1][0] is JobState.INITIALIZING and rec.restarts == 1

    rec, host = decide(config(auto_recover=False))  # a human decides: nothing evicted behind their back
    assert host.backend.evicted == [] and rec.slot("n1").role == "active"
