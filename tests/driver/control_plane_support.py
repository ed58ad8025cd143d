"""Helpers the driver's end-to-end tests share: a job YAML, a launched job seen from a second shell, the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from megascale.cli import main
from megascale.common.processes import pid_alive
from megascale.driver.backend import Backend
from megascale.driver.services import JobHandle, port_open
from megascale.driver.state import JobState, JobStore, status_view

ROOT = Path(__file__).resolve().parents[2]


def job_yaml(tmp_path: Path, name: str, steps: int, **control) -> str:
    config = {
        "name": name,
        "model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
        "parallelism": {"dp": 4}, "batch": {"micro": 1, "global": 4},
        "cluster": {"nodes": 2, "spares": 1},
        "control": {"heartbeat_s": 0.5, "dead_after_s": 8, "start_timeout_s": 90, "command_timeout_s": 30, **control},
        "train": {"steps": steps, "run_dir": str(tmp_path / "runs")},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


class StubBackend(Backend):
    """A backend with no nodes behind it, for the driver's decisions alone; it notes what it evicted and which
    evicted nodes it was told to forget."""

    def __init__(self):
        self.evicted: list[str] = []
        self.forgotten: list[str] = []

    def start(self, nodes): pass

    def stop(self, nodes, grace_s=10.0): pass

    def list(self): return {}

    def evict(self, node): self.evicted.append(node)

    def forget_evicted(self, nodes): self.forgotten.extend(nodes)

    def log_files(self, node): return []


class Job:
    """A launched job, seen the way a second shell sees it: through its state file and Redis."""

    def __init__(self, name: str):
        self.name = name
        self.handle = JobHandle.load(name)
        self.store = JobStore.from_url(self.handle.redis_url, name, secrets=self.handle.job_secrets())

    def refresh(self) -> JobHandle:
        self.handle = JobHandle.load(self.name)
        return self.handle

    def state(self) -> JobState:
        return self.store.load().state

    def status(self) -> dict:
        return status_view(self.store.status(), None)

    def in_state(self, state: JobState, **fields):
        def check():
            rec = self.store.load()
            return rec if rec.state == state and all(getattr(rec, k) == v for k, v in fields.items()) else None
        return check

    def ended(self):
        handle = self.refresh()
        return handle.final if handle.final and not pid_alive(handle.supervisor_pid) else None

    def node_pid(self, node: str) -> int:
        return json.loads(self.store.r.hget(f"megascale:{{{self.name}}}:local", node))["pid"]

    def assert_services_gone(self) -> None:
        for address in (self.handle.redis_url.rsplit(":", 1)[1], self.handle.kafka.rsplit(":", 1)[1]):
            assert not port_open(int(address)), f"port {address} still open"


def launch(capsys, config: str, name: str) -> Job:
    assert main(["launch", config]) == 0
    assert f"launched job {name}" in capsys.readouterr().out
    return Job(name)


def cli(capsys, *argv: str) -> str:
    code = main(list(argv))
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out



def fast(tmp_path: Path, name: str, steps: int, **control) -> str:
    """A job YAML whose faults are detected within seconds, with no self-checks."""
    return job_yaml(tmp_path, name, steps, **{"dead_after_s": 3, "hang_after_s": 4, "selfcheck": False, **control})


def events(job: Job) -> str:
    return Path(job.handle.run_dir, "driver.log").read_text()
