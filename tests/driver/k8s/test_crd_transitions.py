"""Spec fields frozen at submission: the CRD's CEL transition rules refuse edits of them (checked against
cel-python, a CEL implementation, as the oracle for the stand-in's evaluator), the few fields the operator
reads live stay editable, and the operator advances status.observedGeneration only once an edit is applied."""
from __future__ import annotations

import copy
from typing import Any, Iterator

import pytest
from k8s_support import DEPLOY, NS, load_yaml
from kubernetes.client.exceptions import ApiException
from megascale.driver.k8s.adoption import frozen
from megascale.driver.k8s.backend import K8sState
from megascale.driver.k8s.caches import PodCache
from megascale.driver.k8s.crd import LIVE_FIELDS, crd
from megascale.driver.k8s.kube import Kube, connect, reason
from megascale.driver.k8s.operator import Operator, Runtime
from megascale.driver.k8s.spec import ServiceDefaults
from megascale.driver.state import JobRecord, JobState, JobStore
from schema_tools import MISSING, Invalid, admit, evaluate

from megascale.common.embedded_redis import EmbeddedRedis

SCHEMA = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SPEC = SCHEMA["properties"]["spec"]


def stored() -> dict:
    job = next(d for d in load_yaml(DEPLOY / "examples" / "gpt-nodes.yaml") if d["kind"] == "TrainingJob")
    return admit(SCHEMA, job)


EDITS = {  # an edit of each kind of field: frozen (refused, naming it), live (applied), optional (come / go)
    "image": ("spec.image cannot change", lambda s: s.update(image="megascale:0.2.0")),
    "spares": ("spec.spares cannot change", lambda s: s.update(spares=2)),
    "parallelism": ("spec.parallelism cannot change", lambda s: s["parallelism"].update(tp=1, dp=4)),
    "config": ("spec.config cannot change", lambda s: s["config"]["inline"]["train"].update(steps=300)),
    "env added": ("spec.env cannot be added or removed", lambda s: s.update(env=[{"name": "A", "value": "1"}])),
    "resources removed": ("spec.resources cannot be added or removed", lambda s: s.pop("resources")),
    "paused": (None, lambda s: s.update(paused=True)),
    "cordonBudget": (None, lambda s: s.update(cordonBudget=3)),
    "nodeNotReadyGraceSeconds": (None, lambda s: s.update(nodeNotReadyGraceSeconds=120)),
}


def transition_rules(schema: dict, new: Any, old: Any, path: str = "spec") -> Iterator[tuple[str, str, Any, Any]]:
    """(path, rule, self, oldSelf) for every transition rule the API server would run on this update."""
    for rule in schema.get("x-kubernetes-validations") or []:
        if "oldSelf" in rule["rule"] and old is not MISSING and new is not MISSING:
            yield path, rule["rule"], new, old
    for name, sub in (schema.get("properties") or {}).items():
        if isinstance(new, dict) and isinstance(old, dict):
            yield from transition_rules(sub, new.get(name, MISSING), old.get(name, MISSING), f"{path}.{name}")


@pytest.mark.parametrize("edit", EDITS)
def test_frozen_fields_are_refused_and_live_ones_pass(edit):
    old = stored()
    new = copy.deepcopy(old)
    refusal, change = EDITS[edit]
    change(new["spec"])
    if refusal is None:
        admit(SCHEMA, new, old)
    else:
        with pytest.raises(Invalid, match=refusal):
            admit(SCHEMA, new, old)
    admit(SCHEMA, new)  # a new job may say anything of the kind: the rules are on transitions only


def test_cel_python_agrees_with_the_stand_in_on_every_transition_rule():
    celpy = pytest.importorskip("celpy", reason="cel-python (the oracle) is not installed")
    env = celpy.Environment()
    programs: dict[str, Any] = {}
    old = stored()
    for edit, (refusal, change) in EDITS.items():
        new = copy.deepcopy(old)
        change(new["spec"])
        verdicts = []
        for path, rule, value, previous in transition_rules(SPEC, new["spec"], old["spec"]):
            program = programs.get(rule) or programs.setdefault(rule, env.program(env.compile(rule)))
            theirs = program.evaluate({"self": celpy.json_to_cel(value), "oldSelf": celpy.json_to_cel(previous)})
            verdicts.append(evaluate(rule, value, previous))
            assert verdicts[-1] == bool(theirs), (edit, path, rule)
        assert len(verdicts) > 20 and verdicts.count(False) == (refusal is not None), edit


def test_every_field_but_the_live_ones_is_frozen():
    ruled = {name for name, field in SPEC["properties"].items()
             if any(r["rule"] == "self == oldSelf" for r in field.get("x-kubernetes-validations") or [])}
    assert ruled == set(SPEC["properties"]) - set(LIVE_FIELDS) and set(LIVE_FIELDS) < set(SPEC["properties"])
    assert set(frozen(stored()["spec"])) & set(LIVE_FIELDS) == set()


def test_the_api_server_refuses_an_image_edit_and_the_operator_holds_observed_generation(apiserver):
    api, admin_config, _ = apiserver
    admin = Kube(connect(admin_config))
    admin.apply_crd(crd())
    job = stored()
    admin.custom.create_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs", job)
    with pytest.raises(ApiException) as e:
        admin.patch_job(NS, "gpt-nodes", {"spec": {"image": "megascale:0.2.0"}})
    assert e.value.status == 422 and "spec.image cannot change once the job is submitted" in reason(e.value)
    cr = admin.patch_job(NS, "gpt-nodes", {"spec": {"paused": True}})
    assert cr["metadata"]["generation"] == 2

    class Statuses:  # the operator's writes
        written: list[dict] = []

        def patch_job_status(self, namespace, name, status):
            self.written.append(status)

    with EmbeddedRedis() as redis_server:
        store = JobStore.from_url(redis_server.url, f"{NS}.gpt-nodes")
        rec = JobRecord(job=store.job, config={}, run_dir="/r", state=JobState.RUNNING)
        store.submit(rec)
        operator = Operator(Statuses(), NS, ServiceDefaults())  # type: ignore[arg-type]
        rt = Runtime(NS, "gpt-nodes", cr["metadata"]["uid"], store, K8sState(store.r, store.job), redis_server.url,
                     "k:1", False, {"observedGeneration": 1}, frozen(job["spec"]), PodCache(store.r, store.job))

        def apply(cr: dict) -> int:
            applied = operator._apply_paused(rt, cr["spec"], rec)
            operator._write_status(rt, cr, rec, {}, applied)
            return Statuses.written[-1]["observedGeneration"]

        assert apply(cr) == 2 and store.desired() == "paused"  # the live edit is applied, then observed
        # a cluster without transition rules (or a CRD older than them) lets an image edit through: not applied
        edited = {**cr, "metadata": {**cr["metadata"], "generation": 3}, "spec": {**cr["spec"], "image": "other"}}
        assert apply(edited) == 2 and Statuses.written[-1]["conditions"]
        assert apply({**cr, "metadata": {**cr["metadata"], "generation": 4}}) == 4  # put back: all applied again
