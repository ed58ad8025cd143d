"""NotReady machines as a real control plane reports them: the node lifecycle controller marks a machine whose
kubelet stopped NotReady only after its node-monitor grace period (40 s by default; shortened here, the same
mechanism), and the operator then waits spec.nodeNotReadyGraceSeconds more before it evicts the node."""
from __future__ import annotations

import time

import pytest
from fake_behaviours import NODE_MONITOR_GRACE_S
from k8s_support import NS, create_job, operator_runtime, running_pods
from megascale.driver.backend import NodeLaunch
from megascale.driver.k8s import health, spec
from megascale.driver.k8s.evictions import evict_failed
from megascale.driver.k8s.operator import Operator, Runtime
from megascale.driver.state import JobRecord


JOB = "gpt"
LAUNCH = NodeLaunch(job=f"{NS}.{JOB}", redis_url="redis://r:6379/0", kafka="k:9092", run_dir=spec.RUN_DIR,
                    heartbeat_s=5)
MONITOR_S, JOB_GRACE_S = 2.0, 1  # the controller's grace (40 s in a real cluster), the job's


@pytest.fixture
def job(apiserver):
    """A TrainingJob with nodeNotReadyGraceSeconds=1, its running pods n0..n2 on machines m0..m2, an operator."""
    api, admin_config, operator_config = apiserver
    create_job(admin_config, JOB, nodes=2, devicesPerNode=1, deviceResource="", parallelism={"dp": 2}, spares=1,
               nodeNotReadyGraceSeconds=JOB_GRACE_S)
    cr = api.get("trainingjobs", JOB, NS, group="megascale.io")
    running_pods(api, cr, LAUNCH, 3)
    with operator_runtime(cr, operator_config, active=2, spares=1) as (operator, rt, rec):
        yield api, operator, rt, cr, rec


def observe(api, operator: Operator, rt: Runtime, cr: dict, rec: JobRecord) -> None:
    """One operator pass over what the API server holds now: its NotReady clock (reconcile_all), then step 4."""
    pods = {p["metadata"]["labels"][spec.NODE_LABEL]: p for p in api.list("pods", NS)}
    machines = {m["metadata"]["name"]: m for m in api.list("nodes")}
    health.track_not_ready(machines, operator.not_ready_since, time.monotonic())
    evict_failed(operator, rt, cr, rec, pods, machines, set(rt.store.evict_requests()))


def test_a_stopped_kubelet_is_not_ready_after_the_monitor_grace_and_evicted_after_the_jobs(job):
    api, operator, rt, cr, rec = job
    api.node_monitor()
    assert api.node_monitor_grace_s == NODE_MONITOR_GRACE_S == 40  # a real controller's default
    api.node_monitor(grace_s=MONITOR_S)
    api.kubelet_stopped("m2")  # back within the grace period: never marked
    stopped = time.monotonic()
    api.kubelet_stopped("m1")
    api.set_ready("m2", True)
    flipped = evicted = None
    while evicted is None and time.monotonic() - stopped < MONITOR_S + JOB_GRACE_S + 5:
        observe(api, operator, rt, cr, rec)
        now = time.monotonic()
        if flipped is None and not health.ready(api.get("nodes", "m1")):
            flipped = now
        if rt.store.evict_requests():
            evicted = now
        time.sleep(0.05)
    assert flipped is not None and evicted is not None, (flipped, evicted)
    assert flipped - stopped >= MONITOR_S - 0.1  # Ready (stale) all along the controller's grace: nothing evicted
    assert JOB_GRACE_S - 0.2 <= evicted - flipped < JOB_GRACE_S + 1  # then spec.nodeNotReadyGraceSeconds
    assert rt.store.evict_requests() == ["n1"] and health.ready(api.get("nodes", "m2"))
    assert [e["reason"] for e in api.list("events", NS)] == ["NodeNotReady"]


def test_without_the_node_monitor_a_stopped_kubelet_is_not_ready_at_once(job):
    api = job[0]
    api.kubelet_stopped("m0")
    assert not health.ready(api.get("nodes", "m0"))
