"""Gang scheduling at the wire level (gang.py): the PodGroup a job's pods wait on, owned by the job and collected
with it; a gang that cannot fit reports Unschedulable with the scheduler's message and starts nothing,
evicts nothing, blames no machine; Kueue's labels and gate; the operator's rights for PodGroups."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import redis
from fake_scheduling import install_pod_groups, report_gated, schedule_gangs
from k8s_support import DEPLOY, NS, OPERATOR_USER, load_yaml
from megascale.driver.backend import NodeLaunch
from megascale.driver.k8s import gang, spec
from megascale.driver.k8s.backend import K8sState, KubernetesBackend
from megascale.driver.k8s.caches import PodCache
from megascale.driver.k8s.crd import crd
from megascale.driver.k8s.evictions import evict_failed
from megascale.driver.k8s.kube import Kube, connect
from megascale.driver.k8s.operator import Operator, Runtime
from megascale.driver.k8s.spec import PodPolicy, ServiceDefaults
from megascale.driver.reconcile import Driver
from megascale.driver.state import JobRecord, JobState, JobStore, NodeSlot

from megascale.common.embedded_redis import EmbeddedRedis

JOB = "gpt"
LAUNCH = NodeLaunch(job=f"{NS}.{JOB}", redis_url="redis://r:6379/0", kafka="k:9092", run_dir=spec.RUN_DIR,
                    heartbeat_s=5)


def trainingjob(**extra) -> dict:
    return {"apiVersion": "megascale.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": JOB, "namespace": NS},
            "spec": {"image": "megascale:test", "nodes": 2, "devicesPerNode": 1, "parallelism": {"dp": 2},
                     "spares": 1, "config": {"inline": {}}, **extra}}


@pytest.fixture
def cluster(apiserver):
    """A cluster with the PodGroup CRDs installed; yields (stand-in, admin client, operator client, Redis URL)."""
    api, admin_config, operator_config = apiserver
    install_pod_groups(api)
    admin = Kube(connect(admin_config))
    admin.apply_crd(crd())
    with EmbeddedRedis() as server:
        yield api, admin, Kube(connect(operator_config)), server.url


def submit(api, admin: Kube, **extra) -> dict:
    admin.custom.create_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs", trainingjob(**extra))
    return api.get("trainingjobs", JOB, NS, group="megascale.io")


def by_node(api) -> dict[str, dict]:
    return {p["metadata"]["labels"][spec.NODE_LABEL]: p for p in api.list("pods", NS)}


@pytest.mark.parametrize("kind", ["volcano", "scheduler-plugins"])
def test_the_pod_group_comes_first_owned_by_the_job_and_goes_with_it(cluster, kind):
    api, admin, operator, url = cluster
    api.load_rbac(load_yaml(DEPLOY / "scheduling" / "rbac.yaml"))
    cr = submit(api, admin, scheduling=kind, **({"queueName": "training"} if kind == "volcano" else {}))
    group = gang.POD_GROUP_APIS[kind][0]
    backend = KubernetesBackend(operator, NS, JOB, LAUNCH, redis.Redis.from_url(url), PodPolicy(priority_class="hi"))
    backend.start(["n0", "n1", "n2"])
    found = api.get("podgroups", JOB, NS, group=group)
    assert found["spec"]["minMember"] == 2  # the active nodes: the spare rides along
    assert found["metadata"]["ownerReferences"] == [{"apiVersion": "megascale.io/v1alpha1", "kind": "TrainingJob",
                                                     "name": JOB, "uid": cr["metadata"]["uid"], "controller": True}]
    if kind == "volcano":
        assert (found["spec"]["queue"], found["spec"]["priorityClassName"]) == ("training", "hi")
    pods = api.list("pods", NS)
    assert len(pods) == 3 and {p["spec"]["schedulerName"] for p in pods} == {gang.SCHEDULER_NAMES[kind]}
    member = ("annotations", gang.VOLCANO_GROUP) if kind == "volcano" else ("labels", gang.PLUGINS_GROUP)
    assert {p["metadata"][member[0]][member[1]] for p in pods} == {JOB}
    # a restarted driver finds the group its own and carries on
    KubernetesBackend(operator, NS, JOB, LAUNCH, redis.Redis.from_url(url), PodPolicy()).start(["n3"])
    assert len(api.list("pods", NS)) == 4
    admin.custom.delete_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs", JOB)
    assert api.get("podgroups", JOB, NS, group=group) is None and api.list("pods", NS) == []
    asked = {(r[1], r[-1]) for r in api.requests if r[0] == OPERATOR_USER and r[3] == "podgroups"}
    assert asked == {("create", 201), ("get", 200)}  # exactly deploy/scheduling/rbac.yaml's verbs, none refused


def test_a_pod_group_the_job_cannot_have_holds_its_pods_back(cluster):
    api, admin, operator, url = cluster
    cr = submit(api, admin, scheduling="volcano")
    client = redis.Redis.from_url(url)
    backend = KubernetesBackend(operator, NS, JOB, LAUNCH, client, PodPolicy())
    backend.start(["n0", "n1"])  # without deploy/scheduling/rbac.yaml: refused, told, nothing created
    refused = K8sState(client, LAUNCH.job).refused()
    assert set(refused) == {"n0", "n1"} and "podgroups is forbidden" in refused["n0"]
    assert [e["reason"] for e in api.list("events", NS)] == ["FailedCreatePod"]
    assert api.list("pods", NS) == []
    api.load_rbac(load_yaml(DEPLOY / "scheduling" / "rbac.yaml"))
    predecessor = spec.pod_group({**cr, "metadata": {**cr["metadata"], "uid": "old-uid"}})
    api.put(predecessor)  # a deleted job's group, not yet collected
    backend.start(["n0", "n1"])
    assert api.list("pods", NS) == [] and set(backend.unsent) == {"n0", "n1"}
    api.remove("podgroups", JOB, NS, group="scheduling.volcano.sh")
    backend.start(["n0", "n1"])
    assert len(api.list("pods", NS)) == 2 and K8sState(client, LAUNCH.job).refused() == {}


def test_a_gang_that_cannot_fit_is_unschedulable_not_a_node_fault(cluster):
    api, admin, operator_kube, url = cluster
    api.load_rbac(load_yaml(DEPLOY / "scheduling" / "rbac.yaml"))
    cr = submit(api, admin, scheduling="scheduler-plugins")
    store = JobStore.from_url(url, LAUNCH.job)
    state = K8sState(store.r, store.job)
    state.set_uid(cr["metadata"]["uid"])
    backend = KubernetesBackend(operator_kube, NS, JOB, LAUNCH, store.r, PodPolicy())
    backend.start(["n0", "n1", "n2"])
    schedule_gangs(api, NS, {"m0": 1, "m1": 0})  # room for one pod of a gang of two
    pods = by_node(api)
    assert not any(p["spec"].get("nodeName") for p in pods.values())  # no partial gang holds a GPU

    cfg = spec.job_config(cr, {}, ServiceDefaults(url, "k:9092"))
    rec = JobRecord(job=store.job, config=cfg.to_dict(), run_dir="/r")
    rec.nodes = [NodeSlot("n0", "active", 0, True), NodeSlot("n1", "active", 1, True),
                 NodeSlot("n2", "spare", None, True)]
    store.submit(rec)
    operator = Operator(operator_kube, NS, ServiceDefaults(), missing_grace_s=0)
    rt = Runtime(NS, JOB, cr["metadata"]["uid"], store, state, url, "k:9092", False, {}, frozen={},
                 pods=PodCache(store.r, store.job))
    operator._write_status(rt, cr, rec, pods, applied=True)
    status = api.get("trainingjobs", JOB, NS, group="megascale.io")["status"]
    unschedulable = {c["type"]: c for c in status["conditions"]}["Unschedulable"]
    assert (unschedulable["status"], unschedulable["reason"]) == ("True", "Unschedulable")
    assert unschedulable["message"] == ("pods gpt-n0, gpt-n1, gpt-n2: 0/2 nodes are available: 1 Insufficient "
                                        "nvidia.com/gpu. pod group gpt: 1 of minMember 2 pods fit")
    evict_failed(operator, rt, cr, rec, pods, {}, set())
    assert rt.store.evict_requests() == [] and api.list("events", NS) == []  # no failure, no eviction

    # The start timeout ends the job as Unschedulable; no node is evicted, no machine blamed or cordoned.
    driver = Driver(store, url, "k:9092", backend=backend)
    driver.cfg, driver.backend = cfg, backend
    driver.liveness = SimpleNamespace(reporting=lambda node: False)
    driver.events = SimpleNamespace(send=lambda *args, **kwargs: None)
    rec.entered = time.time() - cfg.control.start_timeout_s - 1
    driver._pending(rec, "running")
    assert rec.state == JobState.FAILED
    assert rec.reason == ("Unschedulable: the job's pods were never all scheduled: pods gpt-n0, gpt-n1: 0/2 nodes "
                          "are available: 1 Insufficient nvidia.com/gpu. pod group gpt: 1 of minMember 2 pods fit "
                          "(start timeout 600 s)")
    assert state.evicted_hosts() == [] and store.evict_requests() == []
    assert not any(m["spec"].get("unschedulable") for m in api.list("nodes"))

    schedule_gangs(api, NS, {"m0": 1, "m1": 1})  # room for the gang: both active pods at once
    assert {n for n, p in by_node(api).items() if p["spec"].get("nodeName")} == {"n0", "n1"}
    assert gang.condition(rec, by_node(api), JOB)["message"].startswith("pod gpt-n2: ")  # only the spare waits


def test_kueue_jobs_are_one_gated_pod_group_in_their_queue(cluster):
    api, admin, operator, url = cluster
    cr = submit(api, admin, scheduling="kueue", queueName="team-a")
    KubernetesBackend(operator, NS, JOB, LAUNCH, redis.Redis.from_url(url), PodPolicy()).start(["n0", "n1", "n2"])
    pods = by_node(api)
    group = f"{JOB}-{cr['metadata']['uid'][:8]}"  # never a predecessor's group of the same name
    for pod in pods.values():
        assert pod["metadata"]["labels"][gang.KUEUE_QUEUE] == "team-a"
        assert pod["metadata"]["labels"][gang.KUEUE_GROUP] == group
        assert pod["metadata"]["annotations"][gang.KUEUE_COUNT] == "3"  # nodes + spares: Kueue admits them whole
        assert pod["spec"]["schedulingGates"] == [{"name": gang.KUEUE_GATE}] and "schedulerName" not in pod["spec"]
    assert not [r for r in api.requests if r[3] == "podgroups"]  # Kueue makes its own Workload
    report_gated(api, NS)
    rec = JobRecord(job=LAUNCH.job, config={}, run_dir="/r")
    rec.nodes = [NodeSlot("n0", "active", 0, True), NodeSlot("n1", "active", 1, True)]
    found = gang.condition(rec, by_node(api), JOB)
    assert (found["status"], found["reason"]) == ("True", "SchedulingGated")
    assert "Scheduling is blocked due to non-empty scheduling gates" in found["message"]


def test_two_gangs_competing_for_the_same_machines_never_deadlock(cluster):
    api, admin, operator, url = cluster
    api.load_rbac(load_yaml(DEPLOY / "scheduling" / "rbac.yaml"))
    backends = {}
    for name in ("a", "b"):
        body = trainingjob(scheduling="scheduler-plugins", spares=0)
        body["metadata"]["name"] = name
        admin.custom.create_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs", body)
        launch = NodeLaunch(job=f"{NS}.{name}", redis_url=url, kafka="k:9092", run_dir=spec.RUN_DIR, heartbeat_s=5)
        backends[name] = KubernetesBackend(operator, NS, name, launch, redis.Redis.from_url(url), PodPolicy())
    for node in ("n0", "n1"):  # interleaved, as two drivers create them
        for backend in backends.values():
            backend.start([node])
    machines = {"m0": 1, "m1": 1}  # room for one gang of two, not for both

    def placed(job: str) -> set[str]:
        pods = api.list("pods", NS, f"{spec.JOB_LABEL}={job}")
        return {p["spec"]["nodeName"] for p in pods if p["spec"].get("nodeName")}
    for _ in range(3):  # the scheduler's passes: the gang that fits keeps its machines, the other holds none
        schedule_gangs(api, NS, machines)
        assert placed("a") == {"m0", "m1"} and placed("b") == set()
    rec = JobRecord(job=f"{NS}.b", config={}, run_dir="/r")
    rec.nodes = [NodeSlot("n0", "active", 0, True), NodeSlot("n1", "active", 1, True)]
    waiting = gang.condition(rec, {p["metadata"]["labels"][spec.NODE_LABEL]: p
                                   for p in api.list("pods", NS, f"{spec.JOB_LABEL}=b")}, "b")
    assert (waiting["status"], waiting["reason"]) == ("True", "Unschedulable")
    assert "pod group b: 0 of minMember 2 pods fit" in waiting["message"]

    for pod in api.list("pods", NS, f"{spec.JOB_LABEL}=a"):  # a ends: its pods succeed and free the machines
        api.update("pods", pod["metadata"]["name"], NS, lambda p: p.update(status={"phase": "Succeeded"}))
    schedule_gangs(api, NS, machines)
    assert placed("b") == {"m0", "m1"}
