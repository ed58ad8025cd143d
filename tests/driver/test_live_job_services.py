"""A live job's services: the Grafana dashboard's PromQL against a real Prometheus (Debian's `prometheus`)
scraping its driver, and its embedded Redis killed and brought back (real processes, stand-in ranks).

Grafana itself is not installable here: its variables are substituted the way it would ($job the job,
$__rate_interval four scrape intervals), each query goes through Prometheus's HTTP API, and a heatmap
cell is what Grafana draws there: a row per series (named by its legend), a column per evaluation time.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import redis
import yaml
from megascale.common.messages import acks_key, command_stream
from megascale.common.processes import free_port, pid_alive, stop_process
from megascale.driver.state import JobState

from control_plane_support import ROOT, Job, cli, job_yaml, launch  # noqa: E402 - tests/driver is on sys.path (conftest)

DASHBOARD = ROOT / "deploy/grafana/megascale-dashboard.json"
SCRAPE_S = 1
RATE_INTERVAL = f"{4 * SCRAPE_S}s"  # Grafana's $__rate_interval floor: four scrape intervals
SLOW_RANK, RANKS = 1, {"0", "1", "2", "3"}
# Families only a real training run or a recovery fills; the stand-in ranks neither validate nor fail here.
NOT_FROM_STAND_INS = ("megascale_job_val_loss", "megascale_job_mttr_seconds")

NO_PROMETHEUS = ("prometheus not installed (Debian package `prometheus`): the dashboard's PromQL was not "
                 "checked against a real Prometheus (the Redis crash was)")


def targets() -> list[dict]:
    """Every query of every panel, as (panel title, expression with Grafana's variables substituted, legend)."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [{"panel": p["title"], "type": p["type"], "legend": t.get("legendFormat", ""),
             "expr": t["expr"].replace("$__rate_interval", RATE_INTERVAL)}
            for p in panels for t in p.get("targets", [])]


class Prometheus:
    """A Prometheus scraping one target every SCRAPE_S, on 127.0.0.1, with its storage in `workdir`."""

    def __init__(self, workdir: Path, target: str):
        config = workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            # honor_labels: the driver's `job` label names the training job; Prometheus would otherwise
            # rename it exported_job and put the scrape config's name in `job`.
            "scrape_configs": [{"job_name": "megascale", "honor_labels": True, "scrape_interval": f"{SCRAPE_S}s",
                                "static_configs": [{"targets": [target]}]}]}))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = workdir / "prometheus.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def get(self, path: str, **params) -> dict:
        with urllib.request.urlopen(f"{self.url}{path}?{urllib.parse.urlencode(params)}", timeout=5) as reply:
            return json.loads(reply.read())

    def ready(self) -> bool:
        try:
            return self.get("/api/v1/targets")["data"]["activeTargets"][0]["health"] == "up"
        except (OSError, IndexError, KeyError):
            return False

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["data"]["result"]

    def query_range(self, expr: str, start: float, end: float) -> list[dict]:
        return self.get("/api/v1/query_range", query=expr, start=start, end=end, step=SCRAPE_S)["data"]["result"]

    def stop(self) -> None:
        stop_process(self.proc, grace_s=10)


def legend(fmt: str, labels: dict) -> str:
    """Grafana's legendFormat: `{{label}}` replaced by the series' label."""
    for name, value in labels.items():
        fmt = fmt.replace("{{" + name + "}}", value)
    return fmt


def test_dashboard_queries_on_prometheus_then_the_job_survives_kill_9_of_its_redis(tmp_path, capsys, wait,
                                                                                  monkeypatch):
    """One live job (a job start costs most of a test's time) checked twice: the dashboard's queries against
    a real Prometheus scraping its driver, then kill -9 of its embedded Redis, which the supervisor restarts
    from its append-only log with the record, command streams and acks intact and the ranks unaware.
    Without the `prometheus` binary the Redis half still runs and the test ends skipped, saying why."""
    monkeypatch.setenv("SIM_SLOW_RANK", f"{SLOW_RANK}:4")  # rank 1 (on n0) computes 4x as long as its peers
    monkeypatch.setenv("SIM_STEP_S", "0.05")
    metrics_port = free_port()
    # Started first, scraping the port the driver will serve on: both come up at once.
    prometheus = Prometheus(tmp_path, f"127.0.0.1:{metrics_port}") if shutil.which("prometheus") else None
    try:
        job = launch(capsys, job_yaml(tmp_path, "cp-live", steps=100000, prometheus_port=metrics_port), "cp-live")
        wait(lambda: job.state() == JobState.RUNNING and job.status().get("step"), 60, "training progress")
        running = time.monotonic()
        if prometheus:
            _check_dashboard(prometheus, job, wait)
        # past appendfsync everysec: what the job wrote up to Running (record, commands, acks) is on disk
        time.sleep(max(0.0, running + 1.2 - time.monotonic()))
        _check_redis_crash(job, wait)
        if prometheus:  # the driver's endpoint outlived the outage
            wait(lambda: prometheus.query(f'megascale_job_step{{job="{job.name}"}} > {job.status()["step"] - 3}'),
                 10, "Prometheus to scrape the job's progress after the Redis restart")
    finally:
        if prometheus:
            prometheus.stop()
    assert "job cp-live stopped: stopped by user" in cli(capsys, "stop", job.name)
    job.assert_services_gone()
    if prometheus is None:
        pytest.skip(NO_PROMETHEUS)


