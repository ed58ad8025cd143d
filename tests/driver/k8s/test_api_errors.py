"""API errors as real clusters send them: throttling and server errors are retried with backoff; a refused
pod (a ResourceQuota's 403, a 422) becomes the FailedCreatePod condition and an Event, and is created once
the refusal lifts; no error kills the driver's backend."""
from __future__ import annotations

import pytest
import redis
from urllib3.util.retry import RequestHistory
from k8s_support import NS, create_job
from megascale.driver.backend import NodeLaunch
from megascale.driver.k8s import api_retry, spec
from megascale.driver.k8s import status as job_status
from megascale.driver.k8s.backend import K8sState, KubernetesBackend
from megascale.driver.k8s.kube import Kube, connect
from megascale.driver.k8s.spec import PodPolicy
from megascale.driver.state import JobRecord, NodeSlot

from megascale.common.embedded_redis import EmbeddedRedis

JOB = "gpt"
LAUNCH = NodeLaunch(job=f"{NS}.{JOB}", redis_url="redis://r:6379/0", kafka="k:9092", run_dir=spec.RUN_DIR,
                    heartbeat_s=5)
QUOTA = ('pods "gpt-n0" is forbidden: exceeded quota: gpu-quota, requested: nvidia.com/gpu=8, used: '
         'nvidia.com/gpu=8, limited: nvidia.com/gpu=8')


@pytest.fixture
def job(apiserver):
    api, admin_config, operator_config = apiserver
    create_job(admin_config, JOB, nodes=1, devicesPerNode=1, parallelism={"dp": 1})
    cr = api.get("trainingjobs", JOB, NS, group="megascale.io")
    with EmbeddedRedis() as server:
        yield api, operator_config, cr, server.url


def codes(api, verb: str) -> list[int]:
    return [r[-1] for r in api.requests if r[1] == verb and r[3] == "pods"]


def test_throttling_and_server_errors_are_retried_with_backoff(job):
    api, operator_config, cr, _ = job
    kube = Kube(connect(operator_config))
    api.fail("create", "pods", 429, retry_after=0)
    api.fail("create", "pods", 503)
    api.fail("list", "pods", 500)
    assert kube.create_pod(NS, spec.pod(cr, "n0", LAUNCH, []))
    assert [p["metadata"]["name"] for p in kube.list_pods(NS, "")] == ["gpt-n0"]
    assert codes(api, "create") == [429, 503, 201] and codes(api, "list") == [500, 200]
    # a create whose answer was lost comes back 409: the pod is this job's, so it is not created twice
    assert kube.create_pod(NS, spec.pod(cr, "n0", LAUNCH, [])) is False


def test_a_refused_pod_is_a_condition_and_an_event_and_is_created_once_allowed(job):
    api, operator_config, cr, redis_url = job
    client = redis.Redis.from_url(redis_url)
    state = K8sState(client, LAUNCH.job)
    state.set_uid(cr["metadata"]["uid"])
    backend = KubernetesBackend(Kube(connect(operator_config)), NS, JOB, LAUNCH, client, PodPolicy())
    api.fail("create", "pods", 403, message=QUOTA)
    backend.start(["n0"])  # the driver's call: it returns
    assert api.list("pods", NS) == [] and codes(api, "create") == [403]  # a refusal is not retried at once
    assert state.refused() == {"n0": f"pod gpt-n0: {QUOTA}"}
    [event] = api.list("events", NS)
    assert (event["type"], event["reason"], event["involvedObject"]["uid"]) == (
        "Warning", "FailedCreatePod", cr["metadata"]["uid"]) and QUOTA in event["message"]
    rec = JobRecord(job=LAUNCH.job, config={}, run_dir="/r")
    rec.nodes = [NodeSlot("n0", "active", 0, True)]
    condition = job_status.pods_refused(state.refused(), rec)
    assert condition["status"] == "True" and QUOTA in condition["message"]

    backend.unsent["n0"] = 0.0  # due now (every RESEND_S otherwise); the quota has room again
    assert "n0" in backend.list()
    assert state.refused() == {} and job_status.pods_refused(state.refused(), rec)["status"] == "False"

    api.fail("delete", "pods", 403)
    api.fail("list", "pods", 403, times=3)
    assert backend.list()["n0"].alive  # the last listing
    backend.evict("n0")
    backend.stop(["n0"], grace_s=0)
    api.fail("create", "pods", 422, message='Pod "gpt-n1" is invalid: spec.priorityClassName: Not found')
    backend.start(["n1"])
    assert "spec.priorityClassName: Not found" in state.refused()["n1"]


