"""Prometheus text exposition (format 0.0.4) of a job: status, per-rank step and segment times, stragglers.

Rendered by hand: a handful of families, no client library to install on every node.
`JobMetrics` is the driver's glue: feed it the timings the metrics consumer stores, render
it on every scrape of `/metrics`.
"""
from __future__ import annotations

import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable, Optional, Sequence

from .stragglers import Finding, StragglerMonitor, slowness

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name -> (type, help). Grafana's dashboard may query only these (tests check it).
METRICS: dict[str, tuple[str, str]] = {
    "megascale_job_info": ("gauge", "Always 1; the job's state is in the `state` label."),
    "megascale_job_step": ("gauge", "Newest training step the job reported."),
    "megascale_job_total_steps": ("gauge", "Steps the job is configured to train."),
    "megascale_job_loss": ("gauge", "Training loss at the newest step."),
    "megascale_job_tokens_per_second": ("gauge", "Training throughput at the newest step."),
    "megascale_job_restarts_total": ("counter", "Automatic restarts of the job's ranks."),
    "megascale_job_ettr_ratio": ("gauge", "Effective training time ratio: productive time / wall time."),
    "megascale_job_mttr_seconds": ("gauge", "Mean time to recovery after a fault."),
    "megascale_rank_step": ("gauge", "Newest step a rank reported timings for."),
    "megascale_rank_step_seconds": ("gauge", "A rank's wall time of its newest step."),
    "megascale_rank_segment_seconds": ("gauge", "A rank's time in one timer segment of its newest step."),
    "megascale_rank_slowness_ratio": ("gauge", "A rank's compute time over its TP/DP peers' median (1 = normal)."),
    "megascale_stragglers": ("gauge", "Ranks currently reported as stragglers."),
    "megascale_straggler_slowdown_ratio": ("gauge", "A straggler's slowdown against its peers, per segment."),
    "megascale_metrics_records_total": ("counter", "Step-timing records the driver stored."),
    "megascale_metrics_dropped_total": ("counter", "Step-timing records senders dropped because their queue was full."),
}


def _escape(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


class _Writer:
    def __init__(self) -> None:
        self.samples: dict[str, list[str]] = {name: [] for name in METRICS}

    def add(self, name: str, value: Optional[float], **labels: object) -> None:
        if value is None or name not in METRICS:
            return
        text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        selector = f"{name}{{{text}}}" if text else name
        self.samples[name].append(f"{selector} {_number(float(value))}")

    def text(self) -> str:
        lines = []
        for name, samples in self.samples.items():
            if samples:
                kind, help_text = METRICS[name]
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]
        return "\n".join(lines) + "\n"


def render(job: str, status: dict, latest: Iterable[dict] = (), findings: Iterable[Finding] = (),
           scores: Optional[dict[int, float]] = None, ranks_per_node: int = 8, stored: Optional[int] = None,
           dropped: Optional[int] = None, node_names: Sequence[str] = ()) -> str:
    """The exposition text: `status` is the driver's status dict, `latest` each rank's newest StepTimings;
    `node_names[k]` names the node of ranks k*ranks_per_node.. (default `node<k>`, as findings do)."""
    w = _Writer()
    w.add("megascale_job_info", 1, job=job, state=status.get("state", "unknown"))
    w.add("megascale_job_step", status.get("step"), job=job)
    w.add("megascale_job_total_steps", status.get("total_steps"), job=job)
    w.add("megascale_job_loss", status.get("loss"), job=job)
    w.add("megascale_job_tokens_per_second", status.get("tokens_per_s"), job=job)
    w.add("megascale_job_restarts_total", status.get("restarts", 0), job=job)
    w.add("megascale_job_ettr_ratio", status.get("ettr"), job=job)
    w.add("megascale_job_mttr_seconds", status.get("mttr_s"), job=job)
    for rec in sorted(latest, key=lambda r: r["rank"]):
        node = rec["rank"] // ranks_per_node
        name = node_names[node] if node < len(node_names) else f"node{node}"
        labels = {"job": job, "rank": rec["rank"], "node": name}
        w.add("megascale_rank_step", rec["step"], **labels)
        w.add("megascale_rank_step_seconds", rec["total"], **labels)
        for segment, seconds in rec["segments"].items():
            w.add("megascale_rank_segment_seconds", seconds, **labels, segment=segment)
        if scores and rec["rank"] in scores:
            w.add("megascale_rank_slowness_ratio", scores[rec["rank"]], **labels)
    findings = list(findings)
    w.add("megascale_stragglers", len({f.rank for f in findings}), job=job)
    for f in findings:
        w.add("megascale_straggler_slowdown_ratio", f.slowdown, job=job, rank=f.rank, node=f.node_name,
              segment=f.segment, dimension=f.dimension)
    w.add("megascale_metrics_records_total", stored, job=job)
    w.add("megascale_metrics_dropped_total", dropped, job=job)
    return w.text()


class JobMetrics:
    """Newest timings per rank plus the straggler monitor; `observe` from the store's consumer thread,
    `render` from the HTTP thread."""

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

    def render(self, status: dict, dropped: Optional[int] = None) -> str:
        with self._lock:
            return render(self.job, status, list(self.latest.values()), self.findings, dict(self.scores),
                          self.ranks_per_node, stored=self.stored, dropped=dropped,
                          node_names=list(self.monitor.node_names or ()))


def serve(render_text: Callable[[], str], port: int, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """A `/metrics` endpoint on its own thread; `shutdown()` the returned server to stop it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics here")
                return
            body = render_text().encode()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # scrapes every few seconds must not fill the log
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="prometheus", daemon=True).start()
    return server
