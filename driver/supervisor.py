"""What `megascale run` is, in the foreground or (via `launch`) detached: services, the driver, clean-up.

The driver runs as its own process so it can die and come back without the job noticing:
the supervisor restarts it, the way a Kubernetes Deployment would. Nodes are the driver's
(through the backend), but the supervisor stops any that are left when it exits, so nothing
outlives `megascale run`.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import redis

from megascale.common import netemu
from megascale.common.auth import SECRETS_ENV, JobSecrets, redacted, restoring_secrets_env, split_login
from megascale.config import ConfigError, JobConfig, from_dict, load_config, new_run_dir, with_run_dir
from megascale.preflight import absolute_data_path

from . import log
from .arrow_pool import driver_environment
from .backend import NodeLaunch, make_backend
from megascale.common.processes import last_line, stop_process

from .services import JobHandle, Services, bound_broker_memory, start_services, stop_service
from .state import TERMINAL, JobRecord, JobState, JobStore, status_view

POLL_S = 0.5
DRIVER_RESTARTS = 5  # drivers in a row that died within RESTART_WINDOW_S of starting: the supervisor gives up
RESTART_WINDOW_S = 60.0
STOP_WAIT_S = 60.0
EXIT_CODES = {JobState.SUCCEEDED: 0, JobState.FAILED: 1, JobState.STOPPED: 3}


class SupervisorError(RuntimeError):
    """One line for the user: the job could not be started or supervised."""


class Supervisor:
    def __init__(self, cfg: JobConfig, config_path: str):
        self.cfg, self.config_path = cfg, config_path
        self.job = cfg.name
        self.driver: Optional[subprocess.Popen] = None
        self._signals = 0
        self._driver_started = 0.0  # monotonic
        self._short_lives = 0  # drivers in a row that died within RESTART_WINDOW_S of their start

    def run(self, on_status: Optional[Callable[[dict], None]] = None) -> int:
        with claimed(self.job), restoring_secrets_env():
            return self._run(on_status)

    def _run(self, on_status: Optional[Callable[[dict], None]]) -> int:
        existing = JobHandle.load(self.job)
        if existing and existing.live():
            raise SupervisorError(f"job {self.job!r} is already running (pid {existing.supervisor_pid}): "
                                  f"`megascale stop {self.job}` first, or rename it")
        emulated = self.cfg.cluster.network == "emulated"
        if emulated:
            try:
                netemu.require_net_admin()
            except netemu.NetworkError as e:
                raise SupervisorError(str(e)) from None
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a closed terminal stops the job in order too
            signal.signal(sig, self._on_signal)
        run_dir = self._new_run_dir()
        self.cfg = with_run_dir(self.cfg, run_dir)
        # Fresh per run. A login in services.redis moves into the secrets: no password on command lines.
        self.secrets = JobSecrets.generate(self.cfg.services.redis)
        self.secrets.write(JobHandle.secrets_path(self.job))
        # The driver, its executors and their ranks inherit it; this process's own clean-up reads it too.
        os.environ[SECRETS_ENV] = str(JobHandle.secrets_path(self.job))
        try:
            redis_url = split_login(self.cfg.services.redis)[0] if self.cfg.services.redis else None
            # Services listen where every node reaches them: on an emulated network, the bridge's address.
            host = netemu.create(self.job).host_address if emulated else "127.0.0.1"
            services = start_services(redis_url, self.cfg.services.kafka, self.secrets, redis_dir=run_dir / "redis",
                                      host=host)
        except RuntimeError as e:  # NetworkError too
            if emulated:
                _remove_network(self.job)
            raise SupervisorError(str(e)) from None
        handle: Optional[JobHandle] = None
        store: Optional[JobStore] = None
        try:
            store = JobStore.from_url(services.redis_url, self.job, secrets=self.secrets)
            try:
                rec, new = store.submit(JobRecord(job=self.job, config=self.cfg.to_dict(), run_dir=str(run_dir)))
            except redis.RedisError as e:
                raise SupervisorError(f"cannot reach Redis at {redacted(services.redis_url)}: {_line(e)}") from None
            if not new:
                log.info("job %s already in Redis (%s): supervising it", self.job, rec.state.value)
                run_dir = Path(rec.run_dir)
            handle = JobHandle(job=self.job, redis_url=services.redis_url, kafka=services.kafka, run_dir=str(run_dir),
                               config_path=os.path.abspath(self.config_path), supervisor_pid=os.getpid(),
                               redis_pid=services.redis.pid if services.redis else None,
                               kafka_pid=services.broker.proc.pid if services.broker else None,
                               secrets=str(JobHandle.secrets_path(self.job)))
            handle.save()
            return self._supervise(store, services, handle, on_status)
        finally:
            self._stop_driver()
            if store is not None:
                stop_leftover_nodes(self.cfg, store, services.redis_url, services.kafka, run_dir)
            if self.cfg.checkpoint.uri and self.cfg.cluster.backend == "local":
                # The job is over: no restart will restore from the node's host-memory snapshots.
                from megascale.checkpoint import shutdown_keeper

                shutdown_keeper(self.cfg.checkpoint.uri)
            final = _final_status(store)
            services.stop()
            if emulated:
                _remove_network(self.job)
            if handle is not None:  # written last: a final status means everything is down
                handle.final, handle.driver_pid = final, None
                handle.save()

    def _new_run_dir(self) -> Path:
        run_dir = new_run_dir(self.cfg, self.job)
        handler = logging.FileHandler(run_dir / "supervisor.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        return run_dir

    def _supervise(self, store: JobStore, services: Services, handle: JobHandle,
                   on_status: Optional[Callable[[dict], None]]) -> int:
        stop_requested_at: Optional[float] = None
        while True:
            self._restart_dead_services(services, handle)
            bound_broker_memory(services, handle, self.cfg.services.broker_max_mb)
            try:
                rec = store.load()
            except redis.ConnectionError as e:  # a restarted Redis still loading its log, or a brief outage
                log.warning("cannot read the job's record (%s): retrying", _line(e))
                time.sleep(POLL_S)
                continue
            if rec is None:
                raise SupervisorError(f"job {self.job!r} vanished from Redis at {redacted(services.redis_url)}")
            if on_status:
                on_status(status_view(store.status(), rec))
            if self._signals and stop_requested_at is None:
                store.set_desired("stopped")
                stop_requested_at = time.monotonic()
            if self._signals > 1 or (stop_requested_at and time.monotonic() - stop_requested_at > STOP_WAIT_S):
                log.warning("not waiting for an orderly stop any longer")
                return 130
            if self.driver is None or self.driver.poll() is not None:
                if rec.terminal and rec.cleaned:
                    return 130 if self._signals else EXIT_CODES[rec.state]
                self._start_driver(services, handle, rec.run_dir)
            time.sleep(POLL_S)

    @staticmethod
    def _restart_dead_services(services: Services, handle: JobHandle) -> None:
        """Embedded services come back on their ports, so every client finds them where it left them:
        the broker empty (clients re-create its topics), Redis with its appended log read back."""
        if services.broker and not services.broker.alive():
            log.warning("embedded Kafka exited (code %s): restarting it on port %d",
                        services.broker.proc.returncode, services.broker.port)
            services.broker.start()
            handle.kafka_pid = services.broker.proc.pid
            handle.save()
        if services.redis and not services.redis.alive():
            log.warning("embedded Redis exited (code %s): restarting it on port %d from its log in %s",
                        services.redis.proc.returncode, services.redis.port, services.redis.data_dir)
            try:
                services.redis.start()
            except RuntimeError as e:  # the port taken meanwhile, or a log it cannot read
                raise SupervisorError(f"embedded Redis died and could not be restarted: {e}") from None
            handle.redis_pid = services.redis.pid
            handle.save()

    def _start_driver(self, services: Services, handle: JobHandle, run_dir: str) -> None:
        now = time.monotonic()
        if self.driver is not None:
            # Counted in a row, not per window: a driver failing at start (Redis refusing it, say) can take
            # longer than RESTART_WINDOW_S / DRIVER_RESTARTS to die, and would be restarted for ever.
            lived = now - self._driver_started
            self._short_lives = self._short_lives + 1 if lived < RESTART_WINDOW_S else 0
            log.warning("driver exited with code %s after %.0f s: restarting it", self.driver.returncode, lived)
            if self._short_lives >= DRIVER_RESTARTS:
                raise SupervisorError(f"driver died {DRIVER_RESTARTS} times in a row within {RESTART_WINDOW_S:.0f} s "
                                      f"of starting, last with: {last_line(Path(run_dir) / 'driver.log')}")
        self._driver_started = now
        with open(Path(run_dir) / "driver.log", "ab") as out:
            # Own session: a Ctrl-C here must become an orderly stop, not a signal to the driver.
            self.driver = subprocess.Popen([sys.executable, "-m", "megascale.driver", "--job", self.job,
                                            "--redis", services.redis_url, "--kafka", services.kafka,
                                            "--supervisor-pid", str(os.getpid())],
                                           stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True, env=driver_environment())
        handle.driver_pid, handle.driver_started = self.driver.pid, time.time()
        handle.save()
        log.info("driver started (pid %d)", self.driver.pid)

    def _stop_driver(self) -> None:
        if self.driver is not None:
            stop_process(self.driver, grace_s=10)

    def _on_signal(self, signum: int, frame) -> None:
        self._signals += 1


@contextlib.contextmanager
def claimed(job: str) -> Iterator[None]:
    """Holds the job's name for this process: an exclusive lock on `<job>.lock` beside its handle, which the
    kernel drops however the process ends. Two `megascale run`s of one name started together both find no
    live handle (it is written once the services are up), and the second would overwrite the first's secrets
    and handle: its driver locked out of its own Redis, its job lost to `status` and `stop`."""
    path = JobHandle.path(job).with_suffix(".lock")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise SupervisorError(f"job {job!r} is already being run (pid {holder}): `megascale stop {job}` "
                                  "first, or rename it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


def stop_leftover_nodes(cfg: JobConfig, store: JobStore, redis_url: str, kafka: str, run_dir: str | Path) -> None:
    """Whatever happened to the driver, no node outlives the job."""
    try:
        launch = NodeLaunch(cfg.name, redis_url, kafka, str(run_dir), cfg.control.heartbeat_s,
                            network=cfg.cluster.network, link_gbit=cfg.cluster.link_gbit)
        backend = make_backend(cfg.cluster.backend, launch, store.r)
        alive = [n for n, info in backend.list().items() if info.alive]
        if alive:
            log.warning("stopping nodes the driver left running: %s", ", ".join(alive))
            backend.stop(alive)
    except redis.RedisError as e:
        log.warning("could not check for leftover nodes: %s", _line(e))


def finish_for_supervisor(job: str) -> None:
    """What a killed supervisor (SIGKILL, the OOM killer) can no longer do: stop the job's nodes that
    are left, the embedded Redis and broker it started, and write the final status. Its driver calls
    this when the job ends; `megascale stop` when the driver is gone too."""
    handle = JobHandle.load(job)
    if handle is None or handle.final is not None:
        return
    with restoring_secrets_env():
        if handle.secrets:  # so that the nodes' process records are checked against the job's key
            os.environ.setdefault(SECRETS_ENV, handle.secrets)
        _finish(handle)


def _finish(handle: JobHandle) -> None:
    job = handle.job
    store = JobStore.from_url(handle.redis_url, job, timeout_s=3, secrets=handle.job_secrets())
    final = _final_status(store)
    try:
        rec = store.load()
        if rec is not None:
            stop_leftover_nodes(from_dict(rec.config), store, handle.redis_url, handle.kafka, handle.run_dir)
    except redis.RedisError as e:  # Redis gone too: its executors stop their ranks on their own
        log.warning("could not read the job's record: %s", _line(e))
    if final.get("state") not in {s.value for s in TERMINAL}:  # it did not end: it is being ended here
        final = {**final, "state": JobState.STOPPED.value,
                 "reason": f"its supervisor and driver were gone (last state {final.get('state')}); stopped"}
    for pid, address in ((handle.kafka_pid, handle.kafka), (handle.redis_pid, handle.redis_url)):
        stop_service(pid, address.rsplit(":", 1)[-1])
    _remove_network(job)  # if it had one: its names derive from the job's
    handle.final, handle.driver_pid = final, None
    handle.save()
    log.warning("the supervisor (pid %d) was gone: its driver stopped the job's services and wrote its final "
                "status (%s)", handle.supervisor_pid, final.get("state"))


def _remove_network(job: str) -> None:
    try:
        netemu.teardown(job)
    except netemu.NetworkError as e:
        log.warning("could not remove the job's emulated network: %s", e)


def _final_status(store: Optional[JobStore]) -> dict:
    if store is None:
        return {}
    try:
        return status_view(store.status(), store.load())
    except redis.RedisError:
        return {"state": "Unknown", "reason": "Redis unreachable at exit"}


def _line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of a detached job (`megascale launch`): supervise with no display."""
    p = argparse.ArgumentParser(prog="python -m megascale.driver.supervisor")
    p.add_argument("config")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    try:
        # `megascale launch` ran the preflight in the user's shell, in this same directory.
        return Supervisor(absolute_data_path(load_config(args.config, args.overrides)), args.config).run()
    except (ConfigError, SupervisorError) as e:
        print(f"megascale: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
