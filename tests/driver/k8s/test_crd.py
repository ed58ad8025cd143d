"""The TrainingJob CRD: deploy/crd.yaml is what crd.py generates, its schema is structural, it admits
the examples and refuses bad specs with the field named (jsonschema, defaults applied first, CEL
rules through schema_tools' stand-in)."""
from __future__ import annotations

import copy
import dataclasses
import typing

import kubernetes_validate
import pytest
import yaml
from k8s_support import DEPLOY, K8S_VERSION, ROOT, load_yaml
from megascale.driver.k8s.crd import SPEC_OWNED_CONFIG, crd, crd_yaml
from schema_tools import Invalid, admit, structural_errors

from megascale.config import JobConfig, from_dict

SCHEMA = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def example() -> dict:
    return next(d for d in load_yaml(DEPLOY / "examples" / "gpt-nodes.yaml") if d["kind"] == "TrainingJob")


def test_deploy_crd_is_the_generated_one_and_valid_for_the_pinned_kubernetes():
    assert (DEPLOY / "crd.yaml").read_text() == crd_yaml(), "run: python -m megascale.driver.k8s.crd > deploy/crd.yaml"
    assert kubernetes_validate.validate(crd(), K8S_VERSION, strict=True)
    assert structural_errors(SCHEMA) == []


def test_printer_columns_name_fields_of_the_schema():
    for column in crd()["spec"]["versions"][0]["additionalPrinterColumns"]:
        node = SCHEMA if not column["jsonPath"].startswith(".metadata") else None
        for part in column["jsonPath"].strip(".").split(".") if node else []:
            node = node["properties"][part]
        if node:
            assert node["type"] == column["type"], column


def test_examples_are_admitted_with_defaults():
    jobs = [d for path in (DEPLOY / "examples").glob("*.yaml") for d in load_yaml(path) if d["kind"] == "TrainingJob"]
    assert len(jobs) == 3
    for job in jobs:
        stored = admit(SCHEMA, job)
        assert stored["spec"]["paused"] is False and stored["spec"]["policy"]["startTimeoutSeconds"] == 600.0
        assert stored["spec"]["parallelism"]["pp"] == 1


def test_the_local_example_config_fits_inline_once_the_spec_owned_fields_leave():
    raw = yaml.safe_load((ROOT / "examples" / "gpt-nodes.yaml").read_text())
    for path in SPEC_OWNED_CONFIG:
        section, _, field = path.partition(".")
        (raw.get(section, {}).pop(field, None) if field else raw.pop(section, None))
    job = example()
    job["spec"]["config"] = {"inline": raw}
    admit(SCHEMA, job)


def test_the_inline_schema_admits_what_the_config_reader_reads():
    inline = {"model": {"window": None, "dropout": 0}, "optimizer": {"betas": [0.9, 0.95]},
              "comm": {"env": {"NCCL_IB_TIMEOUT": 22, "NCCL_DEBUG": "INFO"}}}
    job = example()
    job["spec"]["config"] = {"inline": inline}
    admit(SCHEMA, job)
    assert from_dict(inline).comm.env == {"NCCL_IB_TIMEOUT": "22", "NCCL_DEBUG": "INFO"}


def test_every_job_config_field_is_in_the_inline_schema_unless_the_spec_owns_it():
    inline = SCHEMA["properties"]["spec"]["properties"]["config"]["properties"]["inline"]

    def walk(cls: type, node: dict, where: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            name = f.name.rstrip("_")
            path = f"{where}.{name}" if where else name
            if path in SPEC_OWNED_CONFIG:
                assert name not in node["properties"], path
            else:
                assert name in node["properties"], path
                if dataclasses.is_dataclass(hints[f.name]):
                    walk(hints[f.name], node["properties"][name], path)
                    seen.append(path)
    seen: list[str] = []
    walk(JobConfig, inline, "")
    assert "model" in seen and "optimizer.schedule" in seen


def _set(doc: dict, path: str, value) -> dict:
    doc = copy.deepcopy(doc)
    *parents, leaf = path.split(".")
    node = doc
    for part in parents:
        node = node.setdefault(part, {})
    if value is DELETE:
        node.pop(leaf)
    else:
        node[leaf] = value
    return doc


DELETE = object()
BAD = [
    ("spec.image", DELETE, "'image' is a required property"),
    ("spec.nodes", 0, "spec.nodes: 0 is less than the minimum of 1"),
    ("spec.nodes", 3, "must equal spec.parallelism.tp * pp * dp"),
    ("spec.parallelism.tp", 4, "must equal spec.parallelism.tp * pp * dp"),
    ("spec.devicesPerNode", 1, "must equal spec.parallelism.tp * pp * dp"),
    ("spec.parallelism", {"tp": 4, "dp": 1}, "spec.devicesPerNode must be a multiple of spec.parallelism.tp"),
    ("spec.config.configMapRef", {"name": "c"}, "spec.config"),
    ("spec.config", {}, "spec.config"),
    ("spec.config.inline.model.hiden", 64, "Additional properties are not allowed ('hiden' was unexpected)"),
    ("spec.config.inline.cluster", {"nodes": 2}, "('cluster' was unexpected)"),
    ("spec.config.inline.parallelism.tp", 2, "('tp' was unexpected)"),
    ("spec.config.inline.model.block", "sideways", "spec.config.inline.model.block: 'sideways' is not one of"),
    ("spec.config.inline.optimizer.betas", [0.9], "spec.config.inline.optimizer.betas: [0.9] is too short"),
    ("spec.config.inline.comm.env", {"NCCL_DEBUG": ["INFO"]}, "spec.config.inline.comm.env.NCCL_DEBUG"),
    ("spec.policy.heartbeatSeconds", "fast", "spec.policy.heartbeatSeconds: 'fast' is not of type 'number'"),
    ("spec.imagePullPolicy", "Sometimes", "spec.imagePullPolicy: 'Sometimes' is not one of"),
    ("spec.services.redis", "localhost:6379", "spec.services.redis: 'localhost:6379' does not match"),
    ("spec.resources.limits.memory", "lots", "spec.resources.limits.memory"),
    ("spec.spares", -1, "spec.spares: -1 is less than the minimum of 0"),
    ("spec.paused", "yes", "spec.paused: 'yes' is not of type 'boolean'"),
    ("metadata.name", "GPT_nodes", "metadata.name: 'GPT_nodes' does not match"),
    ("metadata.name", "g" * 51, "is too long"),
]


@pytest.mark.parametrize("path,value,message", BAD, ids=[f"{p}={v!r}"[:40] for p, v, _ in BAD])
def test_bad_specs_are_refused_naming_the_field(path, value, message):
    with pytest.raises(Invalid) as e:
        admit(SCHEMA, _set(example(), path, value))
    assert message in str(e.value)