def _check_dashboard(prometheus: Prometheus, job: Job, wait) -> None:
    wait(prometheus.ready, 30, f"Prometheus to scrape the driver (see {prometheus.log})")
    queries = [t for t in targets() if not t["expr"].startswith(NOT_FROM_STAND_INS)]
    assert len(queries) == len(targets()) - len(NOT_FROM_STAND_INS) > 10  # the exemptions name whole queries

    def answered() -> dict | None:
        results = {t["expr"]: prometheus.query(t["expr"].replace("$job", job.name)) for t in queries}
        return results if all(results.values()) and _every_rank(results) and _straggler(results) else None
    results = wait(answered, 30, "every dashboard query to return series")
    for t in queries:
        for series in results[t["expr"]]:
            assert series["metric"].get("job", job.name) == job.name, (t["panel"], series)

    # A synchronous step takes every rank as long as the slowest: the step-time heatmap has a row per
    # rank; the straggler heatmap (compute against peers) puts the slow rank's row on top in every column.
    steps = wait(lambda: _heatmap(prometheus, "Step time: rank x time", job.name), 20, "step-time cells")
    assert set(steps) == RANKS, steps
    slowness = wait(lambda: _heatmap(prometheus, "Slowness vs peers", job.name), 20, "straggler heatmap cells")
    assert set(slowness) == RANKS, slowness
    for i in range(min(len(v) for v in slowness.values())):
        column = {rank: values[i] for rank, values in slowness.items()}
        assert max(column, key=column.get) == str(SLOW_RANK), (i, column)


def _check_redis_crash(job: Job, wait) -> None:
    before, r = job.store.load(), job.store.r
    commands = {n: r.xlen(command_stream(job.name, n)) for n in ("n0", "n1")}
    acks = r.hgetall(acks_key(job.name))
    assert all(commands.values()) and set(acks) >= {b"n0", b"n1"}, (commands, acks)

    old, url = job.handle.redis_pid, job.handle.redis_url
    os.kill(old, signal.SIGKILL)
    wait(lambda: not pid_alive(old), 5, "Redis to die")
    wait(lambda: job.refresh().redis_pid not in (None, old), 20, "the supervisor to restart Redis")
    assert job.handle.redis_url == url  # the same port: every client finds it where it left it
    after = wait(lambda: _load(job), 20, "the job's record back from the log")
    assert (after.run_dir, after.incarnation, after.restarts) == (before.run_dir, before.incarnation, 0)
    assert all(r.xlen(command_stream(job.name, n)) >= count for n, count in commands.items())
    assert all(r.hget(acks_key(job.name), node) is not None for node in acks)
    assert any(Path(job.handle.run_dir, "redis").iterdir())  # the log lives in the job's run directory
    step = job.status()["step"]
    wait(lambda: (job.status().get("step") or 0) >= step + 5, 20, "training to go on")
    assert job.store.load().incarnation == before.incarnation  # no rank noticed
    supervisor = Path(job.handle.run_dir, "supervisor.log").read_text()
    assert "embedded Redis exited (code -9): restarting it on port" in supervisor
    assert "driver exited" not in supervisor  # the driver reconnected rather than died


def _load(job: Job):
    try:
        return job.store.load()
    except redis.RedisError:  # still loading its log
        return None


def _every_rank(results: dict) -> bool:
    """Every per-rank query answers for all four ranks."""
    return all({s["metric"]["rank"] for s in series} == RANKS
               for expr, series in results.items() if expr.startswith("megascale_rank_"))


def _straggler(results: dict) -> bool:
    return any(s["metric"].get("rank") == str(SLOW_RANK)
               for expr, series in results.items() if "straggler_slowdown" in expr for s in series)


def _heatmap(prometheus: Prometheus, title: str, job: str) -> dict[str, list[float]] | None:
    """The heatmap Grafana draws from the panel titled `title...` over the last 5 s: row (its legend) ->
    cell values by time; None until every row has at least two cells."""
    panel = next(t for t in targets() if t["type"] == "heatmap" and t["panel"].startswith(title))
    now = time.time()
    series = prometheus.query_range(panel["expr"].replace("$job", job), now - 5, now)
    rows = {legend(panel["legend"], s["metric"]): [float(v) for _, v in s["values"]] for s in series}
    return rows if rows and min(len(v) for v in rows.values()) >= 2 else None
