"""A TrainingJob naming code as its checkpoint.filesystem (`os:system`, `evil.py:make`) is refused in
one line: by the CRD's schema at admission (`kubectl apply`), and by the operator for a config that
admission never saw (a ConfigMap's YAML). The function is never called."""
from __future__ import annotations

import copy

import pytest
import yaml
from k8s_support import DEPLOY, load_yaml
from megascale.driver.k8s.crd import crd
from megascale.driver.k8s.spec import ServiceDefaults, SpecError, base_config, job_config
from schema_tools import Invalid, admit

SCHEMA = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def trainingjob(checkpoint: dict | None = None, config_map: bool = False) -> dict:
    job = copy.deepcopy(next(d for d in load_yaml(DEPLOY / "examples" / "gpt-nodes.yaml")
                             if d["kind"] == "TrainingJob"))
    job["metadata"].setdefault("uid", "u1")
    job["spec"]["config"] = {"configMapRef": {"name": "job"}} if config_map else {"inline": {"checkpoint": checkpoint}}
    return job


@pytest.fixture
def evil(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.py"
    path.write_text(f"import pathlib\n\ndef make(uri):\n    pathlib.Path({str(marker)!r}).write_text('ran')\n")
    return ["os:system", f"{path}:make"], marker


def test_admission_refuses_a_module_path_as_the_filesystem(evil):
    specs, marker = evil
    for spec in specs:
        with pytest.raises(Invalid, match=r"spec.config.inline.checkpoint.filesystem: .* does not match"):
            admit(SCHEMA, trainingjob({"filesystem": spec}))
    admit(SCHEMA, trainingjob({"filesystem": "s3", "filesystem_options": {"region": "eu-west-1"}}))
    assert not marker.exists()


def test_the_operator_refuses_it_in_a_config_map_admission_never_saw(evil):
    specs, marker = evil
    for spec in specs:
        job = trainingjob(config_map=True)
        data = {"config.yaml": yaml.safe_dump({"checkpoint": {"uri": "s3://b/run", "filesystem": spec}})}
        with pytest.raises(SpecError) as e:
            job_config(job, base_config(job["spec"], lambda name: data), ServiceDefaults("redis://r:6379/0", "k:9092"))
        assert str(e.value).startswith(f"spec.config.configMapRef.checkpoint.filesystem={spec!r}: must be the name "
                                       "of a registered file system") and "\n" not in str(e.value)
    assert not marker.exists()
