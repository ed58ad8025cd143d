"""Control-plane subcommands: run, launch, status, pause, resume, stop, evict, spares, chaos, logs.

A job is found through its state file ($MEGASCALE_HOME/jobs/<job>.json); requests go to the
job's Redis (desired state, evictions, spares), where the driver picks them up on its next pass.
Every failure is one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import redis

from megascale.common.auth import SecretsError, redacted
from megascale.common.errors import first_line
from megascale.common.typed import positive_number
from megascale.config import load_config

from .chaos import ALIASES, KINDS
from megascale.common.processes import pid_alive

from .services import JobHandle, home
from .state import JobRecord, JobStore, status_view

LAUNCH_WAIT_S = 60.0
STOP_WAIT_S = 90.0


class CommandError(Exception):
    """One line for the user, naming what to do."""


def register(subparsers: argparse._SubParsersAction) -> None:
    def add(name: str, help_text: str, func: Callable, *arguments: tuple) -> argparse.ArgumentParser:
        p = subparsers.add_parser(name, help=help_text, description=help_text)
        p.error = functools.partial(_usage_error, p)  # one line, not usage + error
        for flags, options in arguments:
            p.add_argument(*flags, **options)
        p.set_defaults(func=_one_line(name, func))
        return p

    config_args = [
        (("config",), dict(help="job YAML")),
        (("--set",), dict(dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                          help="override a config field, e.g. --set cluster.nodes=2")),
        (("--steps",), dict(type=int, help="override train.steps")),
        (("--run-dir",), dict(help="override train.run_dir")),
    ]
    job = (("job",), dict(help="job name"))
    add("run", "run a job in the foreground: services, driver and nodes, with live progress", _run,
        *config_args, (("--quiet",), dict(action="store_true", help="state changes only, no live table")))
    add("launch", "run a job in the background; follow it with status and logs", _launch, *config_args)
    add("status", "show jobs, or one job's state, progress and nodes", _status,
        (("job",), dict(nargs="?", help="job name; all jobs if omitted")),
        (("--json",), dict(action="store_true", help="print the job's status as JSON")))
    kube = (("--kube",), dict(action="store_true",
                              help="JOB is a TrainingJob ([NAMESPACE/]NAME): patch its spec.paused"))
    add("pause", "stop a job's ranks and hold it until resume", _request("paused"), job, kube)
    add("resume", "restart a paused job's ranks", _request("running"), job, kube)
    add("stop", "end a job: stop its nodes and services", _stop, job,
        (("--no-wait",), dict(action="store_true", help="return once the request is recorded")))
    add("evict", "take a node out of a job for good; a spare takes its place", _evict, job,
        (("node",), dict(help="node id, e.g. n1")))
    add("spares", "set how many hot spares a job keeps (a job paused for want of nodes resumes once one reports)",
        _spares, job, (("count",), dict(type=int, help="spare nodes to keep started")))
    add("chaos", "inject a fault into a running job (tests and demos): JOB KIND or KIND JOB", _chaos,
        (("first",), dict(metavar="JOB", help="job name")),
        (("second",), dict(metavar="KIND", help=f"one of {', '.join(KINDS)}")),
        (("--node",), dict(help="node id (default n0; slow-rank: the rank's node)")),
        (("--rank",), dict(type=int, help="global rank (default: the node's first; slow-rank: required)")),
        (("--count",), dict(type=int, default=0,
                            help="crash-loop: stop after this many kills (0 = until the job ends)")),
        (("--factor",), dict(type=positive_number, default=2.0,
                             help="slow-rank: times slower (default 2; 1 ends it)")),
        (("--for",), dict(dest="duration_s", type=positive_number, metavar="S",
                          help="slow-rank, link-down: seconds it lasts (default: until the job ends)")),
        (("--gbit",), dict(type=positive_number, help="slow-link: the node's new link rate, Gbit/s each way")))
    add("logs", "print a job's logs (driver and nodes)", _logs, job,
        (("--node",), dict(help="only this node's executor and ranks")),
        (("--follow", "-f"), dict(action="store_true", help="keep printing as the logs grow")))


def _usage_error(parser: argparse.ArgumentParser, message: str) -> None:
    print(f"{parser.prog}: {message} (see {parser.prog} --help)", file=sys.stderr)
    sys.exit(2)


def _one_line(name: str, func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except CommandError as e:
            print(f"megascale {name}: {e}", file=sys.stderr)
            return 2
        except redis.RedisError as e:
            print(f"megascale {name}: the job's Redis is unreachable ({first_line(e)})", file=sys.stderr)
            return 2
    return run


# -- finding a job -------------------------------------------------------------------------------

def _handle(job: str) -> JobHandle:
    handle = JobHandle.load(job)
    if handle is None:
        known = JobHandle.known()
        hint = f" (known: {', '.join(known)})" if known else f" (none under {home()})"
        raise CommandError(f"no job named {job!r}{hint}; start one with `megascale run CONFIG`")
    return handle


def _live_job(job: str) -> tuple[JobStore, JobRecord]:
    """The store and record of a job that is still running; else a one-line reason."""
    store = _live_store(_handle(job))
    rec = store.load()
    if rec is None or rec.terminal:
        raise CommandError(f"job {job!r} has ended ({rec.state.value if rec else 'unknown'})")
    return store, rec


def _live_store(handle: JobHandle) -> JobStore:
    """The job's Redis, for a job that still runs; else a one-line reason."""
    if not handle.live():
        state = (handle.final or {}).get("state", "ended")
        raise CommandError(f"job {handle.job!r} is not running (last state: {state})")
    try:
        store = JobStore.from_url(handle.redis_url, handle.job, timeout_s=3, secrets=handle.job_secrets())
        store.r.ping()
    except SecretsError as e:
        raise CommandError(f"job {handle.job!r}: {e}") from None
    except redis.RedisError:
        raise CommandError(f"job {handle.job!r}: its Redis at {redacted(handle.redis_url)} is unreachable") from None
    return store


