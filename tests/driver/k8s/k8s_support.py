"""Helpers the Kubernetes tests share (conftest.py holds the fixtures)."""
from __future__ import annotations

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


from service_fixtures import wait_for  # noqa: E402,F401 - one polling helper for every suite
