"""The objects the operator applies when it adopts a job (its ConfigMap, Service, Secret, NetworkPolicy) refused
by the API server (a ResourceQuota's 403, a 422): the FailedCreateObject condition and a Warning Event on the
TrainingJob, with the API's message; the operator stays up, tries again on later passes, and adopts the job
once the refusal lifts."""
from __future__ import annotations

import threading
import time

from k8s_support import NS, SYSTEM_NS, wait_for
from megascale.driver.k8s.crd import crd
from megascale.driver.k8s.kube import Kube, connect
from megascale.driver.k8s.leader import LeaseConfig
from megascale.driver.k8s.operator import Operator
from megascale.driver.k8s.spec import ServiceDefaults
from megascale.driver.services import EmbeddedKafka

from megascale.common.embedded_redis import EmbeddedRedis

QUOTA = ('configmaps "gpt-resolved-config" is forbidden: exceeded quota: objects, requested: count/configmaps=1, '
         'used: count/configmaps=10, limited: count/configmaps=10')
INVALID = ('NetworkPolicy.networking.k8s.io "web-pods" is invalid: spec.ingress[0].from[0]: Invalid value: '
           'a policy admission webhook refuses it')


def test_refused_objects_at_adoption_are_a_condition_and_an_event_and_retried(apiserver, tmp_path):
    api, admin_config, operator_config = apiserver
    admin = Kube(connect(admin_config))
    admin.apply_crd(crd())

    def create(name: str) -> str:
        admin.custom.create_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs", {
            "apiVersion": "megascale.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name, "namespace": NS},
            "spec": {"image": "megascale:test", "nodes": 1, "devicesPerNode": 1, "deviceResource": "",
                     "parallelism": {"dp": 1}, "config": {"inline": {}}}})
        return api.get("trainingjobs", name, NS, group="megascale.io")["metadata"]["uid"]

    def condition(name: str) -> dict:
        status = api.get("trainingjobs", name, NS, group="megascale.io").get("status") or {}
        return {c["type"]: c for c in status.get("conditions") or []}.get("FailedCreateObject") or {}

    def events(name: str) -> list[dict]:
        return [e for e in api.list("events", NS) if e["involvedObject"]["name"] == name]

    def refusals(plural: str) -> int:
        return sum(1 for r in api.requests if r[1] == "create" and r[3] == plural and r[-1] in (403, 422))

    api.fail("create", "configmaps", 403, times=10**6, message=QUOTA)
    uid = create("gpt")
    kafka = EmbeddedKafka().start()
    try:
        with EmbeddedRedis() as redis_server:
            operator = Operator(Kube(connect(operator_config)), NS, ServiceDefaults(redis_server.url, kafka.bootstrap),
                                kubeconfig=operator_config, tick_s=0.2, status_every_s=0.5, driver_log=tmp_path,
                                run_dir=str(tmp_path / "run"),
                                lease=LeaseConfig(namespace=SYSTEM_NS, identity="op", lease_s=2, renew_deadline_s=1.2,
                                                  retry_s=0.25))
            thread = threading.Thread(target=operator.run, daemon=True)
            thread.start()
            try:
                cond = wait_for(lambda: condition("gpt").get("status") == "True" and condition("gpt"), 30,
                                "the refusal to reach the status")
                assert cond["reason"] == "FailedCreateConfigMap" and QUOTA in cond["message"]
                [event] = wait_for(lambda: events("gpt"), 10, "the Event")
                assert (event["type"], event["reason"], event["involvedObject"]["uid"]) == (
                    "Warning", "FailedCreateConfigMap", uid) and QUOTA in event["message"]
                tried = refusals("configmaps")
                time.sleep(1.0)
                assert refusals("configmaps") > tried and thread.is_alive()  # tried again; told once
                assert len(events("gpt")) == 1 and operator.runtimes == {}

                api.faults.clear()  # the quota has room again: adopted, the condition goes False
                wait_for(lambda: condition("gpt").get("status") == "False", 30, "the job to be adopted")
                assert api.get("configmaps", "gpt-resolved-config", NS) is not None

                api.fail("create", "networkpolicies", 422, times=10**6, message=INVALID)
                create("web")
                cond = wait_for(lambda: condition("web").get("status") == "True" and condition("web"), 30,
                                "the second refusal to reach the status")
                assert cond["reason"] == "FailedCreateNetworkPolicy" and INVALID in cond["message"]
                assert [e["reason"] for e in wait_for(lambda: events("web"), 10, "the Event")] == [
                    "FailedCreateNetworkPolicy"]
                assert condition("gpt")["status"] == "False" and thread.is_alive()  # the other job carries on
                api.faults.clear()
                wait_for(lambda: condition("web").get("status") == "False", 30, "the second job to be adopted")
            finally:
                operator.stop()
                thread.join(timeout=30)
            assert not thread.is_alive()
    finally:
        kafka.stop(kill=True)
