"""Leader election over the stand-in API server's Lease endpoint: one replica holds the Lease, a stalled
holder is fenced (its writes never reach the API server) before another takes over, and an orderly stop
hands the Lease over at once."""
from __future__ import annotations

import threading
import time

import pytest
import yaml
from fake_apiserver import kubeconfig
from k8s_support import NS, SYSTEM_NS, wait_for
from megascale.driver.k8s.kube import Kube, connect
from megascale.driver.k8s.leader import Fence, LeaderElection, LeaseConfig, NotLeader

FAST = {"lease_s": 2, "renew_deadline_s": 1.2, "retry_s": 0.2}  # client-go's 15 / 10 / 2 s, shortened


class Replica:
    """One operator replica's election, as its own API user (so the server's request log tells them apart)."""

    def __init__(self, api, tmp_path, name: str):
        api.add_user(f"{name}-token", name, admin=True)
        path = tmp_path / f"{name}.kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig(api.url, f"{name}-token", namespace=NS)))
        self.user, self.fence = name, Fence(tmp_path / f"{name}.lease")
        self.kube = Kube(connect(str(path))).fenced(self.fence)
        self.election = LeaderElection(self.kube.api, LeaseConfig(namespace=SYSTEM_NS, identity=name, **FAST),
                                       self.fence)
        self.stopping = threading.Event()
        self.leading = threading.Event()

    def campaign(self) -> "Replica":
        def run() -> None:
            if self.election.acquire(self.stopping):
                self.leading.set()
        threading.Thread(target=run, daemon=True).start()
        return self

    def writes(self, api) -> list:
        return [r for r in api.requests if r[0] == self.user and r[1] in ("create", "update", "patch", "delete")]


def lease(api) -> dict:
    return api.get("leases", "megascale-operator", SYSTEM_NS, group="coordination.k8s.io")["spec"]


def test_a_stalled_leader_is_fenced_before_the_other_replica_takes_over(apiserver, tmp_path, monkeypatch):
    api = apiserver[0]
    a = Replica(api, tmp_path, "replica-a").campaign()
    assert a.leading.wait(5) and lease(api)["holderIdentity"] == "replica-a"
    b = Replica(api, tmp_path, "replica-b").campaign()
    time.sleep(1.0)  # five renewals: b never takes a Lease that is renewed
    assert not b.leading.is_set() and a.fence.held() and lease(api)["leaseTransitions"] == 0

    # a stalls (a hung process: its renewals stop), b takes over once the Lease went unrenewed for 2 s
    stalled = threading.Event()
    monkeypatch.setattr(a.election, "_try", lambda: stalled.wait() and False)
    stalled_at = time.monotonic()
    wait_for(lambda: not a.fence.held(), 3, "a's fence to close")
    fenced_after = time.monotonic() - stalled_at
    assert b.leading.wait(5)
    took_over_after = time.monotonic() - stalled_at
    # fenced within the renew deadline of its last renewal; b only after the lease duration (0.8 s more)
    assert fenced_after < FAST["renew_deadline_s"] + 0.3 and fenced_after + 0.4 < took_over_after < FAST["lease_s"] + 2
    assert lease(api)["holderIdentity"] == "replica-b" and lease(api)["leaseTransitions"] == 1

    # a wakes up: whatever it was about to write is refused before it leaves the process
    before = len(a.writes(api))
    with pytest.raises(NotLeader):
        a.kube.patch_job_status(NS, "gpt", {"phase": "Running"})
    with pytest.raises(NotLeader):
        a.kube.delete_pod(NS, "gpt-n0")
    a.kube.create_event({"metadata": {"name": "gpt", "namespace": NS, "uid": "u"}}, "Normal", "Stale", "x")
    assert len(a.writes(api)) == before
    monkeypatch.undo()
    stalled.set()  # its renewal finds b's name in the Lease: lost for good
    wait_for(lambda: a.election.lost.is_set(), 3, "a to learn it lost the Lease")
    assert a.writes(api)[before:] == [] and lease(api)["holderIdentity"] == "replica-b"

    # b stops in order: it releases the Lease, and a third replica holds it at once, not 2 s later
    c = Replica(api, tmp_path, "replica-c").campaign()
    b.stopping.set()
    b.election.release()
    assert not b.fence.held() and c.leading.wait(1.0)
    c.stopping.set()
    c.election.release()
    a.stopping.set()
    a.election.release()


def test_lease_timings_must_leave_a_fence(apiserver):
    with pytest.raises(ValueError, match="renew deadline"):
        LeaseConfig(lease_s=10, renew_deadline_s=10.0, retry_s=2.0)
