"""Pod failures judged by the pod's own evidence (failures.py, health.py, evictions.py): what the operator
evicts, what it leaves to the driver (a restart), which machines the job then avoids; the NotReady grace
period; a missing pod confirmed by an uncached read; and the executors' priority class."""
from __future__ import annotations

import time

import pytest
from kubernetes import client
from k8s_support import NS, operator_runtime, running_pods
from megascale.driver.backend import NodeLaunch
from megascale.driver.k8s import spec
from megascale.driver.k8s.backend import KubernetesBackend
from megascale.driver.k8s.crd import crd
from megascale.driver.k8s.evictions import evict_failed
from megascale.driver.k8s.kube import Kube, connect
from megascale.driver.k8s.operator import Operator, Runtime
from megascale.driver.k8s.spec import PodPolicy
from megascale.driver.state import JobRecord
from schema_tools import admit


JOB = "gpt"
LAUNCH = NodeLaunch(job=f"{NS}.{JOB}", redis_url="redis://r:6379/0", kafka="k:9092", run_dir=spec.RUN_DIR,
                    heartbeat_s=5)


def trainingjob(**extra) -> dict:
    return {"apiVersion": "megascale.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": JOB, "namespace": NS},
            "spec": {"image": "megascale:test", "nodes": 2, "devicesPerNode": 1, "deviceResource": "",
                     "parallelism": {"dp": 2}, "spares": 2, "resources": {"limits": {"memory": "16Gi"}},
                     "config": {"inline": {}}, **extra}}


@pytest.fixture
def job(apiserver):
    """A stored TrainingJob, its running pods n0..n3 on machines m0..m3, the job's Redis, the operator's client.
    Deleted pods stay terminating (the kubelet stand-in finishes nothing)."""
    api, admin_config, operator_config = apiserver
    api.on_pod_delete = lambda pod: True
    admin = Kube(connect(admin_config))
    admin.apply_crd(crd())
    admin.custom.create_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs", trainingjob())
    cr = api.get("trainingjobs", JOB, NS, group="megascale.io")
    running_pods(api, cr, LAUNCH, 4)
    with operator_runtime(cr, operator_config, active=2, spares=2) as (operator, rt, rec):
        yield api, operator, rt, cr, rec


def observe(api, operator: Operator, rt: Runtime, cr: dict, rec: JobRecord, pods=None) -> None:
    """One pass of the operator's step 4 over what the API server holds now."""
    if pods is None:
        pods = {p["metadata"]["labels"][spec.NODE_LABEL]: p for p in api.list("pods", NS)}
    machines = {m["metadata"]["name"]: m for m in api.list("nodes")}
    evict_failed(operator, rt, cr, rec, pods, machines, set(rt.store.evict_requests()))


def test_only_disruptions_are_evicted_and_no_machine_is_blamed_for_them_or_for_memory(job):
    api, operator, rt, cr, rec = job
    api.end_pod(f"{JOB}-n0", NS, "Preempted")  # the scheduler's: a DisruptionTarget, then a graceful delete
    api.end_pod(f"{JOB}-n1", NS, "OOMKilled")  # the job's own memory
    api.end_pod(f"{JOB}-n2", NS, "ImagePullBackOff")  # a spare that never started
    api.set_ready("m3", False)  # NotReady just now: within the grace period
    operator.not_ready_since["m3"] = time.monotonic()
    observe(api, operator, rt, cr, rec)
    # The preemption is replaced at once (no restart counted); the OOM kill is the driver's to count as a
    # restart; the pull keeps waiting for the driver's start timeout; m3 may come back.
    assert rt.store.evict_requests() == ["n0"]
    events = {e["reason"]: e for e in api.list("events", NS)}
    assert set(events) == {"PreemptionByScheduler", "OOMKilled", "ImagePullBackOff"}
    assert all(e["involvedObject"]["uid"] == cr["metadata"]["uid"] for e in events.values())
    assert "its memory limit 16Gi, which the memory-backed /dev/shm (up to 8Gi) counts against" in \
        events["OOMKilled"]["message"]
    observe(api, operator, rt, cr, rec)
    assert len(api.list("events", NS)) == 3  # each failure reported once

    operator.not_ready_since["m3"] -= spec.NOT_READY_GRACE_S + 1  # NotReady past spec.nodeNotReadyGraceSeconds
    observe(api, operator, rt, cr, rec)
    assert sorted(rt.store.evict_requests()) == ["n0", "n3"]

    # The driver evicts all four: only the machine that stopped reporting is kept from the job's later pods,
    # and none is cordoned.
    backend = KubernetesBackend(operator.kube, NS, JOB, LAUNCH, rt.store.r, PodPolicy())
    for node in ("n0", "n1", "n2", "n3"):
        backend.evict(node)
    assert rt.state.evicted_hosts() == ["m3"]
    assert not any(m["spec"].get("unschedulable") for m in api.list("nodes"))


