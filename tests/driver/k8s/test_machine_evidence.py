"""Evidence of a bad machine cordons it (health.py, crashes.py, operator.py): a hardware error in a rank's log
(the driver evicts the node, recovery.bad says why), and pods of different jobs crashing on one machine.
A crash of one job, however often, and pods that were preempted or killed for memory never do."""
from __future__ import annotations

import time

import pytest
from k8s_support import NS
from megascale.driver.backend import NodeLaunch
from megascale.driver.k8s import crashes, health, spec
from megascale.driver.k8s.backend import K8sState, KubernetesBackend
from megascale.driver.k8s.crd import crd
from megascale.driver.k8s.informer import Informer
from megascale.driver.k8s.kube import Kube, connect
from megascale.driver.k8s.operator import POD_SELECTOR, Operator, Runtime
from megascale.driver.k8s.spec import PodPolicy, ServiceDefaults
from megascale.driver.recovery import selfcheck
from megascale.driver.recovery_record import Fault, Recovery
from megascale.driver.state import JobRecord, JobStore, NodeSlot

from megascale.common.embedded_redis import EmbeddedRedis

XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."


def launch(name: str) -> NodeLaunch:
    return NodeLaunch(job=f"{NS}.{name}", redis_url="redis://r:6379/0", kafka="k:9092", run_dir=spec.RUN_DIR,
                      heartbeat_s=5)


def trainingjob(name: str, **extra) -> dict:
    return {"apiVersion": "megascale.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name, "namespace": NS},
            "spec": {"image": "megascale:test", "nodes": 2, "devicesPerNode": 1, "deviceResource": "",
                     "parallelism": {"dp": 2}, "spares": 1, "config": {"inline": {}}, **extra}}


@pytest.fixture
def cluster(apiserver):
    """Machines m0..m2; TrainingJobs a, b, c, each with running pods n0 on m0 and n1 on m1, run by one operator
    (its Runtimes, their Redis). Yields (server, operator, {name: TrainingJob})."""
    api, admin_config, operator_config = apiserver
    api.on_pod_delete = lambda pod: True
    admin = Kube(connect(admin_config))
    admin.apply_crd(crd())
    for i in range(3):
        api.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"m{i}"}, "spec": {},
                 "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    with EmbeddedRedis() as server:
        operator = Operator(Kube(connect(operator_config)), NS, ServiceDefaults(), missing_grace_s=0)
        jobs = {}
        for name in ("a", "b", "c"):
            admin.custom.create_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs",
                                                         trainingjob(name))
            cr = jobs[name] = api.get("trainingjobs", name, NS, group="megascale.io")
            for i in range(2):
                api.put(spec.pod(cr, f"n{i}", launch(name), []))
                running = {"phase": "Running", "containerStatuses": [{"name": "executor", "state": {"running": {}}}]}
                api.update("pods", f"{name}-n{i}", NS, lambda p, i=i: (p["spec"].update(nodeName=f"m{i}"),
                                                                      p.update(status=running)))
            store = JobStore.from_url(server.url, f"{NS}.{name}")
            state = K8sState(store.r, store.job)
            state.set_uid(cr["metadata"]["uid"])
            operator.runtimes[(NS, name)] = Runtime(NS, name, cr["metadata"]["uid"], store, state, server.url, "k:1",
                                                    False, {})
        yield api, operator, jobs


def crash(api, pod: str, code: int = 139, ago_s: float = 0.0) -> None:
    """The pod's executor ends by a signal or a non-zero exit, as the kubelet reports it."""
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - ago_s))
    api.update("pods", pod, NS, lambda p: p.update(status={"phase": "Failed", "containerStatuses": [
        {"name": "executor", "image": "megascale:test", "imageID": "", "ready": False, "restartCount": 0,
         "state": {"terminated": {"exitCode": code, "reason": "Error", "finishedAt": when}}}]}))


def seen(api, operator: Operator) -> None:
    """What the operator's pod informer delivers: every pod as it is now."""
    for pod in api.list("pods", NS):
        operator.crashes.observe(pod)


def judge(api, operator: Operator, jobs: dict) -> set[str]:
    """One pass of the cross-job cordon; the machines cordoned now."""
    crashes.cordon_crashed(operator, {(NS, n): cr for n, cr in jobs.items()},
                           {m["metadata"]["name"]: m for m in api.list("nodes")})
    return {m["metadata"]["name"] for m in api.list("nodes") if m["spec"].get("unschedulable")}


def events(api, reason: str) -> list[dict]:
    return [e for e in api.list("events", NS) if e["reason"] == reason]


# -- a hardware error in a rank's log ------------------------------------------------------------------

