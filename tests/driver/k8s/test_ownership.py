"""Ownership by UID: a TrainingJob deleted and created again under the same name, while its predecessor's
pods still terminate and the garbage collector has not yet come, never adopts what the predecessor left."""
from __future__ import annotations

import pytest
import redis
from k8s_support import NS, create_job
from megascale.driver.backend import NodeLaunch
from megascale.driver.k8s import spec
from megascale.driver.k8s.backend import K8sState, KubernetesBackend
from megascale.driver.k8s.kube import Kube, connect
from megascale.driver.k8s.ownership import Leftover
from megascale.driver.k8s.spec import PodPolicy

from megascale.common.embedded_redis import EmbeddedRedis

JOB = "gpt"
LAUNCH = NodeLaunch(job=f"{NS}.{JOB}", redis_url="redis://r:6379/0", kafka="k:9092", run_dir=spec.RUN_DIR,
                    heartbeat_s=5)


def test_a_recreated_job_never_adopts_its_predecessors_pods_or_objects(apiserver):
    api, admin_config, operator_config = apiserver
    api.gc, api.on_pod_delete = False, (lambda pod: True)  # the collector comes later; pods terminate slowly
    admin, kube = Kube(connect(admin_config)), Kube(connect(operator_config))

    def create() -> dict:
        create_job(admin_config, JOB, nodes=1, devicesPerNode=1, parallelism={"dp": 1})
        return api.get("trainingjobs", JOB, NS, group="megascale.io")

    old = create()
    kube.apply_owned("Service", NS, spec.service(old))
    kube.create_pod(NS, spec.pod(old, "n0", LAUNCH, []))
    api.update("pods", f"{JOB}-n0", NS, lambda p: (p["spec"].update(nodeName="m0"), p.update(status={
        "phase": "Running", "containerStatuses": [{"name": "executor", "state": {"running": {}}}]})))
    admin.custom.delete_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs", JOB)
    api.update("pods", f"{JOB}-n0", NS, lambda p: p["metadata"].update(deletionTimestamp="2026-01-01T00:00:00Z"))
    new = create()
    assert new["metadata"]["uid"] != old["metadata"]["uid"]

    with pytest.raises(Leftover, match="still belongs to a deleted TrainingJob"):
        kube.apply_owned("Service", NS, spec.service(new))
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        K8sState(client, LAUNCH.job).set_uid(new["metadata"]["uid"])
        backend = KubernetesBackend(kube, NS, JOB, LAUNCH, client, PodPolicy())
        backend.start(["n0"])  # 409: the old job's pod, read back and compared
        assert backend.list() == {} and "n0" in backend.unsent
        backend.stop(["n0"], grace_s=0)  # nothing of the old job's is touched either
        assert api.get("pods", f"{JOB}-n0", NS)["metadata"]["ownerReferences"][0]["uid"] == old["metadata"]["uid"]

        api.collect_garbage()
        api.remove("pods", f"{JOB}-n0", NS)  # the kubelet confirms the old pod's end
        assert api.get("services", JOB, NS) is None
        kube.apply_owned("Service", NS, spec.service(new))
        backend.start(["n0"])
        assert backend.list()["n0"].alive
        assert api.get("pods", f"{JOB}-n0", NS)["metadata"]["ownerReferences"][0]["uid"] == new["metadata"]["uid"]


def test_a_config_map_is_claimed_only_by_its_controllers_uid(apiserver):
    api, admin_config, operator_config = apiserver
    api.gc = False  # the collector comes later
    admin, kube = Kube(connect(admin_config)), Kube(connect(operator_config))

    def create() -> dict:
        create_job(admin_config, JOB, nodes=1, devicesPerNode=1, parallelism={"dp": 1})
        return api.get("trainingjobs", JOB, NS, group="megascale.io")

    def resolved(cr: dict) -> dict:
        return spec.config_map(cr, spec.job_config(cr, {}, spec.ServiceDefaults("redis://r:6379/0", "k:9092")))

    name = spec.config_map_name(JOB)
    old = create()
    kube.apply_owned("ConfigMap", NS, resolved(old))
    admin.custom.delete_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs", JOB)
    new = create()
    # the same name and labels, the predecessor's controller UID: not this job's, whatever else it carries
    api.update("configmaps", name, NS, lambda cm: cm["metadata"]["ownerReferences"].append(
        {**cm["metadata"]["ownerReferences"][0], "uid": new["metadata"]["uid"], "controller": False}))
    with pytest.raises(Leftover, match=f"ConfigMap {NS}/{name} still belongs to a deleted TrainingJob"):
        kube.apply_owned("ConfigMap", NS, resolved(new))
    assert api.get("configmaps", name, NS)["metadata"]["ownerReferences"][0]["uid"] == old["metadata"]["uid"]

    api.remove("configmaps", name, NS)  # collected
    kube.apply_owned("ConfigMap", NS, resolved(new))
    [ref] = api.get("configmaps", name, NS)["metadata"]["ownerReferences"]
    assert (ref["uid"], ref["controller"]) == (new["metadata"]["uid"], True)
    kube.apply_owned("ConfigMap", NS, resolved(new))  # its own: patched in place, no error
