"""`python -m megascale.driver.k8s.jobdriver --namespace NS --name JOB --redis URL --kafka BOOTSTRAP`:
one TrainingJob's driver: the reconcile loop of `megascale run`, with pods for nodes (`spawn` starts it).

The operator runs one per job as a child process, as `megascale run`'s supervisor does: a driver
that dies takes no other job with it, and its successor resumes from the job's record in Redis.
It reads the job's pods from the operator's cache (caches.py), and writes to the API server only while
the operator's Lease is held (the fence file, leader.py); once it is not, the driver stops as on SIGTERM,
leaving the job to the next leader's driver.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterable, Optional

from megascale.common.auth import SECRETS_ENV
from megascale.config import ConfigError, from_dict
from megascale.common.lifetime import die_with_parent

from .. import log
from ..arrow_pool import driver_environment, pool_in_use
from ..backend import NodeLaunch
from ..reconcile import Driver
from ..state import JobStore
from .backend import KubernetesBackend
from .caches import PodCache
from .kube import Kube, connect
from .leader import Fence
from .spec import PodPolicy, job_id

FENCE_CHECK_S = 0.5  # how soon a driver notices that its operator lost the Lease, or stalled


def spawn(namespace: str, name: str, redis_url: str, kafka: str, *, kubeconfig: Optional[str], fence: Path,
          service_accounts: Iterable[str], secrets_file: Optional[Path], log_file: Optional[Path],
          priority_class: Optional[str] = None) -> subprocess.Popen:
    """Starts one job's driver as the operator's child (`main` below parses this command line); the job's
    secrets file reaches it by path in the environment, never in its arguments."""
    argv = [sys.executable, "-m", "megascale.driver.k8s.jobdriver", "--namespace", namespace, "--name", name,
            "--redis", redis_url, "--kafka", kafka, "--fence", str(fence)]
    if kubeconfig:
        argv += ["--kubeconfig", kubeconfig]
    for account in sorted(service_accounts):
        argv += ["--service-account", account]
    if priority_class:
        argv += ["--priority-class", priority_class]
    env = driver_environment()
    if secrets_file:
        env[SECRETS_ENV] = str(secrets_file)
    out = open(log_file, "ab") if log_file else None
    try:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT if out else None,
                                env=env)
    finally:
        if out:
            out.close()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megascale.driver.k8s.jobdriver", description=__doc__.splitlines()[0])
    p.add_argument("--namespace", required=True)
    p.add_argument("--name", required=True, help="the TrainingJob")
    p.add_argument("--redis", required=True)
    p.add_argument("--kafka", required=True)
    p.add_argument("--fence", type=Path, required=True, help="the operator's lease deadline file (leader.py)")
    p.add_argument("--kubeconfig", help="default: in-cluster service account, else $KUBECONFIG")
    p.add_argument("--service-account", action="append", default=[], help="one spec.serviceAccountName allowed")
    p.add_argument("--priority-class", help="the pods' priorityClassName when the spec names none")
    args = p.parse_args(argv)
    die_with_parent(os.getppid(), signal.SIGTERM)  # an orderly stop when the operator goes, however it goes
    fence = Fence(args.fence)
    threading.Thread(target=_stop_when_fenced, args=(fence,), name="fence", daemon=True).start()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {args.namespace}/{args.name} %(name)s %(levelname)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    pool_in_use()
    store = JobStore.from_url(args.redis, job_id(args.namespace, args.name))
    rec = store.load()
    if rec is None:
        log.error("no job %s in Redis at %s: the operator submits it first", store.job, args.redis)
        return 2
    try:
        cfg = from_dict(rec.config)
    except ConfigError as e:
        log.error("job %s has an invalid config: %s", store.job, e)
        return 2
    launch = NodeLaunch(job=store.job, redis_url=args.redis, kafka=args.kafka, run_dir=rec.run_dir,
                        heartbeat_s=cfg.control.heartbeat_s, standby=cfg.control.standby_ranks,
                        ranks_per_node=cfg.ranks_per_node)
    kube = Kube(connect(args.kubeconfig), fence, PodCache(store.r, store.job))
    backend = KubernetesBackend(kube, args.namespace, args.name, launch, store.r,
                                PodPolicy(frozenset(args.service_account), args.priority_class))
    return Driver(store, args.redis, args.kafka, backend=backend).run()


def _stop_when_fenced(fence: Fence) -> None:
    """The operator stalled or lost its Lease (a live operator stops its drivers itself): stop as on SIGTERM,
    releasing the job's driver lease in Redis for the next leader's driver."""
    while fence.held():
        time.sleep(FENCE_CHECK_S)
    log.warning("the operator no longer holds its Lease: this driver stops")
    os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main())
