"""`megascale kube ...`: TrainingJobs through the Kubernetes API.

    megascale kube apply-crd [--print]     install or update the CRD (needs cluster-admin rights)
    megascale kube operator [...]          run the operator (what deploy/operator.yaml runs)
    megascale kube pause JOB / resume JOB  patch spec.paused: the very patch `kubectl patch --type merge` sends
    megascale kube status [JOB] [--json]   jobs and their status

`megascale pause JOB` talks to a local job's Redis; given --kube (or MEGASCALE_KUBE=1) it calls
`request` here instead.
Every failure is one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

if TYPE_CHECKING:
    from .kube import Kube

# The Kubernetes client is imported by the commands, not here: every `megascale` command builds this parser.


CLI_RETRIES = 1  # a command at a terminal says the API server is unreachable at once (the operator retries more)


class KubeCommandError(Exception):
    """One line for the user."""


def register(subparsers: argparse._SubParsersAction) -> None:
    kube = subparsers.add_parser("kube", help="TrainingJobs on Kubernetes: CRD, operator, pause/resume, status",
                                 description=__doc__.split("\n\n")[0])
    sub = kube.add_subparsers(dest="kube_command", required=True)

    def add(name: str, help_text: str, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--kubeconfig", help="default: $KUBECONFIG, ~/.kube/config, or the pod's service account")
        p.add_argument("--context", help="kubeconfig context")
        p.add_argument("-n", "--namespace", help="default: the context's namespace")
        p.set_defaults(func=_one_line(f"kube {name}", func))
        return p

    add("apply-crd", "create or update the TrainingJob CustomResourceDefinition", _apply_crd).add_argument(
        "--print", action="store_true", help="print its YAML instead (deploy/crd.yaml)")
    op = add("operator", "run the operator: a driver per TrainingJob, pods, evictions, status", _operator)
    op.add_argument("--all-namespaces", action="store_true", help="watch every namespace (needs a ClusterRole)")
    op.add_argument("--redis", default=os.environ.get("MEGASCALE_REDIS"), help="default Redis URL ($MEGASCALE_REDIS)")
    op.add_argument("--kafka", default=os.environ.get("MEGASCALE_KAFKA"),
                    help="default Kafka bootstrap servers ($MEGASCALE_KAFKA)")
    op.add_argument("--tick-s", type=float, default=1.0, help="seconds between reconcile passes")
    op.add_argument("--status-every-s", type=float, default=5.0, help="progress status writes at most this often")
    op.add_argument("--checkpoint-every-s", type=float, default=60.0, help="how often to list the checkpoints")
    op.add_argument("--missing-grace-s", type=float, default=30.0, help="a pod missing this long is a failed node")
    op.add_argument("--driver-log-dir", type=Path, help="one log file per job's driver (default: this stderr)")
    op.add_argument("--run-dir", help="the ranks' run directory in the pods (default /var/lib/megascale/run)")
    op.add_argument("--service-account", action="append",
                    default=[a for a in os.environ.get("MEGASCALE_SERVICE_ACCOUNTS", "").split(",") if a],
                    help="a service account jobs may name in spec.serviceAccountName (repeatable; "
                         "$MEGASCALE_SERVICE_ACCOUNTS, comma-separated); default: none")
    op.add_argument("--priority-class", default=os.environ.get("MEGASCALE_PRIORITY_CLASS"),
                    help="the executor pods' PriorityClass when a job's spec.priorityClassName is unset "
                         "($MEGASCALE_PRIORITY_CLASS; create one above the cluster's batch work)")
    op.add_argument("--node-pool", action="append", metavar="KEY=VALUE",
                    default=[a for a in os.environ.get("MEGASCALE_NODE_POOL", "").split(",") if a],
                    help="a label every machine the operator may cordon carries (repeatable; $MEGASCALE_NODE_POOL, "
                         "comma-separated); default: any machine")
    op.add_argument("--lease", default="megascale-operator", help="the Lease the replicas elect a leader with")
    op.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE"),
                    help="its namespace (default: $POD_NAMESPACE, else the context's)")
    op.add_argument("--lease-duration-s", type=int, default=15, help="others take the Lease over after this long")
    op.add_argument("--renew-deadline-s", type=float, default=10.0,
                    help="the leader stops its drivers when it could not renew the Lease for this long")
    op.add_argument("--retry-period-s", type=float, default=2.0, help="renewals and attempts, this often")
    for verb, paused in (("pause", True), ("resume", False)):
        add(verb, f"{verb} a TrainingJob (spec.paused={str(paused).lower()})", _pause(paused)).add_argument(
            "job", help="TrainingJob name")
    status = add("status", "show TrainingJobs, or one with its nodes and conditions", _status)
    status.add_argument("job", nargs="?", help="TrainingJob name; all in the namespace if omitted")
    status.add_argument("--json", action="store_true", help="print the status as JSON")


def _one_line(name: str, func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        try:
            with _plain_errors():
                return func(args)
        except KubeCommandError as e:
            print(f"megascale {name}: {e}", file=sys.stderr)
            return 2
    return run


@contextlib.contextmanager
def _plain_errors() -> Iterator[None]:
    """The client's exceptions as one line each."""
    import urllib3
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config import ConfigException

    from .kube import reason
    try:
        yield
    except ApiException as e:
        raise KubeCommandError(reason(e)) from None
    except ConfigException as e:
        raise KubeCommandError(f"no Kubernetes configuration ({str(e).strip().splitlines()[0]})") from None
    except urllib3.exceptions.HTTPError as e:
        raise KubeCommandError(f"cannot reach the Kubernetes API server ({type(e).__name__})") from None


