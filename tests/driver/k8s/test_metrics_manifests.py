"""deploy/: an in-cluster Prometheus reaches the drivers' /metrics in the operator's pod. The pod binds them to
its addresses and declares the port; the Service and the optional PodMonitor select that pod and port, and
keep the driver's `job` label; the kustomization applies without the Prometheus Operator's CRDs."""
from __future__ import annotations

from k8s_support import DEPLOY, load_yaml
from megascale.driver.metrics.prometheus import HOST_ENV


def operator_pod() -> dict:
    deployment = next(d for d in load_yaml(DEPLOY / "operator.yaml") if d["kind"] == "Deployment")
    return deployment["spec"]["template"]


def test_operator_pod_serves_metrics_on_its_addresses_at_a_declared_port():
    container = operator_pod()["spec"]["containers"][0]
    assert {e["name"]: e.get("value") for e in container["env"]}[HOST_ENV] == "0.0.0.0"
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"] == 9400


def test_metrics_service_and_podmonitor_select_the_operator_pod_and_its_metrics_port():
    pod_labels = operator_pod()["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for p in operator_pod()["spec"]["containers"][0]["ports"]}
    service = load_yaml(DEPLOY / "metrics.yaml")[0]
    assert service["kind"] == "Service" and service["spec"]["selector"].items() <= pod_labels.items()
    assert [(p["targetPort"], p["port"]) for p in service["spec"]["ports"]] == [("metrics", ports["metrics"])]

    monitor = load_yaml(DEPLOY / "monitoring/podmonitor.yaml")[0]
    # no schema offline for the Prometheus Operator's kinds (kubernetes-validate has none): checked by hand
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    endpoint, = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics" and endpoint["honorLabels"] is True


def test_kustomization_applies_without_the_prometheus_operator():
    kustomization = load_yaml(DEPLOY / "kustomization.yaml")[0]
    assert "metrics.yaml" in kustomization["resources"]
    assert not any(r.startswith("monitoring") for r in kustomization["resources"])
