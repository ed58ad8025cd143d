"""Shared pieces of the Kubernetes tests: the stand-in API server with users and RBAC, clients,
and a check that no process a test started outlives it (found by a per-test environment tag)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))  # the stand-ins, under --import-mode=importlib

from fake_apiserver import FakeApiServer, kubeconfig  # noqa: E402
from k8s_support import DEPLOY, NS, OPERATOR_USER, load_yaml  # noqa: E402
from service_fixtures import no_process_left  # noqa: E402 - one leak check for every suite


@pytest.fixture(autouse=True)
def no_leftovers(monkeypatch):
    with no_process_left(monkeypatch):
        yield


@pytest.fixture
def apiserver(tmp_path):
    """The stand-in with an admin ("you", with kubectl) and the operator's service account, limited to
    deploy/rbac.yaml. Yields (server, admin kubeconfig path, operator kubeconfig path)."""
    api = FakeApiServer().start()
    api.add_user("admin-token", "kubernetes-admin", admin=True)
    api.add_user("operator-token", OPERATOR_USER)
    api.load_rbac(load_yaml(DEPLOY / "rbac.yaml"))
    paths = []
    for who, token in (("admin", "admin-token"), ("operator", "operator-token")):
        path = tmp_path / f"{who}.kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig(api.url, token, namespace=NS)))
        paths.append(str(path))
    yield api, paths[0], paths[1]
    api.stop()

