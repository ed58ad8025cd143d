"""Helpers the Kubernetes tests share (conftest.py holds the fixtures)."""
from __future__ import annotations

import contextlib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.30.0"  # manifests are validated against this Kubernetes release's schemas
NS = "megascale"
OPERATOR_USER = "system:serviceaccount:megascale-system:megascale-operator"
SYSTEM_NS = "megascale-system"  # the operator's own namespace (deploy/namespace.yaml)


def load_yaml(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def sim_jobs(admin_config: str, monkeypatch, step_s: float, steps: int):
    """For end-to-end tests with stand-in ranks (driver/sim_rank.py, a step every `step_s`): an admin client
    with the CRD applied, and an inline job config of a tiny model trained `steps` steps."""
    from megascale.driver import sim_rank
    from megascale.driver.k8s.crd import crd
    from megascale.driver.k8s.kube import Kube, connect
    monkeypatch.setenv("MEGASCALE_RANK_ENTRY", sim_rank.__file__)
    monkeypatch.setenv("SIM_STEP_S", str(step_s))
    admin = Kube(connect(admin_config))
    admin.apply_crd(crd())
    inline = {"model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
              "batch": {"micro": 1, "global": 2}, "train": {"steps": steps}}
    return admin, inline


def create_job(admin_config: str, name: str, **spec) -> None:
    """Applies the CRD as the admin and creates TrainingJob `name` in NS: image megascale:test, an empty inline
    config, and `spec` on top."""
    from megascale.driver.k8s.crd import crd
    from megascale.driver.k8s.kube import Kube, connect
    admin = Kube(connect(admin_config))
    admin.apply_crd(crd())
    admin.custom.create_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs", {
        "apiVersion": "megascale.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name, "namespace": NS},
        "spec": {"image": "megascale:test", "config": {"inline": {}}, **spec}})


def running_pods(api, cr: dict, launch, count: int) -> None:
    """Ready machines m0..m<count-1>, each running the job's executor pod n<i> (as the kubelet reports it)."""
    from megascale.driver.k8s import spec
    job = cr["metadata"]["name"]
    for i in range(count):
        api.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"m{i}"}, "spec": {},
                 "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
        api.put(spec.pod(cr, f"n{i}", launch, []))
        api.update("pods", f"{job}-n{i}", NS, lambda p, i=i: (p["spec"].update(nodeName=f"m{i}"), p.update(status={
            "phase": "Running", "containerStatuses": [{"name": "executor", "state": {"running": {}}}]})))


@contextlib.contextmanager
def operator_runtime(cr: dict, operator_config: str, active: int, spares: int):
    """An operator and the job's runtime on an embedded Redis, the driver's record holding `active` active nodes
    n0.. then `spares` spares: (operator, runtime, record)."""
    from megascale.driver.k8s.backend import K8sState
    from megascale.driver.k8s.kube import Kube, connect
    from megascale.driver.k8s.operator import Operator, Runtime
    from megascale.driver.k8s.spec import ServiceDefaults
    from megascale.driver.state import JobRecord, JobStore, NodeSlot
    from megascale.common.embedded_redis import EmbeddedRedis
    job = cr["metadata"]["name"]
    with EmbeddedRedis() as server:
        store = JobStore.from_url(server.url, f"{NS}.{job}")
        state = K8sState(store.r, store.job)
        state.set_uid(cr["metadata"]["uid"])
        rec = JobRecord(job=store.job, config={}, run_dir="/r")
        rec.nodes = [NodeSlot(f"n{i}", "active", i, True) for i in range(active)] + [
            NodeSlot(f"n{i}", "spare", None, True) for i in range(active, active + spares)]
        operator = Operator(Kube(connect(operator_config)), NS, ServiceDefaults(), missing_grace_s=0)
        yield operator, Runtime(NS, job, cr["metadata"]["uid"], store, state, server.url, "k:1", False, {}), rec


from service_fixtures import wait_for  # noqa: E402,F401 - one polling helper for every suite