def _current(handle: JobHandle) -> dict:
    """Newest status: live from Redis when the job runs, else what its supervisor left at exit."""
    if handle.live():
        try:
            store = _live_store(handle)
            rec = store.load()
            if rec:
                return status_view(store.status(), rec)
        except CommandError:
            pass
    return {**(handle.final or {}), "state": (handle.final or {}).get("state", "Unknown")}


# -- run / launch ----------------------------------------------------------------------------------

def _config(args: argparse.Namespace):
    """The job's config, checked (megascale.preflight) before anything starts."""
    from megascale.config import ConfigError
    from megascale.preflight import preflight

    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.run_dir:
        overrides.append(f"train.run_dir={args.run_dir}")
    try:
        cfg = preflight(load_config(args.config, overrides))
    except ConfigError as e:
        raise CommandError(str(e)) from None
    return cfg, overrides


def _run(args: argparse.Namespace) -> int:
    from .display import Display
    from .supervisor import Supervisor, SupervisorError

    cfg, _ = _config(args)
    display = Display(cfg.name, cfg.train.steps, live=not args.quiet)
    try:
        with display:
            code = Supervisor(cfg, args.config).run(on_status=display.update)
    except SupervisorError as e:
        raise CommandError(str(e)) from None
    handle = JobHandle.load(cfg.name)
    display.summary(handle.final if handle else {}, handle.run_dir if handle else "")
    return code


