"""`megascale kube ...` against the stand-in: the CRD, pause/resume as the same merge patch kubectl
sends, status, and one-line errors."""
from __future__ import annotations

import argparse
import json

import pytest
from k8s_support import DEPLOY, NS
from megascale.driver.k8s.cli import register, request
from megascale.driver.k8s.kube import Kube, connect


def megascale(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="megascale")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def job(name: str) -> dict:
    return {"apiVersion": "megascale.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name, "namespace": NS},
            "spec": {"image": "i", "nodes": 2, "devicesPerNode": 1, "parallelism": {"dp": 2}, "config": {"inline": {}}}}


@pytest.fixture
def cluster(apiserver, capsys):
    api, admin, _ = apiserver
    assert megascale("kube", "apply-crd", "--kubeconfig", admin) == 0
    assert capsys.readouterr().out == "customresourcedefinition trainingjobs.megascale.io created\n"
    kube = Kube(connect(admin))
    kube.custom.create_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs", job("j1"))
    return api, admin


def test_apply_crd_prints_and_replaces(cluster, capsys):
    _, admin = cluster
    assert megascale("kube", "apply-crd", "--print") == 0
    assert capsys.readouterr().out == (DEPLOY / "crd.yaml").read_text()
    assert megascale("kube", "apply-crd", "--kubeconfig", admin) == 0
    assert "replaced" in capsys.readouterr().out


def test_pause_and_resume_patch_the_spec_like_kubectl(cluster, capsys):
    api, admin = cluster
    assert megascale("kube", "pause", "j1", "--kubeconfig", admin) == 0
    assert capsys.readouterr().out == "pause requested for TrainingJob megascale/j1 (now Pending)\n"
    stored = api.get("trainingjobs", "j1", NS, group="megascale.io")
    assert stored["spec"]["paused"] is True and stored["metadata"]["generation"] == 2
    assert ("kubernetes-admin", "patch", "megascale.io", "trainingjobs", NS, 200) in api.requests
    assert megascale("kube", "resume", "j1", "--kubeconfig", admin, "-n", NS) == 0
    assert api.get("trainingjobs", "j1", NS, group="megascale.io")["spec"]["paused"] is False
    # what `megascale pause --kube NAMESPACE/NAME` calls
    assert request(f"{NS}/j1", True, kubeconfig=admin) == "pause requested for TrainingJob megascale/j1 (now Pending)"
    assert api.get("trainingjobs", "j1", NS, group="megascale.io")["spec"]["paused"] is True


def test_status_lists_and_describes(cluster, capsys):
    api, admin = cluster
    Kube(connect(admin)).patch_job_status(NS, "j1", {
        "phase": "Running", "step": 12, "totalSteps": 100, "loss": 2.5, "restarts": 1, "incarnation": 2, "ettr": 0.9,
        "evictedNodes": ["m1"], "nodes": [{"id": "n0", "role": "active", "pod": "j1-n0", "host": "m0", "alive": True},
                                          {"id": "n1", "role": "evicted", "pod": "j1-n1"}],
        "conditions": [{"type": "Running", "status": "True", "reason": "Running", "message": "incarnation 2 started"}]})
    assert megascale("kube", "status", "--kubeconfig", admin) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "PHASE", "STEP", "LOSS", "RESTARTS", "ETTR", "NODES"]
    assert lines[1].split() == ["j1", "Running", "12", "2.5", "1", "0.900", "2"]
    assert megascale("kube", "status", "j1", "--kubeconfig", admin) == 0
    out = capsys.readouterr().out
    assert "megascale/j1  Running  step 12/100  loss 2.5  restarts 1  incarnation 2  ETTR 0.900" in out
    assert "n0    active   pod j1-n0 on m0  alive" in out and "evicted machines: m1" in out
    assert "Running=True: incarnation 2 started" in out
    assert megascale("kube", "status", "j1", "--json", "--kubeconfig", admin) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 12


def test_errors_are_one_line(cluster, capsys, tmp_path):
    api, admin = cluster
    assert megascale("kube", "pause", "nope", "--kubeconfig", admin) == 2
    assert capsys.readouterr().err == ("megascale kube pause: no TrainingJob named 'nope' in namespace 'megascale' "
                                       "(there: j1)\n")
    Kube(connect(admin)).patch_job_status(NS, "j1", {"phase": "Succeeded"})
    assert megascale("kube", "resume", "j1", "--kubeconfig", admin) == 2
    assert capsys.readouterr().err == "megascale kube resume: TrainingJob megascale/j1 has ended (Succeeded)\n"
    assert megascale("kube", "status", "--kubeconfig", str(tmp_path / "missing")) == 2
    assert capsys.readouterr().err.startswith("megascale kube status: no Kubernetes configuration (")
    unreachable = (tmp_path / "admin.kubeconfig").read_text().replace(api.url, "http://127.0.0.1:9")
    (tmp_path / "down.kubeconfig").write_text(unreachable)
    assert megascale("kube", "status", "--kubeconfig", str(tmp_path / "down.kubeconfig")) == 2
    assert capsys.readouterr().err.startswith("megascale kube status: cannot reach the Kubernetes API server")


def test_operator_settings_that_make_no_sense_are_one_line(capsys):
    assert megascale("kube", "operator", "--node-pool", "megascale.io/pool") == 2
    assert capsys.readouterr().err == "megascale kube operator: --node-pool: expected KEY=VALUE labels, got " \
                                      "megascale.io/pool\n"
