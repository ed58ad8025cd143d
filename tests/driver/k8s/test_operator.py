"""The operator end to end against the stand-in API server: real Redis, real Kafka (tansu), the real
driver (a child process per job) and real executor processes, which the kubelet stand-in runs from
the pods the backend creates, with stand-in ranks (driver/sim_rank.py: steps on a timer).

One job goes through launch -> machine failure -> eviction -> coherent restart -> pause/resume via
the spec -> operator restart -> loss of its Redis record -> deletion, with the operator's service
account held to deploy/rbac.yaml throughout.
"""
from __future__ import annotations

import base64
import json
import threading
from pathlib import Path

import pytest
import yaml
from fake_kubelet import FakeCluster
from k8s_support import NS, OPERATOR_USER, sim_jobs, wait_for
from megascale.driver.k8s.cli import request
from megascale.driver.k8s.crd import crd
from megascale.driver.k8s.evictions import evict_failed
from megascale.driver.k8s.kube import Kube, connect
from megascale.driver.k8s.operator import Operator
from megascale.driver.k8s.spec import ServiceDefaults
from megascale.driver.services import EmbeddedKafka
from megascale.driver.state import JobStore

from megascale.common.messages import acks_key
from megascale.driver import sim_rank
from megascale.common.embedded_redis import EmbeddedRedis

JOB = "gpt"


@pytest.fixture
def services():
    kafka = EmbeddedKafka().start()
    with EmbeddedRedis() as redis_server:
        yield redis_server.url, kafka.bootstrap
    kafka.stop(kill=True)


class Running:
    """An operator in a thread, as `megascale kube operator` runs it in its pod."""

    def __init__(self, kubeconfig: str, redis_url: str, kafka: str, log_dir: Path):
        self.operator = Operator(Kube(connect(kubeconfig)), NS, ServiceDefaults(redis_url, kafka),
                                 kubeconfig=kubeconfig, tick_s=0.2, status_every_s=0.5, checkpoint_every_s=0.5,
                                 missing_grace_s=5, driver_log=log_dir, run_dir=str(log_dir / "run"))
        self.thread = threading.Thread(target=self.operator.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.operator.stop()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


def trainingjob(checkpoint: Path) -> list[dict]:
    config = {"name": "ignored", "model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
              "batch": {"micro": 1, "global": 4}, "cluster": {"nodes": 9}, "train": {"steps": 100000},
              "checkpoint": {"resume": True}}  # it continues the run whose checkpoint the test plants
    return [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "gpt-config", "namespace": NS},
             "data": {"job.yaml": yaml.safe_dump(config)}},
            {"apiVersion": "megascale.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": JOB, "namespace": NS},
             "spec": {"image": "megascale:test", "nodes": 2, "devicesPerNode": 2, "deviceResource": "",
                      "parallelism": {"dp": 4}, "spares": 1, "checkpoint": {"uri": str(checkpoint)},
                      "policy": {"heartbeatSeconds": 0.5, "deadAfterSeconds": 8, "commandTimeoutSeconds": 20},
                      "nodeNotReadyGraceSeconds": 1,  # the operator evicts, before the driver's heartbeat timeout
                      "config": {"configMapRef": {"name": "gpt-config", "key": "job.yaml"}}}}]


