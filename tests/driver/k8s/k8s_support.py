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


from service_fixtures import wait_for  # noqa: E402,F401 - one polling helper for every suite