def test_a_hardware_error_in_a_ranks_log_cordons_its_machine_and_a_crash_does_not(cluster):
    api, operator, jobs = cluster
    assert health.HARDWARE_ERROR == selfcheck.HARDWARE_ERROR  # the driver's wording is what the operator reads
    rt = operator.runtimes[(NS, "a")]
    backend = KubernetesBackend(operator.kube, NS, "a", launch("a"), rt.store.r, PodPolicy())
    crash(api, "a-n0", 139)  # a plain crash of this one job on m0: the driver evicts n0 as dead
    backend.evict("n0")
    backend.evict("n1")  # what the driver's restart does after rank 1's Xid (recovery.bad, below)
    assert rt.state.evicted_hosts() == ["m0", "m1"]  # the job avoids both
    rec = JobRecord(job=rt.job, config={}, run_dir="/r")
    rec.nodes = [NodeSlot("n0", "evicted", None, True), NodeSlot("n1", "evicted", None, True)]
    why = f"{selfcheck.HARDWARE_ERROR}: rank 1: {XID}"
    rec.recovery = Recovery(Fault("rank_error", "n1", f"rank 1 on n1 logged a hardware error: {XID}",
                                  {"error": "hardware_error", "why": why}), None, bad={"n1": why})
    machines = {m["metadata"]["name"]: m for m in api.list("nodes")}
    for _ in range(2):
        operator._cordon(rt, jobs["a"]["spec"], rec, machines)
    cordoned = {m["metadata"]["name"] for m in api.list("nodes") if m["spec"].get("unschedulable")}
    assert cordoned == {"m1"}, cordoned  # not m0: a job's own crash is no evidence for everyone
    assert XID in api.get("nodes", "m1")["metadata"]["annotations"][spec.EVICTED_ANNOTATION]
    [event] = events(api, "MachineCordoned")  # once, on the job
    assert event["involvedObject"]["uid"] == jobs["a"]["metadata"]["uid"] and XID in event["message"]
    assert "cordoned m1: node n1 evicted: hardware error in its log: rank 1: NVRM: Xid" in event["message"]
    seen(api, operator)
    assert judge(api, operator, jobs) == {"m1"}  # nor does the crash tracker count one job


def test_evicted_nodes_the_record_forgot_leave_no_entries_but_their_machines_stay_avoided(cluster):
    """Weeks of evictions: the driver drops an evicted node from the job record (NodePool.evict ->
    forget_evicted), and its machine and excuse go with it from Redis; the job still avoids the machine."""
    api, operator, jobs = cluster
    rt = operator.runtimes[(NS, "a")]
    backend = KubernetesBackend(operator.kube, NS, "a", launch("a"), rt.store.r, PodPolicy())
    rt.state.excuse("n0", "preempted")
    backend.evict("n1")
    assert rt.state.host_of("n1") == "m1" and rt.state.excused("n0")
    backend.forget_evicted(["n0", "n1"])
    assert rt.state.host_of("n1") is None and not rt.state.excused("n0")
    assert rt.state.evicted_hosts() == ["m1"]
    assert rt.store.r.exists(rt.state.k_node_hosts, rt.state.k_excused) == 0
    backend.forget_evicted([])  # nothing forgotten: no call Redis would refuse (HDEL needs a field)


def test_a_hardware_error_cordons_only_within_budget_and_pool(cluster):
    api, operator, jobs = cluster
    rt = operator.runtimes[(NS, "a")]
    for node, host in (("n0", "m0"), ("n1", "m1")):
        rt.state.add_evicted_node(node, host)
    rec = JobRecord(job=rt.job, config={}, run_dir="/r")
    rec.nodes = [NodeSlot("n0", "evicted", None, True), NodeSlot("n1", "evicted", None, True)]
    rec.recovery = Recovery(Fault("rank_error", "n0", "m"), None, bad={
        "n0": f"{selfcheck.HARDWARE_ERROR}: rank 0: {XID}", "n1": f"{selfcheck.HARDWARE_ERROR}: rank 1: {XID}"})
    machines = {m["metadata"]["name"]: m for m in api.list("nodes")}
    operator._cordon(rt, {"cordonBudget": 1, "nodeSelector": {"pool": "gpu"}}, rec, machines)
    assert not any(m["spec"].get("unschedulable") for m in api.list("nodes"))  # no machine carries the label
    operator._cordon(rt, {"cordonBudget": 1}, rec, machines)
    assert sum(bool(m["spec"].get("unschedulable")) for m in api.list("nodes")) == 1


# -- crashes of different jobs' pods on one machine --------------------------------------------------

def test_pods_of_two_jobs_crashing_on_one_machine_cordon_it_with_one_event_per_job(cluster):
    api, operator, jobs = cluster
    crash(api, "a-n0", 139)  # SIGSEGV
    seen(api, operator)
    assert judge(api, operator, jobs) == set()  # one job: its image, maybe
    crash(api, "b-n0", 135)  # SIGBUS, another job, the same machine
    crash(api, "b-n1", 1)  # and on m1, where only b crashed
    seen(api, operator)
    seen(api, operator)  # a pod seen again (every change, a relist) counts once
    assert judge(api, operator, jobs) == {"m0"}
    annotation = api.get("nodes", "m0")["metadata"]["annotations"][spec.EVICTED_ANNOTATION]
    assert "pods of 2 different jobs crashed on m0 within 60 min" in annotation
    assert "exit code 139 (SIGSEGV)" in annotation and "exit code 135 (SIGBUS)" in annotation
    cordoned = events(api, "MachineCordoned")
    assert sorted(e["involvedObject"]["name"] for e in cordoned) == ["a", "b"]
    assert all("cordoned m0: pods of 2 different jobs crashed" in e["message"] for e in cordoned)
    for name in ("a", "b"):  # each counted job spent one of its spec.cordonBudget
        assert set(operator.runtimes[(NS, name)].state.cordoned()) == {"m0"}
    assert judge(api, operator, jobs) == {"m0"} and len(events(api, "MachineCordoned")) == 2  # said once
    assert operator.crashes.crashes.keys() == {"m1"}  # the cordoned machine's crashes are forgotten


