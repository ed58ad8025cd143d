"""Machines where pods of different jobs crashed: evidence of a bad machine that no single job gives.

A crash (failures.py `Crashed`: a signal such as SIGSEGV or SIGBUS, a non-zero exit code) may be the job's
image or its machine. One job crashing again and again on a machine says nothing about the machine (that
job's later pods avoid it anyway: backend.py); pods of CRASH_JOBS different jobs (by TrainingJob UID)
crashing on one machine within CRASH_WINDOW_S do. The operator then cordons the machine, as health.cordons
does after a failed self-check: only within every counted job's node pool (its nodeSelector and the
operator's --node-pool labels), and each counted job spends one of its spec.cordonBudget machines per hour;
a job whose budget is spent, that this operator does not run, or whose pods crashed on JOB_WIDE machines or
more within the window (its image, its Redis: not its machines) does not count. Preemptions, evictions,
OOM kills, pods that never started and clean exits never count: failures.classify tells them apart.

The operator (one process for all jobs) sees every change of every executor pod through its pod informer
(`CrashTracker.observe`, on the informer's thread), so a crashed pod its driver deletes at once still
counts. State is bounded: per machine, the crashes of the last window only, at most MAX_PER_MACHINE, one
entry per pod; kept in memory (a restarted operator starts afresh, from the pods still there).
"""
from __future__ import annotations

import calendar
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from kubernetes.client.exceptions import ApiException

from .. import log
from .failures import classify
from .health import CORDON_WINDOW_S
from .kube import reason
from .ownership import controller_uid
from .spec import JOB_LABEL

if TYPE_CHECKING:
    from .operator import Operator

CRASH_JOBS = 2  # pods of this many different jobs crashed on a machine: it is cordoned
CRASH_WINDOW_S = 3600.0  # within this long (by the containers' finishedAt)
MAX_PER_MACHINE = 16  # crashes kept per machine (the newest)
JOB_WIDE = 3  # a job whose pods crashed on this many machines within the window crashes everywhere: no evidence


@dataclass(frozen=True)
class Crash:
    job_uid: str
    job: tuple[str, str]  # namespace, name
    message: str  # failures.classify's, e.g. "pod gpt-n1 failed: exit code 139 (SIGSEGV)"
    at: float  # epoch seconds


