"""Attacks on a shared cluster, each refused: one job's credentials against another job's Redis keys (a real
Redis with ACLs), a spec that borrows Secrets or a service account, a job that aims cordons at machines;
and the executor pod's hardening."""
from __future__ import annotations

import copy

import pytest
import redis
from k8s_support import DEPLOY, NS, load_yaml
from megascale.driver.backend import NodeLaunch
from megascale.driver.k8s import credentials, spec
from megascale.driver.k8s.backend import K8sState, KubernetesBackend
from megascale.driver.k8s.crd import crd
from megascale.driver.k8s.kube import Kube, connect
from megascale.driver.k8s.operator import Operator, Runtime
from megascale.driver.k8s.spec import PodPolicy, ServiceDefaults, SpecError, check_pod_spec
from megascale.driver.recovery_record import Fault, Recovery
from megascale.driver.state import JobRecord, JobStore, NodeSlot
from schema_tools import Invalid, admit

from megascale.common.messages import command_stream
from megascale.common.embedded_redis import EmbeddedRedis
from megascale.rendezvous.redis_store import namespace

SCHEMA = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
LAUNCH = NodeLaunch(job=f"{NS}.gpt-nodes", redis_url="redis://operator:admin-password@redis:6379/0", kafka="k:9092",
                    run_dir=spec.RUN_DIR, heartbeat_s=5)


def example() -> dict:
    cr = next(d for d in load_yaml(DEPLOY / "examples" / "gpt-nodes.yaml") if d["kind"] == "TrainingJob")
    cr["metadata"]["uid"] = "uid-1"
    return cr


# -- 3. per-job credentials --------------------------------------------------------------------