def test_launch_failure_eviction_restart_pause_operator_restart_redis_loss_delete(
        apiserver, services, tmp_path, monkeypatch):
    api, admin_config, operator_config = apiserver
    redis_url, kafka = services
    monkeypatch.setenv("MEGASCALE_RANK_ENTRY", sim_rank.__file__)
    monkeypatch.setenv("SIM_STEP_S", "0.1")
    (tmp_path / "ckpt" / "step-00000010").mkdir(parents=True)
    (tmp_path / "ckpt" / "step-00000010" / "manifest.json").write_text("{}")  # a committed checkpoint
    admin = Kube(connect(admin_config))
    admin.apply_crd(crd())
    config_map, job = trainingjob(tmp_path / "ckpt")
    admin.core.create_namespaced_config_map(NS, config_map)
    admin.custom.create_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs", job)
    cluster = FakeCluster(api, ["m0", "m1", "m2", "m3"], tmp_path / "machines").start()
    store = JobStore.from_url(redis_url, f"{NS}.{JOB}")

    def status() -> dict:
        return api.get("trainingjobs", JOB, NS, group="megascale.io").get("status") or {}

    def pods() -> dict[str, dict]:
        found = api.list("pods", NS, f"megascale.io/job={JOB}")
        return {p["metadata"]["labels"]["megascale.io/node"]: p for p in found}

    def running(incarnation: int):
        return lambda: (s := status()).get("phase") == "Running" and s.get("incarnation") == incarnation \
            and (s.get("step") or 0) > 0 and s

    operator = Running(operator_config, redis_url, kafka, tmp_path)
    try:
        # launch: 2 active nodes + 1 spare, one pod each on its own machine, owned by the job
        s = wait_for(running(1), 60, "the job to run")
        assert s["lastCheckpoint"] == {"step": 10, "uri": str(tmp_path / "ckpt")}
        assert {n["id"]: n["role"] for n in s["nodes"]} == {"n0": "active", "n1": "active", "n2": "spare"}
        uid = api.get("trainingjobs", JOB, NS, group="megascale.io")["metadata"]["uid"]
        first = pods()
        assert all(p["metadata"]["ownerReferences"][0]["uid"] == uid for p in first.values())
        assert len({p["spec"]["nodeName"] for p in first.values()}) == 3
        assert api.get("services", JOB, NS)["spec"]["clusterIP"] == "None"
        assert "dp: 4" in api.get("configmaps", f"{JOB}-resolved-config", NS)["data"]["config.yaml"]
        # its own credentials, owned by it, mounted as a file; its Redis user exists; its pods reach each other
        secret = api.get("secrets", f"{JOB}-credentials", NS)
        assert secret["metadata"]["ownerReferences"][0]["uid"] == uid
        user = f"megascale-job-{NS}.{JOB}"
        assert json.loads(base64.b64decode(secret["data"]["secrets.json"]))["redis_username"] == user
        assert store.r.execute_command("ACL", "GETUSER", user) is not None
        assert api.get("networkpolicies", f"{JOB}-pods", NS, group="networking.k8s.io")["spec"]["podSelector"] == {
            "matchLabels": {"megascale.io/job": JOB}}
        executor = first["n0"]["spec"]["containers"][0]
        assert {"name": "MEGASCALE_SECRETS", "value": "/var/run/megascale/credentials/secrets.json"} in executor["env"]

        # a machine fails: its node is evicted, the machine cordoned, the spare takes the ranks,
        # a new spare avoids the machine, and every active node restarts in incarnation 2
        bad = first["n1"]["spec"]["nodeName"]
        cluster.fail_machine(bad)
        s = wait_for(running(2), 60, "the restart with the spare")
        assert {n["id"]: n["role"] for n in s["nodes"]} == {"n0": "active", "n1": "evicted", "n2": "active",
                                                          "n3": "spare"}
        assert s["evictedNodes"] == [bad] and s["restarts"] == 0  # an eviction is not a rank failure
        assert any(e["reason"] == "NodeNotReady" and e["involvedObject"]["uid"] == uid for e in api.list("events", NS))
        # NotReady is no self-check failure: the machine stays schedulable for others (this job avoids it)
        assert not api.get("nodes", bad)["spec"].get("unschedulable")
        spare = wait_for(lambda: pods().get("n3", {}).get("spec", {}).get("nodeName") and pods()["n3"], 20,
                         "the new spare to be scheduled")
        term = spare["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["nodeSelectorTerms"][0]["matchFields"] == [{"key": "metadata.name", "operator": "NotIn",
                                                                "values": [bad]}]
        assert spare["spec"]["nodeName"] != bad
        acks = {k.decode(): json.loads(v) for k, v in store.r.hgetall(acks_key(store.job)).items()}
        assert {n: (a["op"], "incarnation 2" in a["detail"]) for n, a in acks.items() if n in ("n0", "n2")} == {
            "n0": ("start", True), "n2": ("start", True)}  # coherent: both got the same new incarnation

        # pause through the spec (what `kubectl patch --type merge` sends), resume through the CLI
        admin.patch_job(NS, JOB, {"spec": {"paused": True}})
        wait_for(lambda: status().get("phase") == "Paused" and status().get("paused"), 30, "the pause")
        assert "resume requested for TrainingJob megascale/gpt" in request(JOB, False, NS, admin_config)
        wait_for(running(3), 30, "the resume")

        # operator restart: the job carries on from its status and Redis, pods untouched
        before = {n: p["metadata"]["uid"] for n, p in pods().items()}
        synced = status()["lastSyncTime"]
        operator.stop()
        operator = Running(operator_config, redis_url, kafka, tmp_path)
        wait_for(lambda: status()["lastSyncTime"] > synced, 30, "status updates from the new operator")
        assert status()["incarnation"] == 3 and {n: p["metadata"]["uid"] for n, p in pods().items()} == before

        # Redis loses the job: the operator re-seeds it from the status on new pods, keeping the
        # incarnation count, the node ids and the evicted machine out
        store.r.flushall()
        s = wait_for(lambda: (s := status()).get("phase") == "Running" and s.get("incarnation") == 4 and s, 60,
                     "the re-seeded job to run")
        assert {n["id"] for n in s["nodes"]} == {"n4", "n5", "n6"} and s["evictedNodes"] == [bad]
        assert set(pods()) == {"n4", "n5", "n6"} and all(p["spec"].get("nodeName") != bad for p in pods().values())
    finally:
        # deletion: owner references take the pods, Service and ConfigMap; the operator stops the driver
        admin.custom.delete_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs", JOB)
        wait_for(lambda: not pods() and not operator.operator.retiring, 40, "the job's pods and driver to go")
        operator.stop()
        cluster.stop()
    assert api.get("services", JOB, NS) is None and api.get("configmaps", f"{JOB}-resolved-config", NS) is None
    assert api.get("secrets", f"{JOB}-credentials", NS) is None
    assert store.r.execute_command("ACL", "GETUSER", f"megascale-job-{NS}.{JOB}") is None

    # least privilege: the operator needed every rule of deploy/rbac.yaml, and nothing outside it
    used = {(group, resource, verb) for user, verb, group, resource, _, code in api.requests
            if user == OPERATOR_USER and code != 403}
    refused = [r for r in api.requests if r[0] == OPERATOR_USER and r[-1] == 403]
    granted = {(group, resource, verb) for _, rule in api.grants[OPERATOR_USER] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    cordon = {("", "nodes", "patch")}  # only after a failed self-check: test_security.py cordons under these rules
    assert not refused and used == granted - cordon, f"unused: {granted - cordon - used}"


def test_finished_jobs_stay_finished_and_unrunnable_ones_say_why(apiserver, services, tmp_path, monkeypatch):
    api, admin_config, operator_config = apiserver
    redis_url, kafka = services
    admin, inline = sim_jobs(admin_config, monkeypatch, step_s=0.05, steps=8)

    def create(name: str, **spec) -> None:
        body = {"image": "megascale:test", "nodes": 1, "devicesPerNode": 2, "deviceResource": "",
                "parallelism": {"dp": 2}, "policy": {"heartbeatSeconds": 0.5, "deadAfterSeconds": 8}, **spec}
        admin.custom.create_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs", {
            "apiVersion": "megascale.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name, "namespace": NS},
            "spec": body})

    def status(name: str) -> dict:
        return api.get("trainingjobs", name, NS, group="megascale.io").get("status") or {}

    def valid(name: str) -> dict:
        return next((c for c in status(name).get("conditions", []) if c["type"] == "Valid"), {})

    admin.core.create_namespaced_service(NS, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "clash"},
                                              "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]}})
    create("short", config={"inline": inline})
    create("missing", config={"configMapRef": {"name": "nowhere"}})
    create("clash", config={"inline": inline})
    earlier = tmp_path / "earlier-run"  # holds a committed checkpoint (its manifest is what commits it)
    (earlier / "step-00000004").mkdir(parents=True)
    (earlier / "step-00000004" / "manifest.json").write_text("{}")
    create("again", config={"inline": inline}, checkpoint={"uri": str(earlier)})
    create("perpod", config={"inline": inline}, checkpoint={"uri": "{run_dir}/checkpoints"})
    admin.core.create_namespaced_secret(NS, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "db"},
                                             "data": {"password": "aHVudGVyMg=="}})  # not labelled for jobs
    create("borrow", config={"inline": inline}, secrets=[{"name": "db"}])
    cluster = FakeCluster(api, ["m0", "m1"], tmp_path / "machines").start()
    operator = Running(operator_config, redis_url, kafka, tmp_path)
    try:
        done = wait_for(lambda: (s := status("short")).get("phase") == "Succeeded" and s, 60, "the job to finish")
        assert done["step"] == 8 and done["reason"] == "trained to step 8"
        assert {c["type"]: c["status"] for c in done["conditions"]}["Completed"] == "True"
        wait_for(lambda: not api.list("pods", NS), 30, "its pods to be deleted")
        assert valid("missing")["status"] == "False" and status("missing")["phase"] == "Pending"
        assert "spec.config.configMapRef.name='nowhere': no such ConfigMap" in valid("missing")["message"]
        assert "a Service megascale/clash exists that the megascale operator did not make" in valid("clash")["message"]
        assert api.get("services", "clash", NS)["spec"]["selector"] == {"app": "theirs"}  # left alone
        assert "already holds committed checkpoints (newest step 4) of an earlier run: set checkpoint.resume: " \
               "true" in valid("again")["message"] and status("again")["phase"] == "Pending"
        assert valid("perpod")["message"].startswith('spec.checkpoint.uri: "{run_dir}" is each pod\'s own emptyDir')
        assert valid("borrow")["message"].startswith("spec.secrets[0].name='db': the Secret is not labelled")
        assert not api.list("pods", NS, "megascale.io/job=borrow")

        finished = status("short")
        operator.stop()  # a new operator leaves the finished job alone: no driver, no pods
        operator = Running(operator_config, redis_url, kafka, tmp_path)
        wait_for(lambda: operator.operator.runtimes == {} and status("missing").get("reason"), 10, "a pass")
        admin.core.create_namespaced_config_map(NS, {"apiVersion": "v1", "kind": "ConfigMap",
                                                     "metadata": {"name": "nowhere"},
                                                     "data": {"config.yaml": yaml.safe_dump(inline)}})
        wait_for(lambda: status("missing").get("phase") == "Succeeded", 60, "the fixed job to run")
        wait_for(lambda: not api.list("pods", NS), 30, "its pods to be deleted")
        assert status("short") == finished and finished["nodes"][0]["host"] in ("m0", "m1")
    finally:
        operator.stop()
        cluster.stop()


