"""A TrainingJob's spec as a JobConfig and as pods; the operator's eviction rules and status, unit by unit."""
from __future__ import annotations

import copy

import pytest
from k8s_support import DEPLOY, NS, load_yaml
from megascale.driver.backend import NodeLaunch
from megascale.driver.k8s import health, spec, status
from megascale.driver.state import JobRecord, JobState, JobStatus, NodeSlot, NodeStatus

DEFAULTS = spec.ServiceDefaults("redis://redis:6379/0", "kafka:9092")


def example() -> dict:
    cr = next(d for d in load_yaml(DEPLOY / "examples" / "gpt-nodes.yaml") if d["kind"] == "TrainingJob")
    cr["metadata"]["uid"] = "uid-1"
    return cr


def config(cr: dict, base: dict | None = None):
    return spec.job_config(cr, cr["spec"]["config"]["inline"] if base is None else base, DEFAULTS)


def test_spec_becomes_the_job_config():
    cfg = config(example())
    assert cfg.name == f"{NS}.gpt-nodes"
    p, c = cfg.parallelism, cfg.cluster
    assert (p.tp, p.pp, p.dp, p.sequence_parallel) == (2, 1, 2, True)
    assert (c.nodes, c.ranks_per_node, c.spares) == (2, 2, 1)
    assert (cfg.control.heartbeat_s, cfg.control.dead_after_s, cfg.control.start_timeout_s) == (5.0, 30.0, 600.0)
    assert (cfg.checkpoint.uri, cfg.checkpoint.every) == ("s3://my-bucket/megascale/gpt-nodes", 50)
    assert (cfg.services.redis, cfg.services.kafka) == (DEFAULTS.redis, DEFAULTS.kafka)
    assert cfg.train.run_dir == spec.RUN_DIR and cfg.train.steps == 200


def test_the_spec_wins_over_a_config_map_config():
    cr = example()
    cr["spec"]["config"] = {"configMapRef": {"name": "cfg"}}
    local = "name: other\ncluster: {nodes: 7, spares: 0}\nparallelism: {tp: 1, dp: 14}\nbatch: {micro: 1, global: 4}\n"
    base = spec.base_config(cr["spec"], {"cfg": {"config.yaml": local}}.get)
    cfg = config(cr, base)
    assert (cfg.name, cfg.cluster.nodes, cfg.parallelism.tp, cfg.parallelism.dp) == (f"{NS}.gpt-nodes", 2, 2, 2)


