"""Helpers the Kubernetes tests share (conftest.py holds the fixtures)."""
from __future__ import annotations

import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.30.0"  # manifests are validated against this Kubernetes release's schemas
NS = "megascale"
OPERATOR_USER = "system:serviceaccount:megascale:megascale-operator"


def load_yaml(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def wait_for(predicate, timeout: float, what: str, every: float = 0.1):
    """The predicate's first truthy value, or a failure naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