def test_errors_past_the_retries_leave_the_backend_running(job, monkeypatch):
    api, operator_config, cr, redis_url = job
    monkeypatch.setattr(api_retry, "RETRIES", 1)
    backend = KubernetesBackend(Kube(connect(operator_config)), NS, JOB, LAUNCH, redis.Redis.from_url(redis_url),
                                PodPolicy())
    api.fail("get", "trainingjobs", 503, times=2)
    backend.start(["n0"])
    assert api.list("pods", NS) == [] and "n0" in backend.unsent
    api.fail("list", "pods", 500, times=2)
    assert backend.list() == {}


def test_a_pod_security_refusal_is_a_condition_and_an_event_and_the_driver_carries_on(job):
    api, operator_config, cr, redis_url = job
    api.enforce_pod_security(NS, "restricted")  # the namespace's pod-security.kubernetes.io/enforce label
    client = redis.Redis.from_url(redis_url)
    state = K8sState(client, LAUNCH.job)
    state.set_uid(cr["metadata"]["uid"])
    backend = KubernetesBackend(Kube(connect(operator_config)), NS, JOB, LAUNCH, client, PodPolicy())
    backend.start(["n0"])  # runs as root by default (spec.runAsNonRoot: false): refused, and the call returns
    assert api.list("pods", NS) == []
    why = ('pods "gpt-n0" is forbidden: violates PodSecurity "restricted:latest": runAsNonRoot != true (pod or '
           'container "executor" must set securityContext.runAsNonRoot=true)')
    assert state.refused() == {"n0": f"pod gpt-n0: {why}"}
    [event] = api.list("events", NS)
    assert (event["type"], event["reason"], event["involvedObject"]["uid"]) == (
        "Warning", "FailedCreatePod", cr["metadata"]["uid"]) and why in event["message"]
    rec = JobRecord(job=LAUNCH.job, config={}, run_dir="/r")
    rec.nodes = [NodeSlot("n0", "active", 0, True)]
    condition = job_status.pods_refused(state.refused(), rec)
    assert (condition["type"], condition["status"]) == ("FailedCreatePod", "True") and why in condition["message"]
    backend.unsent["n0"] = 0.0
    assert backend.list() == {} and len(api.list("events", NS)) == 1  # refused again, told once, still running

    api.enforce_pod_security(NS, "baseline")  # the admin relabels the namespace: the pod meets baseline
    backend.unsent["n0"] = 0.0
    assert "n0" in backend.list() and state.refused() == {}
    assert job_status.pods_refused(state.refused(), rec)["status"] == "False"


def test_the_retry_backoff_is_jittered_within_its_bounds():
    def backoffs() -> list[float]:
        retry, waits = api_retry.policy(), []
        for _ in range(api_retry.RETRIES):
            retry = retry.new(history=(*retry.history, RequestHistory("POST", "/api/v1/pods", None, 503, None)))
            waits.append(retry.get_backoff_time())
        return waits
    runs = [backoffs() for _ in range(20)]
    bounds = [min(api_retry.MAX_BACKOFF_S, api_retry.BACKOFF_S * 2 ** n) for n in range(1, api_retry.RETRIES + 1)]
    assert all(0.0 <= w <= b for run in runs for w, b in zip(run, bounds))
    assert runs[0] != runs[1] and len({run[0] for run in runs}) > 1  # no two drivers come back in step
    assert max(run[-1] for run in runs) > api_retry.MAX_BACKOFF_S / 4  # spread over the range, not pinned low