def _kube(args: argparse.Namespace) -> tuple[Kube, str]:
    from .kube import Kube, connect, current_namespace

    namespace = args.namespace or current_namespace(args.kubeconfig, args.context)
    return Kube(connect(args.kubeconfig, args.context, retries=CLI_RETRIES)), namespace


def _get(kube: Kube, namespace: str, name: str) -> dict:
    cr = kube.get_job(namespace, name)
    if cr is None:
        names = [j["metadata"]["name"] for j in kube.list_jobs(namespace)]
        known = f" (there: {', '.join(names)})" if names else ""
        raise KubeCommandError(f"no TrainingJob named {name!r} in namespace {namespace!r}{known}")
    return cr


# -- commands ----------------------------------------------------------------------------------

def _apply_crd(args: argparse.Namespace) -> int:
    from .crd import crd, crd_yaml

    if args.print:
        sys.stdout.write(crd_yaml())
        return 0
    kube, _ = _kube(args)
    body = crd()
    print(f"customresourcedefinition {body['metadata']['name']} {kube.apply_crd(body)}")
    return 0


def _operator(args: argparse.Namespace) -> int:
    from .kube import Kube, connect, current_namespace
    from .leader import LeaseConfig
    from .operator import Operator
    from .spec import PodPolicy, ServiceDefaults

    pool = dict(label.partition("=")[::2] for label in args.node_pool)
    if any(not key or not value for key, value in pool.items()):
        raise KubeCommandError(f"--node-pool: expected KEY=VALUE labels, got {','.join(args.node_pool)}")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    namespace = None if args.all_namespaces else (args.namespace or os.environ.get("WATCH_NAMESPACE")
                                                  or current_namespace(args.kubeconfig, args.context))
    try:
        lease = LeaseConfig(args.lease, args.lease_namespace or current_namespace(args.kubeconfig, args.context),
                            args.lease_duration_s, args.renew_deadline_s, args.retry_period_s)
    except ValueError as e:
        raise KubeCommandError(str(e)) from None
    kube = Kube(connect(args.kubeconfig, args.context))
    operator = Operator(kube, namespace, ServiceDefaults(args.redis, args.kafka), kubeconfig=args.kubeconfig,
                        tick_s=args.tick_s, status_every_s=args.status_every_s,
                        checkpoint_every_s=args.checkpoint_every_s, missing_grace_s=args.missing_grace_s,
                        driver_log=args.driver_log_dir, **({"run_dir": args.run_dir} if args.run_dir else {}),
                        pod_policy=PodPolicy(frozenset(args.service_account), args.priority_class), node_pool=pool,
                        lease=lease)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: operator.stop())
    operator.run()
    return 0