@pytest.mark.parametrize("source,data,message", [
    ({"configMapRef": {"name": "nope"}}, {}, "spec.config.configMapRef.name='nope': no such ConfigMap"),
    ({"configMapRef": {"name": "cfg", "key": "job.yaml"}}, {"cfg": {"config.yaml": ""}},
     "spec.config.configMapRef.key='job.yaml': ConfigMap cfg has no such key (keys: config.yaml)"),
    ({"configMapRef": {"name": "cfg"}}, {"cfg": {"config.yaml": "a: ["}}, "cfg/config.yaml is not valid YAML"),
    ({"configMapRef": {"name": "cfg"}}, {"cfg": {"config.yaml": "- 1"}}, "cfg/config.yaml must hold a mapping"),
])
def test_config_map_problems_name_the_field(source, data, message):
    with pytest.raises(spec.SpecError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        spec.base_config({"config": source}, data.get)


@pytest.mark.parametrize("change,message", [
    (lambda s: s["policy"].update(deadAfterSeconds=6), "spec.policy.deadAfterSeconds=6.0: must be at least twice "
                                                        "spec.policy.heartbeatSeconds=5.0"),
    (lambda s: s["config"]["inline"]["model"].update(heads=3),
     "spec.config.inline.model.heads=3 does not divide spec.config.inline.model.hidden=64"),
    (lambda s: s["config"]["inline"]["batch"].update({"global": 6}),
     "spec.config.inline.batch.global=6 is not divisible by spec.config.inline.batch.micro*spec.parallelism.dp=4"),
    (lambda s: s["checkpoint"].pop("uri"), "spec.checkpoint.uri: required when spec.checkpoint.every > 0"),
    (lambda s: s["config"]["inline"].update(model=[1]), "spec.config.inline.model: expected a mapping, got list"),
])
def test_config_errors_name_spec_fields(change, message):
    cr = example()
    change(cr["spec"])
    with pytest.raises(spec.SpecError) as e:
        config(cr)
    assert str(e.value).startswith(message)


def test_services_must_come_from_somewhere():
    with pytest.raises(spec.SpecError, match=r"spec.services.redis: not set, and the operator has no default"):
        spec.job_config(example(), {}, spec.ServiceDefaults(None, "k:9092"))


def test_executor_pod():
    cr = example()
    cr["spec"]["env"] = [{"name": "NCCL_IB_HCA", "value": "mlx5"}]
    launch = NodeLaunch(job=f"{NS}.gpt-nodes", redis_url="redis://r:1", kafka="k:2", run_dir=spec.RUN_DIR,
                        heartbeat_s=5, standby=1, ranks_per_node=2)
    pod = spec.pod(cr, "n3", launch, ["m9", "m1"])
    meta, body = pod["metadata"], pod["spec"]
    assert meta["name"] == "gpt-nodes-n3" and meta["labels"][spec.NODE_LABEL] == "n3"
    assert meta["ownerReferences"] == [{"apiVersion": "megascale.io/v1alpha1", "kind": "TrainingJob",
                                        "name": "gpt-nodes", "uid": "uid-1", "controller": True}]
    assert (body["hostname"], body["subdomain"], body["restartPolicy"]) == ("n3", "gpt-nodes", "Never")
    container = body["containers"][0]
    assert container["command"] == ["python"] and container["args"][:2] == ["-m", "megascale.executor"]
    assert " ".join(container["args"][2:]) == (f"--job {NS}.gpt-nodes --node n3 --redis redis://r:1 --kafka k:2 "
                                               f"--work-dir {spec.WORK_DIR} --heartbeat-s 5 --standby 1 "
                                               "--ranks-per-node 2")
    assert container["resources"]["limits"] == {"memory": "32Gi", "nvidia.com/gpu": "2"}
    assert {"name": "NCCL_IB_HCA", "value": "mlx5"} in container["env"]
    assert body["tolerations"] == cr["spec"]["tolerations"] and body["automountServiceAccountToken"] is False
    terms = body["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["m1", "m9"]}]}]
    assert "nodeAffinity" not in spec.pod(cr, "n0", launch, [])["spec"]["affinity"]
    cr["spec"]["deviceResource"] = ""
    assert "nvidia.com/gpu" not in spec.pod(cr, "n0", launch, [])["spec"]["containers"][0]["resources"]["limits"]


# -- health ------------------------------------------------------------------------------------

def record(state: JobState = JobState.RUNNING) -> JobRecord:
    rec = JobRecord(job="j", config={}, run_dir="/r", state=state, incarnation=2)
    rec.nodes = [NodeSlot("n0", "active", 0, True), NodeSlot("n1", "active", 1, True),
                 NodeSlot("n2", "spare", None, True), NodeSlot("n3", "evicted", None, True)]
    return rec


def pod_on(host: str, phase: str = "Running", **extra) -> dict:
    return {"metadata": {"name": f"p-{host}", **extra}, "spec": {"nodeName": host}, "status": {"phase": phase}}


def machine(ready: str) -> dict:
    return {"status": {"conditions": [{"type": "Ready", "status": ready}]}}


def test_failed_nodes_from_pods_and_machines():
    pods = {"n0": pod_on("m0"), "n1": pod_on("m1"), "n2": pod_on("m2", "Failed")}
    pods["n2"]["status"]["containerStatuses"] = [{"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]
    failed = health.failed_nodes(record(), pods, {"m0": machine("True"), "m1": machine("Unknown")}, lambda n: 0, 30,
                                 lambda host: 61, 60)
    assert {n: f.message for n, f in failed.items()} == {
        "n1": "node m1 of pod p-m1 is NotReady (for 61 s)",
        "n2": "pod p-m2: its container was killed for using more memory than no memory limit (the machine ran "
              "out): raise spec.resources.limits.memory or lower spec.shmSize"}
    gone = health.failed_nodes(record(), {"n0": pod_on("m0", deletionTimestamp="t")}, {}, lambda n: 31, 30)
    assert {n: f.message for n, f in gone.items()} == {
        "n0": "pod p-m0 is being deleted (not by its driver)", "n1": "its pod is gone (missing for 31 s)",
        "n2": "its pod is gone (missing for 31 s)"}
    assert health.failed_nodes(record(), {}, {}, lambda n: 5, 30) == {}  # not created yet, maybe


def test_judge_holds_back_job_wide_failures():
    one = {"n1": "node m1 is NotReady"}
    assert health.judge(one, set(), spares=1, evicted_hosts=0, nodes=2).evict == one
    assert health.judge(one, {"n1"}, spares=1, evicted_hosts=0, nodes=2).evict == {}  # requested already
    many = health.judge({"n0": "x", "n1": "y"}, set(), spares=1, evicted_hosts=0, nodes=2)
    assert many.evict == {} and "2 nodes failed at once" in many.held and "spec.spares=1" in many.held
    spent = health.judge(one, set(), spares=1, evicted_hosts=2, nodes=2)
    assert spent.evict == {} and "2 machines evicted already" in spent.held


def test_silent_nodes_are_the_ones_the_driver_declared_dead():
    rec = record(JobState.PAUSED)
    rec.nodes[1].dead = "no heartbeat"
    assert {n: f.message for n, f in health.silent_nodes(rec).items()} == {"n1": "no heartbeat (no heartbeat)"}


# -- status ------------------------------------------------------------------------------------

def build(previous: dict, rec: JobRecord, now: float, live: JobStatus | None = None) -> dict:
    return status.build(previous, rec, live, generation=1, paused=False, evicted_hosts=["m1"], hosts={"n0": "m0"},
                        checkpoint=None, extra_conditions=[], name="j", now=now)


def test_status_carries_the_drivers_progress_and_keeps_it_across_driver_restarts():
    rec = record()
    live = JobStatus(job="j", state="Running", step=40, total_steps=100, loss=2.0, ettr=0.93, mttr_s=12.5,
                     nodes=[NodeStatus(node="n0", role="active", alive=True)])
    s0 = build({}, rec, now=1000.0, live=live)
    assert (s0["step"], s0["totalSteps"], s0["loss"], s0["ettr"], s0["mttrSeconds"]) == (40, 100, 2.0, 0.93, 12.5)
    assert s0["startTime"] == status.iso(1000.0) and s0["evictedNodes"] == ["m1"] and s0["incarnation"] == 2
    assert s0["nodes"][0] == {"id": "n0", "role": "active", "pod": "j-n0", "alive": True, "index": 0, "host": "m0"}
    s1 = build(s0, rec, now=1010.0, live=JobStatus(job="j", state="Running"))  # a new driver knows nothing yet
    assert (s1["step"], s1["ettr"], s1["startTime"]) == (40, 0.93, status.iso(1000.0))
    assert s1["nodes"][0]["alive"] is False and not status.changed(s0, {**s1, "nodes": s0["nodes"]})
    gone = status.build(s1, rec, None, generation=1, paused=False, evicted_hosts=[], hosts={}, checkpoint=None,
                        extra_conditions=[], name="j", now=1020.0)
    assert gone["nodes"][0]["host"] == "m0"  # the pod is gone; its machine stays on record
    nan = build(s0, rec, now=1030.0, live=JobStatus(job="j", state="Running", step=41, loss=float("nan")))
    assert nan["step"] == 41 and "loss" not in nan  # NaN is not JSON


def test_conditions_keep_their_transition_time():
    rec = record()
    first = build({}, rec, now=1000.0)
    running = {c["type"]: c for c in first["conditions"]}["Running"]
    assert running["status"] == "True" and running["lastTransitionTime"] == status.iso(1000.0)
    again = {c["type"]: c for c in build(first, rec, now=1100.0)["conditions"]}
    assert again["Running"]["lastTransitionTime"] == status.iso(1000.0)
    rec.state = JobState.SUCCEEDED
    done = {c["type"]: c for c in build(first, rec, now=1200.0)["conditions"]}
    assert done["Running"]["status"] == "False" and done["Running"]["lastTransitionTime"] == status.iso(1200.0)
    assert done["Completed"]["status"] == "True" and not status.changed(first, copy.deepcopy(first))
    assert done["Failed"]["status"] == "False"
    rec.state = JobState.FAILED  # `kubectl wait --for=condition=Completed` means success, and only that
    failed = {c["type"]: c for c in build(first, rec, now=1300.0)["conditions"]}
    assert (failed["Completed"]["status"], failed["Failed"]["status"]) == ("False", "True")
    assert status.changed(first, build(first, rec, now=1200.0))
