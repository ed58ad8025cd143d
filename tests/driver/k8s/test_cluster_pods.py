"""Cluster-grade executor pods (hardware.py, spec.py): GPUs, RDMA and other extended resources, the host's network
as an explicit opt-in that keeps the container's hardening, a sized /dev/shm and a checkpoint volume, each
rendered into a pod that validates strictly; bad values refused in one line naming the field, by the CRD
schema or by the operator's spec check."""
from __future__ import annotations

import copy

import kubernetes_validate
import pytest
from k8s_support import DEPLOY, K8S_VERSION, NS, SYSTEM_NS, load_yaml
from megascale.driver.backend import NodeLaunch
from megascale.driver.k8s import hardware, spec
from megascale.driver.k8s.crd import crd
from megascale.driver.k8s.spec import PodPolicy, ServiceDefaults, SpecError, check_pod_spec
from schema_tools import Invalid, admit

SCHEMA = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
LAUNCH = NodeLaunch(job=f"{NS}.gpt-gpu-pool", redis_url="redis://r:6379/0", kafka="k:9092", run_dir=spec.RUN_DIR,
                    heartbeat_s=5)
DEFAULTS = ServiceDefaults("redis://r:6379/0", "k:9092")


def gpu_pool(**extra) -> dict:
    """deploy/examples/gpt-gpu-pool.yaml's TrainingJob as the API server stores it (defaults applied)."""
    cr = next(d for d in load_yaml(DEPLOY / "examples" / "gpt-gpu-pool.yaml") if d["kind"] == "TrainingJob")
    cr["spec"].update(extra)
    cr = admit(SCHEMA, cr)
    cr["metadata"]["uid"] = "00000000-0000-0000-0000-000000000002"
    return cr


def render(cr: dict) -> dict:
    check_pod_spec(cr["spec"], PodPolicy(), lambda name: None)
    pod = spec.pod(cr, "n0", LAUNCH, [])
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    return pod


