"""Prometheus exposition of a job: status, per-rank step and segment times, stragglers.

`prometheus_client` renders and serves the families `families` builds from the driver's status and
each rank's newest timings. `JobMetrics` is the driver's glue: the metrics consumer feeds it, and
every scrape of `/metrics` collects from it. The endpoint listens on 127.0.0.1 unless
$MEGASCALE_METRICS_HOST names another address (0.0.0.0 in the operator's pod, deploy/operator.yaml,
so that an in-cluster Prometheus reaches it).
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Iterable, Optional, Sequence
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from .stragglers import Finding, StragglerMonitor, slowness

HOST_ENV = "MEGASCALE_METRICS_HOST"
# What `generate_latest` writes, and what the endpoint answers a scrape without an Accept header with.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

_JOB = ("job",)
_RANK = ("job", "rank", "node")
# Sample name -> (type, help, labels). Grafana's dashboard may query only these (tests check it).
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "megascale_job_info": ("gauge", "Always 1; the job's state is in the `state` label.", (*_JOB, "state")),
    "megascale_job_step": ("gauge", "Newest training step the job reported.", _JOB),
    "megascale_job_total_steps": ("gauge", "Steps the job is configured to train.", _JOB),
    "megascale_job_loss": ("gauge", "Training loss at the newest step.", _JOB),
    "megascale_job_tokens_per_second": ("gauge", "Training throughput at the newest step.", _JOB),
    "megascale_job_val_loss": ("gauge", "Validation loss at the newest validation (eval.every).", _JOB),
    "megascale_job_val_perplexity": ("gauge", "Validation perplexity, exp(val_loss).", _JOB),
    "megascale_job_val_step": ("gauge", "The step of the newest validation.", _JOB),
    "megascale_job_restarts_total": ("counter", "Automatic restarts of the job's ranks.", _JOB),
    "megascale_job_ettr_ratio": ("gauge", "Effective training time ratio: productive time / wall time.", _JOB),
    "megascale_job_mttr_seconds": ("gauge", "Mean time to recovery after a fault.", _JOB),
    "megascale_rank_step": ("gauge", "Newest step a rank reported timings for.", _RANK),
    "megascale_rank_step_seconds": ("gauge", "A rank's wall time of its newest step.", _RANK),
    "megascale_rank_segment_seconds": ("gauge", "A rank's time in one timer segment of its newest step.",
                                       (*_RANK, "segment")),
    "megascale_rank_slowness_ratio": ("gauge", "A rank's compute time over its TP/DP peers' median (1 = normal).",
                                      _RANK),
    "megascale_stragglers": ("gauge", "Ranks currently reported as stragglers.", _JOB),
    "megascale_straggler_slowdown_ratio": ("gauge", "A straggler's slowdown against its peers, per segment.",
                                           (*_RANK, "segment", "dimension")),
    "megascale_metrics_records_total": ("counter", "Step-timing records the driver stored.", _JOB),
    "megascale_metrics_dropped_total": ("counter", "Step-timing records senders dropped because their queue was full.",
                                        _JOB),
    "megascale_heartbeats_rejected_total": ("counter", "Heartbeat records the driver dropped, by reason (unsigned, "
                                            "bad mac, replay, unknown node, malformed, other job).", (*_JOB, "reason")),
}
_FAMILY = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}  # a counter family adds `_total` itself


class _Families:
    """Every family in METRICS, filled sample by sample; a value of None is left out."""

    def __init__(self) -> None:
        self.by_name: dict[str, Metric] = {name: _FAMILY[kind](name, help_text, labels=labels)
                                           for name, (kind, help_text, labels) in METRICS.items()}

    def add(self, name: str, value: Optional[float], **labels: object) -> None:
        if value is not None:
            self.by_name[name].add_metric([str(labels[k]) for k in METRICS[name][2]], float(value))

    def filled(self) -> list[Metric]:
        return [family for family in self.by_name.values() if family.samples]


def families(job: str, status: dict, latest: Iterable[dict] = (), findings: Iterable[Finding] = (),
             scores: Optional[dict[int, float]] = None, ranks_per_node: int = 8, stored: Optional[int] = None,
             dropped: Optional[int] = None, node_names: Sequence[str] = ()) -> list[Metric]:
    """The job's metric families: `status` is the driver's status dict, `latest` each rank's newest
    StepTimings; `node_names[k]` names the node of ranks k*ranks_per_node.. (default `node<k>`, as
    findings do)."""
    out = _Families()
    out.add("megascale_job_info", 1, job=job, state=status.get("state", "unknown"))
    out.add("megascale_job_step", status.get("step"), job=job)
    out.add("megascale_job_total_steps", status.get("total_steps"), job=job)
    out.add("megascale_job_loss", status.get("loss"), job=job)
    out.add("megascale_job_tokens_per_second", status.get("tokens_per_s"), job=job)
    out.add("megascale_job_val_loss", status.get("val_loss"), job=job)
    out.add("megascale_job_val_perplexity", status.get("val_ppl"), job=job)
    out.add("megascale_job_val_step", status.get("val_step"), job=job)
    out.add("megascale_job_restarts_total", status.get("restarts", 0), job=job)
    out.add("megascale_job_ettr_ratio", status.get("ettr"), job=job)
    out.add("megascale_job_mttr_seconds", status.get("mttr_s"), job=job)
    for rec in sorted(latest, key=lambda r: r["rank"]):
        node = rec["rank"] // ranks_per_node
        name = node_names[node] if node < len(node_names) else f"node{node}"
        labels = {"job": job, "rank": rec["rank"], "node": name}
        out.add("megascale_rank_step", rec["step"], **labels)
        out.add("megascale_rank_step_seconds", rec["total"], **labels)
        for segment, seconds in rec["segments"].items():
            out.add("megascale_rank_segment_seconds", seconds, **labels, segment=segment)
        if scores and rec["rank"] in scores:
            out.add("megascale_rank_slowness_ratio", scores[rec["rank"]], **labels)
    findings = list(findings)
    out.add("megascale_stragglers", len({f.rank for f in findings}), job=job)
    for f in findings:
        out.add("megascale_straggler_slowdown_ratio", f.slowdown, job=job, rank=f.rank, node=f.node_name,
                segment=f.segment, dimension=f.dimension)
    out.add("megascale_metrics_records_total", stored, job=job)
    out.add("megascale_metrics_dropped_total", dropped, job=job)
    for reason, count in sorted(status.get("rejected", {}).items()):
        out.add("megascale_heartbeats_rejected_total", count, job=job, reason=reason)
    return out.filled()


class _Collector:
    """A prometheus_client collector whose families are built when it is collected (on each scrape)."""

    def __init__(self, build: Callable[[], Iterable[Metric]]) -> None:
        self._build = build

    def collect(self) -> Iterable[Metric]:
        return self._build()


def render(job: str, status: dict, *args, **kwargs) -> str:
    """The exposition text (format 0.0.4) of `families(job, status, ...)`."""
    built = families(job, status, *args, **kwargs)
    return generate_latest(_Collector(lambda: built)).decode()


class JobMetrics:
    """Newest timings per rank plus the straggler monitor; `observe` from the store's consumer thread,
    `families` from the HTTP thread."""

    def __init__(self, job: str, ranks_per_node: int, monitor: Optional[StragglerMonitor] = None):
        self.job, self.ranks_per_node = job, ranks_per_node
        self.monitor = monitor or StragglerMonitor(ranks_per_node)
        self.latest: dict[int, dict] = {}
        self.findings: list[Finding] = []
        self.scores: dict[int, float] = {}
        self.stored = 0
        self._lock = threading.Lock()

    def observe(self, records: list[dict]) -> tuple[list[Finding], list[Finding]]:
        """Takes newly stored records; returns (new, cleared) stragglers for the events topic."""
        with self._lock:
            for r in records:
                if r["step"] >= self.latest.get(r["rank"], {}).get("step", -1):
                    self.latest[r["rank"]] = r
            self.stored += len(records)
            new, cleared = self.monitor.update(records)
            self.findings = list(self.monitor.current.values())
            self.scores = slowness(self.monitor.window(), thresholds=self.monitor.thresholds)
            return new, cleared

    def families(self, status: dict, dropped: Optional[int] = None) -> list[Metric]:
        with self._lock:
            return families(self.job, status, list(self.latest.values()), self.findings, dict(self.scores),
                            self.ranks_per_node, stored=self.stored, dropped=dropped,
                            node_names=list(self.monitor.node_names or ()))


def serve(build: Callable[[], Iterable[Metric]], port: int, host: Optional[str] = None) -> WSGIServer:
    """prometheus_client's endpoint (`/metrics`) on its own thread, collecting `build()` on each scrape;
    `shutdown()` and `server_close()` the returned server to stop it. `host` defaults to
    $MEGASCALE_METRICS_HOST, else 127.0.0.1."""
    host = host or os.environ.get(HOST_ENV) or "127.0.0.1"
    server, _ = start_http_server(port, addr=host, registry=_Collector(build))
    return server