def _launch(args: argparse.Namespace) -> int:
    cfg, overrides = _config(args)  # bad config fails here, in the user's shell
    existing = JobHandle.load(cfg.name)
    if existing and existing.live():
        raise CommandError(f"job {cfg.name!r} is already running (pid {existing.supervisor_pid}): "
                           f"`megascale stop {cfg.name}` first")
    log_path = home() / "jobs" / f"{cfg.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "megascale.driver.supervisor", args.config]
    for item in overrides:
        argv += ["--set", item]
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    deadline = time.monotonic() + LAUNCH_WAIT_S
    while time.monotonic() < deadline:
        handle = JobHandle.load(cfg.name)
        if handle and handle.supervisor_pid == proc.pid and handle.driver_pid:
            print(f"launched job {cfg.name} (pid {proc.pid}); run directory {handle.run_dir}\n"
                  f"follow it with: megascale status {cfg.name}   megascale logs {cfg.name} --follow")
            return 0
        if proc.poll() is not None:
            lines = log_path.read_text(errors="replace").strip().splitlines()
            # The supervisor's own one-line error, without its "megascale: " (CommandError adds "megascale launch: ").
            raise CommandError(lines[-1].removeprefix("megascale: ") if lines
                               else f"the job's supervisor exited with code {proc.returncode}")
        time.sleep(0.1)
    raise CommandError(f"job {cfg.name} did not come up within {LAUNCH_WAIT_S:.0f} s: see {log_path}")


# -- status --------------------------------------------------------------------------------------

def _status(args: argparse.Namespace) -> int:
    from .display import job_table, jobs_table, print_renderable

    if args.job is None:
        jobs = JobHandle.known()
        if args.json:
            print(json.dumps({job: _current(JobHandle.load(job)) for job in jobs}, indent=1))
        elif not jobs:
            print(f"no jobs under {home()}")
        else:
            print_renderable(jobs_table([(job, _current(JobHandle.load(job))) for job in jobs]))
        return 0
    handle = _handle(args.job)
    status = _current(handle)
    if args.json:
        print(json.dumps(status, indent=1))
    else:
        print_renderable(job_table(handle.job, status, handle.live()))
        if handle.live() and not pid_alive(handle.supervisor_pid):
            print(f"its supervisor (pid {handle.supervisor_pid}) is gone: the driver carries the job on and stops "
                  f"its services when it ends")
        elif handle.final is None and not handle.live():
            print(f"its supervisor and driver are gone without ending it: `megascale stop {handle.job}` stops "
                  f"what they left running")
    return 0


# -- requests --------------------------------------------------------------------------------------

def _request(desired: str) -> Callable[[argparse.Namespace], int]:
    verb = {"paused": "pause", "running": "resume"}[desired]

    def request(args: argparse.Namespace) -> int:
        if args.kube or os.environ.get("MEGASCALE_KUBE") == "1":  # the same request, through the CR
            from .k8s.cli import KubeCommandError
            from .k8s.cli import request as kube_request

            try:
                print(kube_request(args.job, desired == "paused"))
            except KubeCommandError as e:
                raise CommandError(str(e)) from None
            return 0
        store, rec = _live_job(args.job)
        store.set_desired(desired)  # type: ignore[arg-type]
        print(f"{verb} requested for job {args.job} (now {rec.state.value})")
        return 0
    return request


def _stop(args: argparse.Namespace) -> int:
    handle = _handle(args.job)
    if handle.final is None and not handle.live():  # supervisor and driver killed: clean up after them
        from .supervisor import finish_for_supervisor

        finish_for_supervisor(args.job)
        final = (JobHandle.load(args.job).final or {})  # type: ignore[union-attr]
        print(f"job {args.job} had lost its supervisor and driver: stopped what they left "
              f"(last state: {final.get('state', 'Unknown')})")
        return 0
    store = _live_store(handle)
    store.set_desired("stopped")
    if args.no_wait:
        print(f"stop requested for job {args.job}")
        return 0
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        handle = JobHandle.load(args.job)
        if handle is None or not handle.live():
            final = (handle.final or {}) if handle else {}
            print(f"job {args.job} {final.get('state', 'ended').lower()}: {final.get('reason', '')}".rstrip(": "))
            return 0
        time.sleep(0.2)
    raise CommandError(f"job {args.job} is still stopping after {STOP_WAIT_S:.0f} s: see `megascale logs {args.job}`")


