"""A job driver's writes are fenced by its operator's Lease (leader.py Fence, jobdriver --fence): a real driver
process creates its pods while the Lease is held; once another replica takes the Lease, nothing the driver
would write reaches the API server (a status patch, a pod: refused before they leave the process) and the
driver stops as on SIGTERM, handing its job's driver lease in Redis back for the next leader's driver."""
from __future__ import annotations

import threading

import pytest
import redis
from k8s_support import NS, OPERATOR_USER, SYSTEM_NS, create_job, wait_for
from megascale.driver.backend import NodeLaunch
from megascale.driver.k8s import jobdriver, spec
from megascale.driver.k8s.backend import K8sState, KubernetesBackend
from megascale.driver.k8s.kube import Kube, connect
from megascale.driver.k8s.leader import Fence, LeaderElection, LeaseConfig, NotLeader
from megascale.driver.k8s.spec import PodPolicy, ServiceDefaults
from megascale.driver.services import EmbeddedKafka
from megascale.driver.state import JobRecord, JobStore

from megascale.common.processes import stop_process
from megascale.common.embedded_redis import EmbeddedRedis

JOB = "gpt"
FAST = {"lease_s": 2, "renew_deadline_s": 1.2, "retry_s": 0.2}
WRITES = ("create", "update", "patch", "delete")


def test_a_driver_whose_operator_lost_the_lease_writes_nothing_more_and_stops(apiserver, tmp_path):
    api, admin_config, operator_config = apiserver
    create_job(admin_config, JOB, nodes=1, devicesPerNode=1, deviceResource="", parallelism={"dp": 1})
    cr = api.get("trainingjobs", JOB, NS, group="megascale.io")
    fence = Fence(tmp_path / "lease")
    election = LeaderElection(Kube(connect(operator_config)).api,
                              LeaseConfig(namespace=SYSTEM_NS, identity="op-a", **FAST), fence)
    assert election.acquire(threading.Event()) and fence.held()
    kafka = EmbeddedKafka().start()
    proc = None
    try:
        with EmbeddedRedis() as server:
            cfg = spec.job_config(cr, {}, ServiceDefaults(server.url, kafka.bootstrap), str(tmp_path / "run"))
            store = JobStore.from_url(server.url, f"{NS}.{JOB}")
            K8sState(store.r, store.job).set_uid(cr["metadata"]["uid"])
            store.submit(JobRecord(job=store.job, config=cfg.to_dict(), run_dir=str(tmp_path / "run")))
            proc = jobdriver.spawn(NS, JOB, server.url, kafka.bootstrap, kubeconfig=operator_config, fence=fence.path,
                                   service_accounts=[], secrets_file=None, log_file=tmp_path / "driver.log")
            wait_for(lambda: api.get("pods", f"{JOB}-n0", NS), 60, "the driver to create its pod")
            assert proc.poll() is None and store.lease_holder()
            with open(f"/proc/{proc.pid}/environ", "rb") as f:  # its Parquet work on a pool that returns pages
                assert b"ARROW_DEFAULT_MEMORY_POOL=jemalloc" in f.read().split(b"\0")

            # another replica takes the Lease over: this operator's renewal finds it taken and closes the fence
            api.update("leases", "megascale-operator", SYSTEM_NS, lambda lease: lease["spec"].update(
                holderIdentity="op-b", leaseDurationSeconds=30), group="coordination.k8s.io")
            wait_for(lambda: election.lost.is_set() and not fence.held(), 5, "the fence to close")
            mark = len(api.requests)
            api.remove("pods", f"{JOB}-n0", NS)  # the driver would create it again, if it could still write

            # what the driver's client would send now is refused before it leaves the process
            driver_kube = Kube(connect(operator_config), Fence(fence.path))  # as jobdriver.main builds it
            with pytest.raises(NotLeader, match="no longer holds its Lease"):
                driver_kube.patch_job_status(NS, JOB, {"phase": "Running"})
            launch = NodeLaunch(job=store.job, redis_url=server.url, kafka=kafka.bootstrap,
                                run_dir=str(tmp_path / "run"), heartbeat_s=5)
            KubernetesBackend(driver_kube, NS, JOB, launch, redis.Redis.from_url(server.url), PodPolicy()).start(
                ["n0"])

            assert proc.wait(timeout=20) is not None  # it noticed within FENCE_CHECK_S and stopped in order
            proc = None
            assert store.lease_holder() is None  # its job's driver lease, released for the next driver
            writes = [r for r in api.requests[mark:] if r[0] == OPERATOR_USER and r[1] in WRITES]
            assert writes == [] and api.get("pods", f"{JOB}-n0", NS) is None
            assert "the operator no longer holds its Lease: this driver stops" in (tmp_path / "driver.log").read_text()
    finally:
        if proc is not None:
            stop_process(proc, grace_s=5)
        election.release()
        kafka.stop(kill=True)