def request(job: str, paused: bool, namespace: Optional[str] = None, kubeconfig: Optional[str] = None,
            context: Optional[str] = None) -> str:
    """Pauses or resumes a TrainingJob as `kubectl patch trainingjob JOB --type merge -p
    '{"spec":{"paused":true}}'` does; JOB may be NAMESPACE/NAME. Returns the line to print; any
    failure raises KubeCommandError."""
    if "/" in job:
        namespace, job = job.split("/", 1)
    with _plain_errors():
        from .kube import Kube, connect, current_namespace

        kube = Kube(connect(kubeconfig, context))
        namespace = namespace or current_namespace(kubeconfig, context)
        phase = (_get(kube, namespace, job).get("status") or {}).get("phase", "Pending")
        if phase in ("Succeeded", "Failed", "Stopped"):
            raise KubeCommandError(f"TrainingJob {namespace}/{job} has ended ({phase})")
        kube.patch_job(namespace, job, {"spec": {"paused": paused}})
    return f"{'pause' if paused else 'resume'} requested for TrainingJob {namespace}/{job} (now {phase})"


def _pause(paused: bool) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(request(args.job, paused, args.namespace, args.kubeconfig, args.context))
        return 0
    return run


def _status(args: argparse.Namespace) -> int:
    kube, namespace = _kube(args)
    if args.job:
        cr = _get(kube, namespace, args.job)
        print(json.dumps(cr.get("status") or {}, indent=1) if args.json else describe(cr))
        return 0
    jobs = kube.list_jobs(namespace)
    if args.json:
        print(json.dumps({j["metadata"]["name"]: j.get("status") or {} for j in jobs}, indent=1))
    elif not jobs:
        print(f"no TrainingJobs in namespace {namespace}")
    else:
        print(table(jobs))
    return 0


# -- formatting --------------------------------------------------------------------------------

def _num(value, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def table(jobs: list[dict]) -> str:
    rows = [("NAME", "PHASE", "STEP", "LOSS", "RESTARTS", "ETTR", "NODES")]
    for j in jobs:
        s = j.get("status") or {}
        rows.append((j["metadata"]["name"], s.get("phase", "-"), _num(s.get("step")), _num(s.get("loss"), "{:.4g}"),
                     _num(s.get("restarts")), _num(s.get("ettr"), "{:.3f}"), str(j["spec"].get("nodes", "-"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def describe(cr: dict) -> str:
    s, meta = cr.get("status") or {}, cr["metadata"]
    total = f"/{s['totalSteps']}" if s.get("totalSteps") else ""
    lines = [f"{meta['namespace']}/{meta['name']}  {s.get('phase', 'Pending')}  step {_num(s.get('step'))}{total}  "
             f"loss {_num(s.get('loss'), '{:.4g}')}  restarts {_num(s.get('restarts'))}  "
             f"incarnation {_num(s.get('incarnation'))}  ETTR {_num(s.get('ettr'), '{:.3f}')}"
             + ("  (paused)" if cr["spec"].get("paused") else "")]
    if s.get("reason"):
        lines.append(f"  reason: {s['reason']}")
    for node in s.get("nodes") or []:
        where = f" on {node['host']}" if node.get("host") else ""
        health = "" if node["role"] == "evicted" else ("  alive" if node.get("alive") else "  silent")
        dead = f"  dead: {node['dead']}" if node.get("dead") else ""
        lines.append(f"  {node['id']:<5} {node['role']:<8} pod {node.get('pod', '-')}{where}{health}{dead}")
    if s.get("evictedNodes"):
        lines.append(f"  evicted machines: {', '.join(s['evictedNodes'])}")
    if s.get("lastCheckpoint"):
        lines.append(f"  last checkpoint: step {s['lastCheckpoint'].get('step')} in {s['lastCheckpoint'].get('uri')}")
    for cond in s.get("conditions") or []:
        message = f": {cond['message']}" if cond.get("message") and cond["status"] == "True" else ""
        lines.append(f"  {cond['type']}={cond['status']}{message}")
    if s.get("lastSyncTime"):
        lines.append(f"  updated {s['lastSyncTime']} (now {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())})")
    return "\n".join(lines)