def test_a_crash_and_a_kubelet_eviction_are_told_apart(job):
    api, operator, rt, cr, rec = job
    api.end_pod(f"{JOB}-n0", NS, "Evicted")  # node pressure: the kubelet's, not the machine's fault
    api.update("pods", f"{JOB}-n1", NS, lambda p: p.update(status={"phase": "Failed", "containerStatuses": [
        {"name": "executor", "state": {"terminated": {"exitCode": 135, "reason": "Error"}}}]}))
    observe(api, operator, rt, cr, rec)
    assert rt.store.evict_requests() == ["n0"]  # the crash counts as a restart: the driver's
    assert "pod gpt-n1 failed: exit code 135 (SIGBUS)" in {e["reason"]: e["message"] for e in
                                                             api.list("events", NS)}["Crashed"]
    backend = KubernetesBackend(operator.kube, NS, JOB, LAUNCH, rt.store.r, PodPolicy())
    backend.evict("n0")
    backend.evict("n1")
    assert rt.state.evicted_hosts() == ["m1"]  # the crash may be the machine's: this job avoids it


def test_a_drain_through_the_eviction_api_replaces_the_pod_and_blames_no_machine(job, apiserver):
    api, operator, rt, cr, rec = job
    admin = Kube(connect(apiserver[1]))
    drain = client.V1Eviction(metadata=client.V1ObjectMeta(name=f"{JOB}-n1", namespace=NS))
    admin.core.create_namespaced_pod_eviction(f"{JOB}-n1", NS, drain)  # what `kubectl drain m1` sends
    observe(api, operator, rt, cr, rec)
    assert rt.store.evict_requests() == ["n1"]
    assert "EvictionByEvictionAPI" in {e["reason"] for e in api.list("events", NS)}
    KubernetesBackend(operator.kube, NS, JOB, LAUNCH, rt.store.r, PodPolicy()).evict("n1")
    assert rt.state.evicted_hosts() == []
    assert not any(m["spec"].get("unschedulable") for m in api.list("nodes"))


def test_a_pod_the_cache_misses_is_read_again_before_its_node_is_evicted(job):
    api, operator, rt, cr, rec = job
    cached = {p["metadata"]["labels"][spec.NODE_LABEL]: p for p in api.list("pods", NS)}
    del cached["n1"]  # the watch has not delivered it yet, for longer than the operator's grace
    rt.missing_since["n1"] = time.monotonic() - 60
    observe(api, operator, rt, cr, rec, pods=cached)
    assert rt.store.evict_requests() == []
    api.remove("pods", f"{JOB}-n1", NS)
    observe(api, operator, rt, cr, rec, pods=cached)
    assert rt.store.evict_requests() == ["n1"]


def test_executor_pods_carry_the_specs_priority_class_else_the_operators():
    cr = trainingjob()
    cr["metadata"]["uid"] = "u"
    assert "priorityClassName" not in spec.pod(cr, "n0", LAUNCH, [])["spec"]
    assert spec.pod(cr, "n0", LAUNCH, [], PodPolicy(priority_class="training"))["spec"]["priorityClassName"] == \
        "training"
    cr["spec"]["priorityClassName"] = "urgent"
    assert spec.pod(cr, "n0", LAUNCH, [], PodPolicy(priority_class="training"))["spec"]["priorityClassName"] == \
        "urgent"
    stored = admit(crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"], trainingjob())["spec"]
    assert stored["nodeNotReadyGraceSeconds"] == spec.NOT_READY_GRACE_S


@pytest.mark.parametrize("reason", ["TerminationByKubelet", "DeletionByTaintManager"])
def test_kubelet_terminations_and_taint_deletions_are_disruptions_like_the_others(job, reason):
    api, operator, rt, cr, rec = job
    api.end_pod(f"{JOB}-n1", NS, reason)  # a node shutdown's kubelet; a NoExecute taint's manager (then a delete)
    pod = api.get("pods", f"{JOB}-n1", NS)
    assert {c["type"]: c["reason"] for c in pod["status"]["conditions"]}["DisruptionTarget"] == reason
    assert (pod["status"]["phase"] == "Failed") == (reason == "TerminationByKubelet")
    assert bool(pod["metadata"].get("deletionTimestamp")) == (reason == "DeletionByTaintManager")
    observe(api, operator, rt, cr, rec)
    assert rt.store.evict_requests() == ["n1"]  # replaced now, like a preemption or a drain: no restart counted
    [event] = api.list("events", NS)
    assert event["reason"] == reason and event["involvedObject"]["uid"] == cr["metadata"]["uid"]
    KubernetesBackend(operator.kube, NS, JOB, LAUNCH, rt.store.r, PodPolicy()).evict("n1")
    assert rt.state.evicted_hosts() == []  # no machine blamed, none cordoned
    assert not any(m["spec"].get("unschedulable") for m in api.list("nodes"))