def _evict(args: argparse.Namespace) -> int:
    store, rec = _live_job(args.job)
    in_service = [s.node for s in rec.nodes if s.role != "evicted"]
    if args.node not in in_service:
        raise CommandError(f"job {args.job} has no node {args.node!r} in service (nodes: {', '.join(in_service)})")
    store.request_evict(args.node)
    spares = [s.node for s in rec.slots("spare")]
    print(f"evict requested: {args.node} leaves job {args.job}"
          + (f"; spare {spares[0]} takes its place" if spares else "; no spare left"))
    return 0


def _spares(args: argparse.Namespace) -> int:
    if args.count < 0:
        raise CommandError(f"count: must be >= 0, got {args.count}")
    store, rec = _live_job(args.job)
    store.set_spares(args.count)
    have = len(rec.slots("spare"))
    more = f"; starting {args.count - have} more" if args.count > have else ""
    print(f"job {args.job} keeps {args.count} spare(s) (has {have}{more})")
    return 0


def _chaos(args: argparse.Namespace) -> int:
    from megascale.config import from_dict

    from .chaos import ChaosError, inject

    job, kind = args.first, args.second
    if job in KINDS and kind not in KINDS:  # `megascale chaos slow-rank JOB ...`
        job, kind = kind, job
    if kind not in KINDS:
        raise CommandError(f"kind {kind!r}: one of {', '.join(KINDS)}")
    if kind in ALIASES:
        print(f"megascale chaos: `{kind}` is now `{ALIASES[kind]}` (the node fails its next self-check; "
              f"`slow-rank` slows a rank)", file=sys.stderr)
    store, rec = _live_job(job)
    try:
        print(inject(store, kind, args.node, args.rank, args.count, from_dict(rec.config).checkpoint,
                     factor=args.factor, duration_s=args.duration_s, gbit=args.gbit))
    except ChaosError as e:
        raise CommandError(str(e)) from None
    return 0


# -- logs --------------------------------------------------------------------------------------------

def _log_files(handle: JobHandle, node: Optional[str]) -> list[tuple[str, Path]]:
    run_dir = Path(handle.run_dir)
    nodes_dir = run_dir / "nodes"
    nodes = sorted((p.name for p in nodes_dir.iterdir() if p.is_dir()), key=_node_order) if nodes_dir.is_dir() else []
    if node is not None and node not in nodes:
        raise CommandError(f"job {handle.job} has no logs for node {node!r} (nodes: {', '.join(nodes) or 'none yet'})")
    files = [] if node else [("supervisor", run_dir / "supervisor.log"), ("driver", run_dir / "driver.log")]
    for n in [node] if node else nodes:
        files.append((f"{n}", nodes_dir / n / "executor.log"))
        ranks = sorted(nodes_dir.glob(f"{n}/rank*.log"), key=lambda p: _node_order(p.stem[4:]))
        files += [(f"{n}/{p.stem}", p) for p in ranks]
    return files


def _node_order(name: str) -> tuple:
    digits = "".join(c for c in name if c.isdigit())
    return (int(digits) if digits else 0, name)


def _logs(args: argparse.Namespace) -> int:
    handle = _handle(args.job)
    offsets: dict[Path, int] = {}
    while True:
        for label, path in _log_files(handle, args.node):
            try:
                with open(path, "rb") as f:
                    f.seek(offsets.get(path, 0))
                    chunk = f.read()
            except FileNotFoundError:
                continue
            end = chunk.rfind(b"\n") + 1
            offsets[path] = offsets.get(path, 0) + end
            for line in chunk[:end].decode(errors="replace").splitlines():
                print(f"[{label}] {line}")
        sys.stdout.flush()
        if not args.follow:
            return 0
        handle = JobHandle.load(args.job) or handle
        if not pid_alive(handle.supervisor_pid) and handle.final is not None:
            return 0
        try:
            time.sleep(0.5)
        except KeyboardInterrupt:
            return 0