def test_a_job_the_driver_paused_over_a_silent_node_is_evicted_and_resumed():
    """control.auto_recover: false makes the driver pause on a dead node and ask for `evict` + `resume`."""
    from megascale.driver.k8s.backend import K8sState
    from megascale.driver.k8s.operator import Runtime
    from megascale.driver.state import JobRecord, JobState, NodeSlot

    with EmbeddedRedis() as redis_server:
        store = JobStore.from_url(redis_server.url, f"{NS}.{JOB}")
        rec = JobRecord(job=store.job, config={}, run_dir="/r", state=JobState.PAUSED, reason="node n1 is dead")
        rec.nodes = [NodeSlot("n0", "active", 0, True), NodeSlot("n1", "active", 1, True, dead="no heartbeat"),
                     NodeSlot("n2", "spare", None, True)]
        running = {n: {"metadata": {"name": f"{JOB}-{n}"}, "spec": {"nodeName": f"m{n[1]}"},
                       "status": {"phase": "Running"}} for n in ("n0", "n1", "n2")}
        events = []

        class Events:  # what the operator tells the TrainingJob
            def create_event(self, cr, kind, reason, message):
                events.append((reason, message))

        operator = Operator(Events(), NS, ServiceDefaults())  # type: ignore[arg-type]
        rt = Runtime(NS, JOB, "uid", store, K8sState(store.r, store.job), redis_server.url, "k:1", False, {})
        spec = {"nodes": 2, "spares": 1, "paused": False}

        def cr(**change) -> dict:
            return {"metadata": {"name": JOB, "namespace": NS, "uid": "uid"}, "spec": {**spec, **change}}

        store.set_desired("paused")  # as the driver's recovery policy does
        evict_failed(operator, rt, cr(paused=True), rec, running, {}, set())
        assert store.evict_requests() == [] and store.desired() == "paused"  # the user paused it too: hands off
        evict_failed(operator, rt, cr(), rec, running, {}, set())
        assert store.evict_requests() == ["n1"] and store.desired() == "running"
        assert events == [("NoHeartbeat", "node n1: no heartbeat (no heartbeat)")]
