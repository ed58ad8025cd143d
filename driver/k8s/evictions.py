"""Step 4 of the operator's pass: the job's failed nodes, classified (failures.py, health.py), reported as
Events on the TrainingJob, and those the cluster caused turned into eviction requests for the driver.

A failure that is not the machine's doing (a preemption, a drain, an OOM kill, a pod that never started)
is recorded as excused first, so that the driver's eviction does not keep the job off the machine. A pod
the watch cache misses is read once more from the API server before it counts as gone: a cache that lags
behind a create must not evict a node that is starting.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .. import log
from ..state import JobRecord, JobState
from . import api_retry, health
from .ownership import owned_by
from .spec import NOT_READY_GRACE_S, pod_name

if TYPE_CHECKING:
    from .operator import Operator, Runtime


def evict_failed(op: Operator, rt: Runtime, cr: dict, rec: JobRecord, pods: dict[str, dict],
                 machines: dict[str, dict], requested: set[str]) -> None:
    spec = cr.get("spec") or {}
    if rec.terminal:
        return
    now = time.monotonic()
    for node in [n for n in rt.missing_since if n in pods]:
        del rt.missing_since[node]
    failed = health.failed_nodes(rec, pods, machines, lambda n: now - rt.missing_since.setdefault(n, now),
                                 op.missing_grace_s, lambda host: now - op.not_ready_since.get(host, now),
                                 spec.get("nodeNotReadyGraceSeconds", NOT_READY_GRACE_S))
    failed = {n: f for n, f in failed.items() if f.kind != "PodMissing" or _confirmed_missing(op, rt, n)}
    # The driver pauses a job whose node went silent and asks for `evict` + `resume`: do just that.
    driver_paused = (rec.state == JobState.PAUSED and not spec.get("paused") and rt.paused is False
                     and rt.store.desired() == "paused")
    if driver_paused:
        failed = {**health.silent_nodes(rec), **failed}
    for node, failure in failed.items():
        if not failure.blame:
            rt.state.excuse(node, failure.kind)
        if rt.reported.get(node) != failure.kind:
            rt.reported[node] = failure.kind
            log.warning("job %s: node %s: %s (%s)", rt.job, node, failure.message, failure.kind)
            op.kube.create_event(cr, "Warning", failure.kind, f"node {node}: {failure.message}")
    replace = {n: f.message for n, f in failed.items() if f.replace}
    verdict = health.judge(replace, requested, spec.get("spares", 0), len(rt.state.evicted_hosts()), spec["nodes"])
    if verdict.held != rt.held:
        if verdict.held:
            log.warning("job %s: %s", rt.job, verdict.held)
        rt.held = verdict.held
    for node, why in verdict.evict.items():
        log.info("job %s: evicting node %s: %s", rt.job, node, why)
        rt.store.request_evict(node)
    if driver_paused and not verdict.held:
        log.info("job %s: resuming it after the driver paused it (%s)", rt.job, rec.reason)
        rt.store.set_desired("running")


def _confirmed_missing(op: Operator, rt: Runtime, node: str) -> bool:
    try:
        pod = op.kube.read_pod(rt.namespace, pod_name(rt.name, node))
    except api_retry.API_ERRORS as e:
        log.warning("job %s: cannot confirm that node %s's pod is gone: %s", rt.job, node, api_retry.message(e))
        return False
    return not owned_by(pod, rt.uid)
