"""Shared by the conftests of tests/driver, tests/executor and tests/k8s: real services and real
processes, with a check that every process a test started is gone after it.

Each test gets its own MEGASCALE_HOME and a unique MEGASCALE_TEST_TAG in the environment; every
process it starts (supervisor, driver, executors, ranks, Redis, tansu) inherits the tag, so
the leak check finds exactly this test's processes and nobody else's.
"""
from __future__ import annotations

import contextlib
import time
import uuid

import psutil
import pytest
from megascale.driver import sim_rank
from megascale.driver.services import EmbeddedKafka

from megascale.common.embedded_redis import EmbeddedRedis

TAG = "MEGASCALE_TEST_TAG"


def tagged(tag: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(TAG) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


@contextlib.contextmanager
def no_process_left(monkeypatch):
    """Tags every process started inside with a fresh MEGASCALE_TEST_TAG; fails if one outlives it."""
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG, tag)
    yield
    deadline = time.monotonic() + 15
    while (left := tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    names = []
    for proc in left:
        try:
            names.append(" ".join(proc.cmdline()[:4]))
            proc.kill()  # ours by tag: clean up so one failure does not poison the next test
        except psutil.Error:  # it ended (or became a zombie) meanwhile
            continue
    assert not names, f"processes left behind: {names}"


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Own MEGASCALE_HOME, stand-in ranks (driver/sim_rank.py) by default, and no process left behind."""
    monkeypatch.setenv("MEGASCALE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MEGASCALE_RANK_ENTRY", sim_rank.__file__)
    monkeypatch.setenv("SIM_STEP_S", "0.2")
    with no_process_left(monkeypatch):
        yield tmp_path


@pytest.fixture
def redis_server():
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def broker():
    kafka = EmbeddedKafka().start()
    yield kafka
    kafka.stop(kill=True)


def wait_for(predicate, timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture
def wait():
    """`wait(predicate, timeout, what)`: the predicate's first truthy value, or a failure naming `what`."""
    return wait_for
