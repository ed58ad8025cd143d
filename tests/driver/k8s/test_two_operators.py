"""Two operator replicas against one stand-in API server, end to end (real Redis, Kafka, driver and executor
processes): only the Lease holder runs drivers; when it stalls, the other takes over within the lease duration
and the job carries on, on the same pods. While the job runs, its driver lists no pods (it reads the
operator's cache), so the API calls per minute stay bounded by the operator's own writes."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from fake_kubelet import FakeCluster
from k8s_support import NS, SYSTEM_NS, sim_jobs, wait_for
from megascale.driver.k8s.kube import Kube, connect
from megascale.driver.k8s.leader import LeaseConfig
from megascale.driver.k8s.operator import Operator
from megascale.driver.k8s.spec import ServiceDefaults
from megascale.driver.services import EmbeddedKafka

from megascale.common.embedded_redis import EmbeddedRedis

JOB = "duo"
LEASE = {"lease_s": 2, "renew_deadline_s": 1.2, "retry_s": 0.25}
STATUS_EVERY_S = 0.5


class Replica:
    """An operator replica in a thread, as `megascale kube operator` runs in each of its pods."""

    def __init__(self, identity: str, kubeconfig: str, redis_url: str, kafka: str, log_dir: Path):
        self.operator = Operator(Kube(connect(kubeconfig)), NS, ServiceDefaults(redis_url, kafka),
                                 kubeconfig=kubeconfig, tick_s=0.2, status_every_s=STATUS_EVERY_S,
                                 missing_grace_s=5, driver_log=log_dir, run_dir=str(log_dir / "run"),
                                 lease=LeaseConfig(namespace=SYSTEM_NS, identity=identity, **LEASE))
        self.thread = threading.Thread(target=self.operator.run, daemon=True)
        self.thread.start()

    def drivers(self) -> list:
        return [rt.proc for rt in self.operator.runtimes.values() if rt.proc and rt.proc.poll() is None]

    def stop(self) -> None:
        self.operator.stop()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


@pytest.mark.slow
def test_the_standby_takes_over_a_stalled_leaders_job_within_the_lease_duration(apiserver, tmp_path, monkeypatch):
    api, admin_config, operator_config = apiserver
    admin, inline = sim_jobs(admin_config, monkeypatch, step_s=0.1, steps=100000)
    admin.custom.create_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs", {
        "apiVersion": "megascale.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": JOB, "namespace": NS},
        "spec": {"image": "megascale:test", "nodes": 1, "devicesPerNode": 2, "deviceResource": "",
                 "parallelism": {"dp": 2}, "policy": {"heartbeatSeconds": 0.5, "deadAfterSeconds": 8},
                 "config": {"inline": inline}}})

    def status() -> dict:
        return api.get("trainingjobs", JOB, NS, group="megascale.io").get("status") or {}

    def holder() -> str:
        return api.get("leases", "megascale-operator", SYSTEM_NS, group="coordination.k8s.io")["spec"]["holderIdentity"]

    def pods() -> dict[str, str]:
        return {p["metadata"]["name"]: p["metadata"]["uid"] for p in api.list("pods", NS, f"megascale.io/job={JOB}")}

    cluster = FakeCluster(api, ["m0"], tmp_path / "machines").start()
    kafka = EmbeddedKafka().start()
    replicas, hang = [], threading.Event()
    try:
        with EmbeddedRedis() as redis_server:
            a = Replica("a", operator_config, redis_server.url, kafka.bootstrap, tmp_path)
            replicas.append(a)
            wait_for(lambda: (s := status()).get("phase") == "Running" and (s.get("step") or 0) > 0, 90,
                     "the job to run under a")
            b = Replica("b", operator_config, redis_server.url, kafka.bootstrap, tmp_path)
            replicas.append(b)

            # steady state: a runs the one driver, b none; the driver lists no pods
            time.sleep(1.0)
            start, mark = time.monotonic(), len(api.requests)
            time.sleep(3.0)
            window = api.requests[mark:]
            per_minute = 60 / (time.monotonic() - start)
            assert len(a.drivers()) == 1 and b.drivers() == [] and b.operator.runtimes == {}
            assert [r for r in window if r[3] == "pods"] == []  # no list, no read: the driver uses the cache
            others = [r for r in window if r[3] != "leases"]
            # status writes (at most one per STATUS_EVERY_S) and their watch events, nothing per driver tick
            assert len(others) * per_minute <= (60 / STATUS_EVERY_S) + 30, others

            # a stalls (its renewals hang): b leads within the lease duration, its driver takes the job on
            before, step = pods(), status()["step"]
            monkeypatch.setattr(a.operator.election, "_try", lambda: hang.wait() and False)
            stalled_at = time.monotonic()
            wait_for(lambda: holder() == "b", LEASE["lease_s"] + 5, "b to take the Lease over")
            assert time.monotonic() - stalled_at < LEASE["lease_s"] + 2  # lease duration + a retry period or so
            wait_for(lambda: a.drivers() == [] and a.operator.runtimes == {}, 10, "a to stop its driver")
            wait_for(lambda: b.drivers(), 30, "b to start the job's driver")
            wait_for(lambda: (status().get("step") or 0) > step + 5, 60, "the job to carry on under b")
            assert pods() == before and status()["incarnation"] == 1 and status()["phase"] == "Running"
    finally:
        hang.set()
        for replica in replicas:
            replica.stop()
        admin.custom.delete_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs", JOB)
        cluster.stop()
        kafka.stop(kill=True)