def test_another_jobs_credentials_cannot_touch_this_jobs_keys():
    victim, attacker = f"{NS}.gpt", f"{NS}.gpt2"  # a name that extends the victim's: prefixes must not leak
    with EmbeddedRedis() as server:  # its default user stands for the operator's admin login
        admin = redis.Redis.from_url(server.url)
        secrets = {job: credentials.new_secrets(job) for job in (victim, attacker)}
        for job, found in secrets.items():
            credentials.ensure_redis_user(admin, job, found.redis_password)

        def login(job: str) -> redis.Redis:
            return redis.Redis.from_url(server.url, **secrets[job].redis_auth(server.url))

        mine, theirs = login(victim), login(attacker)
        mine.xadd(command_stream(victim, "n0"), {"msg": "start"})  # the job's own keys work
        mine.set(namespace(victim, 1) + "k:rank0", "addr")
        theirs.xadd(command_stream(attacker, "n0"), {"msg": "start"})
        for attack in (lambda: theirs.xadd(command_stream(victim, "n0"), {"msg": "stop"}),
                       lambda: theirs.get(namespace(victim, 1) + "k:rank0"),
                       lambda: theirs.eval("return redis.call('XADD', KEYS[1], '*', 'msg', 'stop')", 1,
                                           command_stream(victim, "n0")),
                       lambda: theirs.config_set("dir", "/tmp"),
                       lambda: theirs.keys("*"),
                       lambda: theirs.execute_command("ACL", "SETUSER", "me", "on", "~*", "+@all")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attack()
        assert admin.xlen(command_stream(victim, "n0")) == 1  # nothing written
        credentials.drop_redis_user(admin, victim)  # the job was deleted: its login goes with it
        with pytest.raises(redis.exceptions.AuthenticationError):
            login(victim).ping()


def test_credentials_reach_pods_as_a_file_only():
    cr = example()
    pod = spec.pod(cr, "n0", LAUNCH, [])
    container = pod["spec"]["containers"][0]
    printed = str(container["args"]) + str(container["env"])  # what `kubectl describe pod` shows
    assert "admin-password" not in printed and "operator" not in container["args"][container["args"].index(
        "--redis") + 1]
    assert {"name": "MEGASCALE_SECRETS", "value": f"{spec.CREDENTIALS_DIR}/secrets.json"} in container["env"]
    assert {"name": "credentials", "secret": {"secretName": "gpt-nodes-credentials", "defaultMode": 0o444}} in \
        pod["spec"]["volumes"]
    found = credentials.new_secrets(f"{NS}.gpt-nodes")
    obj = credentials.secret(cr, found)
    assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-1"  # deleted with the job
    assert credentials.read_secret(obj, f"{NS}.gpt-nodes") == found
    assert credentials.read_secret(obj, f"{NS}.other") is None  # another job's Secret is not taken over


# -- 4. pod spec passthrough ---------------------------------------------------------------------

@pytest.mark.parametrize("source", ["secretKeyRef", "configMapKeyRef"])
def test_env_from_a_secret_is_refused_by_the_schema_and_the_operator(source):
    cr = example()
    cr["spec"]["env"] = [{"name": "OK", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                         {"name": "TOKEN", "valueFrom": {source: {"name": "db", "key": "password"}}}]
    # Refused either way a real API server sees it: as an unknown field (strict validation, kubectl's default)
    # or, once pruned, for the missing fieldRef.
    with pytest.raises(Invalid, match=r"^spec.env.1.valueFrom: 'fieldRef' is a required property"):
        admit(SCHEMA, cr)
    with pytest.raises(SpecError, match=rf"^spec.env\[1\].valueFrom.{source}: env values are literal or fieldRef"):
        check_pod_spec(cr["spec"], PodPolicy(), lambda name: None)


def test_only_secrets_labelled_for_jobs_are_mounted():
    cr = example()
    cr["spec"]["secrets"] = [{"name": "wandb"}, {"name": "db"}]
    labels = {"wandb": {spec.ALLOW_JOBS_LABEL: "true"}, "db": {"team": "data"}}
    with pytest.raises(SpecError, match=r"^spec.secrets\[1\].name='db': the Secret is not labelled "
                                        r"megascale.io/allow-jobs=\"true\""):
        check_pod_spec(cr["spec"], PodPolicy(), labels.get)
    with pytest.raises(SpecError, match=r"spec.secrets\[1\].name='db': no such Secret"):
        check_pod_spec(cr["spec"], PodPolicy(), {"wandb": labels["wandb"]}.get)
    cr["spec"]["secrets"] = [{"name": "wandb"}]
    check_pod_spec(cr["spec"], PodPolicy(), labels.get)
    pod = spec.pod(cr, "n0", LAUNCH, [])
    assert {"name": "secret-0", "mountPath": f"{spec.SECRETS_DIR}/wandb", "readOnly": True} in \
        pod["spec"]["containers"][0]["volumeMounts"]


def test_an_unlisted_service_account_is_refused():
    cr = example()
    cr["spec"]["serviceAccountName"] = "cluster-admin-ish"
    with pytest.raises(SpecError, match=r"^spec.serviceAccountName='cluster-admin-ish': not allowed by the "
                                        r"operator \(allowed: trainer;"):
        check_pod_spec(cr["spec"], PodPolicy(frozenset({"trainer"})), lambda name: None)
    check_pod_spec(cr["spec"], PodPolicy(frozenset({"cluster-admin-ish"})), lambda name: None)


def test_a_spec_changed_after_adoption_is_checked_again_when_pods_are_created(apiserver):
    api, admin_config, operator_config = apiserver
    admin = Kube(connect(admin_config))
    admin.apply_crd(crd())
    cr = example()
    del cr["metadata"]["uid"]
    cr["spec"]["serviceAccountName"] = "deployer"  # the schema takes any name: the operator's list decides
    admin.custom.create_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs", cr)
    with EmbeddedRedis() as server:
        backend = KubernetesBackend(Kube(connect(operator_config)), NS, "gpt-nodes", LAUNCH,
                                    redis.Redis.from_url(server.url), PodPolicy())
        backend.start(["n0"])
        assert api.list("pods", NS) == []
        backend.policy = PodPolicy(frozenset({"deployer"}))
        backend.start(["n0"])
        assert [p["spec"]["serviceAccountName"] for p in api.list("pods", NS)] == ["deployer"]


def test_machines_are_cordoned_only_after_a_failed_self_check_within_budget_and_pool(apiserver):
    api, _, operator_config = apiserver
    pool = {"megascale.io/pool": "train"}
    for name, labels in (("m1", pool), ("m2", pool), ("m3", pool), ("m4", {"megascale.io/pool": "other"})):
        api.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}, "spec": {}})
    machines = {m["metadata"]["name"]: m for m in api.list("nodes")}
    with EmbeddedRedis() as server:
        store = JobStore.from_url(server.url, f"{NS}.gpt")
        state = K8sState(store.r, store.job)
        rec = JobRecord(job=store.job, config={}, run_dir="/r")
        rec.nodes = [NodeSlot(f"n{i}", "evicted", None, True) for i in range(1, 6)]
        for i, host in enumerate(("m1", "m2", "m3", "m4", "m3"), start=1):
            state.add_evicted_node(f"n{i}", host)
        rec.recovery = Recovery(Fault("rank_failed", "n1", "rank 2 exited"), None, bad={
            "n1": "self-check failed: gemm", "n2": "self-check failed: nccl",  # the budget allows one of these
            "n4": "self-check failed: gemm",  # outside the operator's node pool
            "n5": "straggler"})  # n3 was evicted for its pod failing, n5 for being slow: no self-check failed
        operator = Operator(Kube(connect(operator_config)), NS, ServiceDefaults(), node_pool=pool)
        rt = Runtime(NS, "gpt", "uid", store, state, server.url, "k:1", False, {})
        job_spec = {"cordonBudget": 1}
        for _ in range(2):  # a second pass changes nothing: the budget is spent
            operator._cordon(rt, job_spec, rec, machines)
        cordoned = {m["metadata"]["name"] for m in api.list("nodes") if m["spec"].get("unschedulable")}
        assert cordoned == {"m1"} and set(state.cordoned()) == {"m1"}
        assert "self-check failed: gemm" in api.get("nodes", "m1")["metadata"]["annotations"]["megascale.io/evicted"]
        operator._cordon(rt, {"cordonBudget": 2}, rec, machines)
        assert {m["metadata"]["name"] for m in api.list("nodes") if m["spec"].get("unschedulable")} == {"m1", "m2"}


# -- 5. pod hardening ------------------------------------------------------------------------------

def test_executor_pods_are_hardened():
    cr = example()
    pod = spec.pod(cr, "n0", LAUNCH, [])
    body, container = pod["spec"], pod["spec"]["containers"][0]
    assert body["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    shm = next(v for v in body["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": spec.SHM_SIZE}
    rdma = copy.deepcopy(cr)
    rdma["spec"].update(rdma=True, runAsNonRoot=True, shmSize="64Gi")
    pod = spec.pod(rdma, "n0", LAUNCH, [])
    assert pod["spec"]["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert next(v for v in pod["spec"]["volumes"] if v["name"] == "shm")["emptyDir"]["sizeLimit"] == "64Gi"
    stored = admit(SCHEMA, example())["spec"]  # the schema's defaults are the pod's
    assert (stored["rdma"], stored["runAsNonRoot"], stored["shmSize"], stored["cordonBudget"]) == (
        False, False, spec.SHM_SIZE, 1)
