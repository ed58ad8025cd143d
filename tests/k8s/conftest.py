"""Shared pieces of the Kubernetes tests: the stand-in API server with users and RBAC, clients,
and a check that no process a test started outlives it (found by a per-test environment tag)."""
from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))  # the stand-ins, under --import-mode=importlib

from fake_apiserver import FakeApiServer, kubeconfig  # noqa: E402
from k8s_support import DEPLOY, NS, OPERATOR_USER, load_yaml  # noqa: E402

from service_fixtures import TAG, tagged  # noqa: E402 - one leak check for every suite


@pytest.fixture(autouse=True)
def no_leftovers(monkeypatch):
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG, tag)
    yield
    deadline = time.monotonic() + 15
    while (left := tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for proc in left:
        proc.kill()  # ours by tag: clean up so one failure does not poison the next test
    assert not left, f"processes left behind: {[' '.join(p.cmdline()[:4]) for p in left]}"


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

