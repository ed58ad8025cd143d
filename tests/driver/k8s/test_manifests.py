"""deploy/ offline: every built-in object validates strictly against the pinned Kubernetes release
(kubernetes-validate), the kustomization holds together (and builds, where kubectl is installed),
the pieces name each other consistently, and the objects the operator creates validate too."""
from __future__ import annotations

import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml
from k8s_support import DEPLOY, K8S_VERSION, NS, SYSTEM_NS, load_yaml
from megascale.driver.backend import NodeLaunch
from megascale.driver.k8s import credentials
from megascale.driver.k8s import spec as k8s_spec
from megascale.driver.k8s.crd import crd

MANIFESTS = sorted(DEPLOY.glob("*.yaml")) + sorted((DEPLOY / "examples").glob("*.yaml"))


def builtin(doc: dict) -> bool:
    return doc["kind"] not in ("TrainingJob", "Kustomization")


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.relative_to(DEPLOY).as_posix() for p in MANIFESTS])
def test_manifest_validates_strictly(path):
    docs = [d for d in load_yaml(path) if builtin(d)]
    for doc in docs:
        assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True), doc["metadata"]["name"]
        assert doc["kind"] in ("Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding") \
            or doc["metadata"]["namespace"] in (NS, SYSTEM_NS), f"{doc['kind']} {doc['metadata']['name']}: namespace"


def test_kustomization_resources_and_generated_dashboard():
    kustomization = load_yaml(DEPLOY / "kustomization.yaml")[0]
    assert all((DEPLOY / r).is_file() for r in kustomization["resources"])
    assert {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"} == set(kustomization["resources"])
    for generator in kustomization["configMapGenerator"]:
        assert all((DEPLOY / f).is_file() for f in generator["files"])
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed: `kubectl kustomize deploy/` not built here (the parts were checked)")
    built = subprocess.run(["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    dashboard = next(d for d in docs if d["metadata"]["name"] == "megascale-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "megascale-dashboard.json" in dashboard["data"]
    assert {d["kind"] for d in docs} >= {"CustomResourceDefinition", "Deployment", "Role", "ClusterRole"}


def test_operator_deployment_matches_its_account_and_settings():
    rbac = load_yaml(DEPLOY / "rbac.yaml")
    deployment = next(d for d in load_yaml(DEPLOY / "operator.yaml") if d["kind"] == "Deployment")
    services = load_yaml(DEPLOY / "services.yaml")[0]
    pod = deployment["spec"]["template"]["spec"]
    account = next(d for d in rbac if d["kind"] == "ServiceAccount")
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert deployment["metadata"]["namespace"] == account["metadata"]["namespace"] == SYSTEM_NS
    for binding in (d for d in rbac if d["kind"].endswith("Binding")):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                        "namespace": SYSTEM_NS}]
    assert {(d["kind"], d["metadata"]["namespace"]) for d in rbac if d["kind"] in ("Role", "RoleBinding")} == {
        (kind, ns) for kind in ("Role", "RoleBinding") for ns in (NS, SYSTEM_NS)}  # SYSTEM_NS: the Lease only
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    refs = [e["valueFrom"]["configMapKeyRef"] for e in env.values() if "configMapKeyRef" in e.get("valueFrom", {})]
    assert {(r["name"], r["key"]) for r in refs} == {(services["metadata"]["name"], k) for k in services["data"]}
    assert env["WATCH_NAMESPACE"]["value"] == NS  # the jobs' namespace, not its own
    assert "secretKeyRef" in env["MEGASCALE_REDIS"]["valueFrom"]  # the admin URL: never a ConfigMap value
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    assert pod["containers"][0]["command"] == ["megascale", "kube", "operator"]


def test_namespaces_enforce_pod_security_and_executors_reach_only_the_services():
    levels = {d["metadata"]["name"]: d["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
              for d in load_yaml(DEPLOY / "namespace.yaml")}
    assert levels == {SYSTEM_NS: "restricted", NS: "baseline"}
    policy = load_yaml(DEPLOY / "networkpolicy.yaml")[0]
    assert policy["metadata"]["namespace"] == NS and policy["spec"]["ingress"] == []
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "executor"
    reached = {(*rule["to"][0]["podSelector"]["matchLabels"].values(), port["port"])
               for rule in policy["spec"]["egress"] for port in rule["ports"]}
    assert reached == {("redis", 6379), ("kafka", 9092), ("kube-dns", 53)}
    operator = next(d for d in load_yaml(DEPLOY / "operator.yaml") if d["kind"] == "Deployment")["spec"]["template"]
    pod_level, container = operator["spec"]["securityContext"], operator["spec"]["containers"][0]["securityContext"]
    assert pod_level["runAsNonRoot"] and pod_level["seccompProfile"]["type"] == "RuntimeDefault"  # restricted's terms
    assert container["capabilities"]["drop"] == ["ALL"] and container["allowPrivilegeEscalation"] is False


def test_objects_the_operator_creates_validate_strictly():
    cr = next(d for d in load_yaml(DEPLOY / "examples" / "gpt-nodes.yaml") if d["kind"] == "TrainingJob")
    cr["metadata"]["uid"] = "00000000-0000-0000-0000-000000000001"
    launch = NodeLaunch(job=f"{NS}.gpt-nodes", redis_url="redis://r:6379", kafka="k:9092", run_dir=k8s_spec.RUN_DIR,
                        heartbeat_s=5)
    cfg = k8s_spec.job_config(cr, cr["spec"]["config"]["inline"], k8s_spec.ServiceDefaults("redis://r:6379", "k:9092"))
    hardened = {**cr, "spec": {**cr["spec"], "rdma": True, "runAsNonRoot": True, "secrets": [{"name": "wandb"}]}}
    for obj in (k8s_spec.pod(cr, "n3", launch, ["bad-1", "bad-0"]), k8s_spec.pod(cr, "n0", launch, []),
                k8s_spec.pod(hardened, "n1", launch, []), k8s_spec.service(cr), k8s_spec.config_map(cr, cfg), crd(),
                credentials.secret(cr, credentials.new_secrets(f"{NS}.gpt-nodes")), credentials.network_policy(cr)):
        assert kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