def _finished(pod: dict, default: float) -> float:
    """When the pod's container ended (its terminated.finishedAt), else `default`."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        stamp = ((cs.get("state") or {}).get("terminated") or {}).get("finishedAt")
        if stamp:
            try:
                return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")))
            except ValueError:
                pass
    return default


class CrashTracker:
    """Per machine, the recent crashes of executor pods (machine -> pod uid -> Crash)."""

    def __init__(self, jobs: int = CRASH_JOBS, window_s: float = CRASH_WINDOW_S,
                 clock: Callable[[], float] = time.time):
        self.jobs, self.window_s, self.clock = jobs, window_s, clock
        self.crashes: dict[str, dict[str, Crash]] = {}
        self._lock = threading.Lock()

    def observe(self, pod: dict) -> None:
        """Any change of an executor pod (the informer's callback): a crash is recorded once per pod."""
        meta = pod.get("metadata") or {}
        host, uid, job_uid = (pod.get("spec") or {}).get("nodeName"), meta.get("uid"), controller_uid(pod)
        if not (host and uid and job_uid) or (pod.get("status") or {}).get("phase") != "Failed":
            return
        found = classify(pod)
        if found is None or found.kind != "Crashed":
            return
        now = self.clock()
        crash = Crash(job_uid, (meta.get("namespace", ""), (meta.get("labels") or {}).get(JOB_LABEL, "")),
                      found.message, min(now, _finished(pod, now)))
        with self._lock:
            seen = self.crashes.setdefault(host, {})
            if uid not in seen:
                seen[uid] = crash
                self._prune(now)

    def _prune(self, now: float) -> None:
        for host in list(self.crashes):
            kept = sorted(((u, c) for u, c in self.crashes[host].items() if now - c.at < self.window_s),
                          key=lambda item: item[1].at)[-MAX_PER_MACHINE:]
            if kept:
                self.crashes[host] = dict(kept)
            else:
                del self.crashes[host]

    def suspects(self) -> dict[str, list[Crash]]:
        """Machines where pods of `jobs` or more different jobs crashed within the window: machine -> the
        newest crash of each job. A job crashing on JOB_WIDE machines or more counts nowhere."""
        with self._lock:
            self._prune(self.clock())
            spread: dict[str, int] = {}
            for seen in self.crashes.values():
                for job_uid in {c.job_uid for c in seen.values()}:
                    spread[job_uid] = spread.get(job_uid, 0) + 1
            out = {}
            for host, seen in self.crashes.items():
                newest = {c.job_uid: c for c in sorted(seen.values(), key=lambda c: c.at)
                          if spread[c.job_uid] < JOB_WIDE}
                if len(newest) >= self.jobs:
                    out[host] = list(newest.values())
            return out

    def forget(self, host: str) -> None:
        with self._lock:
            self.crashes.pop(host, None)


def cordon_crashed(op: Operator, jobs: dict[tuple[str, str], dict], machines: dict[str, dict]) -> None:
    """Cordons the tracker's suspects (op.crashes) that every rule allows, each with one Event per counted job."""
    for host, crashes in op.crashes.suspects().items():
        machine = machines.get(host)
        if machine is None or (machine.get("spec") or {}).get("unschedulable"):
            op.crashes.forget(host)  # gone, or cordoned already (by us, or by someone else)
            continue
        counted, why_not = _count(op, host, crashes, jobs, machine)
        if len(counted) < op.crashes.jobs:
            op._say(("crashes", host), f"not cordoning {host}, where pods of {len(crashes)} jobs crashed: "
                                       f"{'; '.join(why_not)}")
            continue
        window = f"{op.crashes.window_s / 60:.0f} min"
        why = (f"pods of {len(counted)} different jobs crashed on {host} within {window}: "
               + "; ".join(f"{c.job[0]}/{c.job[1]}: {c.message}" for c, _, _ in counted))
        now = time.time()
        try:
            op.kube.cordon(host, f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(now))}: {why}")
        except ApiException as e:
            op._say(("crashes", host), f"could not cordon {host}: {reason(e)}")
            continue
        op.crashes.forget(host)
        log.warning("cordoned %s: %s", host, why)
        for _, rt, cr in counted:
            rt.state.add_cordoned(host, now)
            op.kube.create_event(cr, "Warning", "MachineCordoned", f"cordoned {host}: {why}")


def _count(op: Operator, host: str, crashes: list[Crash], jobs: dict[tuple[str, str], dict],
           machine: dict) -> tuple[list, list[str]]:
    """The crashes that count (with their job's Runtime and TrainingJob), and why the others do not."""
    labels = (machine.get("metadata") or {}).get("labels") or {}
    counted, why_not, now = [], [], time.time()
    for crash in crashes:
        name = f"{crash.job[0]}/{crash.job[1]}"
        rt = op.runtimes.get(crash.job)
        cr: Optional[dict] = jobs.get(crash.job)
        if rt is None or cr is None or rt.uid != crash.job_uid:
            why_not.append(f"{name} is not a job this operator runs (deleted?)")
            continue
        spec = cr.get("spec") or {}
        pool = {**op.node_pool, **(spec.get("nodeSelector") or {})}
        budget = spec.get("cordonBudget", 1)
        if any(labels.get(k) != v for k, v in pool.items()):
            why_not.append(f"{host} is outside {name}'s node pool "
                           f"({', '.join(f'{k}={v}' for k, v in sorted(pool.items()))})")
        elif sum(1 for t in rt.state.cordoned().values() if now - t < CORDON_WINDOW_S) >= budget:
            why_not.append(f"{name}: spec.cordonBudget={budget} machines were cordoned within the hour already")
        else:
            counted.append((crash, rt, cr))
    return counted, why_not