def test_the_same_job_crashing_twice_on_a_machine_does_not_cordon_it(cluster):
    api, operator, jobs = cluster
    crash(api, "a-n0", 139)
    seen(api, operator)
    api.remove("pods", "a-n0", NS)  # the driver replaces it; its replacement lands on m0 again and crashes
    api.put(spec.pod(jobs["a"], "n2", launch("a"), []))
    api.update("pods", "a-n2", NS, lambda p: p["spec"].update(nodeName="m0"))
    crash(api, "a-n2", 134)
    seen(api, operator)
    assert len(operator.crashes.crashes["m0"]) == 2
    assert judge(api, operator, jobs) == set() and events(api, "MachineCordoned") == []


def test_preempted_oom_killed_and_evicted_pods_never_count(cluster):
    api, operator, jobs = cluster
    api.end_pod("a-n0", NS, "OOMKilled")  # the job's own memory: exit code 137, but no crash
    api.end_pod("c-n0", NS, "Evicted")
    crash(api, "b-n0", 139)
    seen(api, operator)
    api.end_pod("a-n1", NS, "Preempted")  # a DisruptionTarget, then deleted
    crash(api, "b-n1", 139)
    seen(api, operator)
    assert judge(api, operator, jobs) == set()
    assert {host: len(c) for host, c in operator.crashes.crashes.items()} == {"m0": 1, "m1": 1}


def test_old_crashes_a_spent_budget_and_a_job_crashing_everywhere_do_not_count(cluster):
    api, operator, jobs = cluster
    crash(api, "a-n0", 139, ago_s=crashes.CRASH_WINDOW_S + 60)  # finished before the window
    crash(api, "b-n0", 139)
    seen(api, operator)
    assert judge(api, operator, jobs) == set() and operator.crashes.crashes["m0"].keys() == {
        api.get("pods", "b-n0", NS)["metadata"]["uid"]}  # pruned
    operator.runtimes[(NS, "c")].state.add_cordoned("m9", time.time())  # c's budget (1 an hour) is spent
    crash(api, "c-n0", 139)
    seen(api, operator)
    assert judge(api, operator, jobs) == set()
    assert any("spec.cordonBudget=1" in message for message in operator._said.values())

    # Job a's pods crash on three machines (its image, its Redis): it is evidence against none of them.
    crash(api, "a-n1", 1)
    for node, host in (("n3", "m0"), ("n4", "m2")):
        api.put(spec.pod(jobs["a"], node, launch("a"), []))
        api.update("pods", f"a-{node}", NS, lambda p, host=host: p["spec"].update(nodeName=host))
    crash(api, "a-n3", 1)  # with b's crash on m0, this alone would cordon it
    crash(api, "a-n4", 1)
    seen(api, operator)
    assert judge(api, operator, jobs) == set()


def test_crashes_are_bounded_per_machine():
    tracker = crashes.CrashTracker()
    for i in range(crashes.MAX_PER_MACHINE + 10):
        tracker.observe({"metadata": {"name": f"p{i}", "uid": f"u{i}", "namespace": NS,
                                      "labels": {spec.JOB_LABEL: "a"},
                                      "ownerReferences": [{"controller": True, "uid": "job-a"}]},
                         "spec": {"nodeName": "m0"},
                         "status": {"phase": "Failed", "containerStatuses": [
                             {"name": "executor", "state": {"terminated": {"exitCode": 1}}}]}})
    assert len(tracker.crashes["m0"]) == crashes.MAX_PER_MACHINE
    tracker.clock = lambda: time.time() + crashes.CRASH_WINDOW_S + 1
    assert tracker.suspects() == {} and tracker.crashes == {}


def test_the_operators_pod_informer_feeds_the_tracker_a_crash_deleted_at_once(cluster, apiserver):
    api, operator, jobs = cluster
    informer = Informer("pods", operator.kube.core.list_namespaced_pod, operator._pod_changed, namespace=NS,
                        label_selector=POD_SELECTOR, watch_timeout_s=5).start()
    try:
        assert informer.synced.wait(10)
        crash(api, "a-n0", 139)
        api.remove("pods", "a-n0", NS)  # its driver deletes it before any pass of the operator
        crash(api, "b-n0", 139)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(operator.crashes.crashes.get("m0", {})) < 2:
            time.sleep(0.05)
    finally:
        informer.stop()
    assert judge(api, operator, jobs) == {"m0"}