def test_a_gpu_pool_pod_asks_for_its_devices_shared_memory_and_checkpoint_volume():
    cr = gpu_pool()
    pod = render(cr)
    body, container = pod["spec"], pod["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"memory": "1Ti", "nvidia.com/gpu": "8",
                                                "rdma/rdma_shared_device_a": "1"}
    shm = next(v for v in body["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    claim = {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "gpt-gpu-pool-checkpoints"}}
    assert claim in body["volumes"]
    assert {"name": "checkpoints", "mountPath": hardware.CHECKPOINT_MOUNT} in container["volumeMounts"]
    assert spec.job_config(cr, cr["spec"]["config"]["inline"], DEFAULTS).checkpoint.uri == hardware.CHECKPOINT_MOUNT
    assert (body["priorityClassName"], body["schedulerName"]) == ("training", "volcano")
    assert "hostNetwork" not in body  # the pod network unless the spec opts in
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    made = next(d for d in load_yaml(DEPLOY / "examples" / "gpt-gpu-pool.yaml") if d["kind"] != "TrainingJob")
    assert made["metadata"]["name"] == claim["persistentVolumeClaim"]["claimName"]  # the example makes its claim


def test_host_network_is_an_opt_in_that_keeps_the_containers_hardening():
    assert gpu_pool()["spec"]["hostNetwork"] is False  # the schema's default
    pod = render(gpu_pool(hostNetwork=True))
    body, container = pod["spec"], pod["spec"]["containers"][0]
    assert (body["hostNetwork"], body["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")  # Service names resolve
    assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                            "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}
    assert body["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert body["automountServiceAccountToken"] is False


def test_a_csi_volume_with_its_own_mount_path_holds_the_checkpoints():
    cr = gpu_pool()
    cr["spec"]["checkpoint"] = {"every": 100, "uri": "file:///mnt/ckpt/gpt", "volume": {
        "mountPath": "/mnt/ckpt", "csi": {"driver": "fsx.csi.aws.com", "volumeAttributes": {"fs": "fs-1"}}}}
    pod = render(cr)
    assert {"name": "checkpoints", "csi": {"driver": "fsx.csi.aws.com", "volumeAttributes": {"fs": "fs-1"}}} in \
        pod["spec"]["volumes"]
    assert spec.job_config(cr, cr["spec"]["config"]["inline"], DEFAULTS).checkpoint.uri == "file:///mnt/ckpt/gpt"


def test_the_podgroup_rbac_validates_and_binds_the_operator():
    docs = load_yaml(DEPLOY / "scheduling" / "rbac.yaml")
    for doc in docs:
        assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "megascale-operator", "namespace": SYSTEM_NS}]
    assert {d["metadata"]["namespace"] for d in docs} == {NS}


SCHEMA_REFUSALS = [
    ({"scheduling": "slurm"}, "spec.scheduling: 'slurm' is not one of"),
    ({"hostNetwork": "yes"}, "spec.hostNetwork: 'yes' is not of type 'boolean'"),
    ({"extendedResources": {"rdma/hca": 0}}, "spec.extendedResources.rdma/hca: 0 is less than the minimum of 1"),
    ({"queueName": "Team_A"}, "spec.queueName: 'Team_A' does not match"),
    ({"checkpoint": {"volume": {"persistentVolumeClaim": {"claimName": "c"}, "csi": {"driver": "d"}}}},
     "spec.checkpoint.volume"),
    ({"checkpoint": {"volume": {"csi": {"driver": "d", "nodePublishSecretRef": {"name": "db"}}}}},
     "('nodePublishSecretRef' was unexpected)"),
    ({"checkpoint": {"volume": {"mountPath": "ckpt", "persistentVolumeClaim": {"claimName": "c"}}}},
     "spec.checkpoint.volume.mountPath: 'ckpt' does not match"),
]


@pytest.mark.parametrize("change,message", SCHEMA_REFUSALS, ids=[str(c)[:40] for c, _ in SCHEMA_REFUSALS])
def test_the_schema_refuses_bad_pod_fields_naming_them(change, message):
    cr = next(d for d in load_yaml(DEPLOY / "examples" / "gpt-gpu-pool.yaml") if d["kind"] == "TrainingJob")
    cr["spec"].update(copy.deepcopy(change))
    with pytest.raises(Invalid) as e:
        admit(SCHEMA, cr)
    assert message in str(e.value) and "\n" not in str(e.value)


SPEC_REFUSALS = [
    ({"scheduling": "kueue", "queueName": None}, "spec.queueName: required with spec.scheduling=kueue"),
    ({"scheduling": "scheduler-plugins"}, "spec.queueName='training': only spec.scheduling=kueue"),
    ({"extendedResources": {"memory": 1}}, "spec.extendedResources['memory']: not an extended resource"),
    ({"extendedResources": {"kubernetes.io/x": 1}}, "spec.extendedResources['kubernetes.io/x']: the kubernetes.io"),
    ({"extendedResources": {"nvidia.com/gpu": 1}}, "spec.extendedResources['nvidia.com/gpu']: already requested"),
    ({"shmSize": "2Ti"}, "spec.shmSize=2Ti: more than spec.resources.limits.memory=1Ti"),
    ({"checkpoint": {"uri": "s3://bucket/gpt", "volume": {"persistentVolumeClaim": {"claimName": "c"}}}},
     "spec.checkpoint.uri='s3://bucket/gpt': not on spec.checkpoint.volume, mounted at /var/lib/megascale/checkpoints"),
    ({"checkpoint": {"volume": {"mountPath": "/etc", "persistentVolumeClaim": {"claimName": "c"}}}},
     "spec.checkpoint.volume.mountPath='/etc': overlaps /etc/megascale, the pod's job config"),
]


@pytest.mark.parametrize("change,message", SPEC_REFUSALS, ids=[str(c)[:40] for c, _ in SPEC_REFUSALS])
def test_the_operator_refuses_what_the_schema_cannot_see_in_one_line(change, message):
    cr = gpu_pool()
    cr["spec"].update(copy.deepcopy(change))
    cr["spec"] = {k: v for k, v in cr["spec"].items() if v is not None}
    with pytest.raises(SpecError) as e:
        check_pod_spec(cr["spec"], PodPolicy(), lambda name: None)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
