"""What the driver tells about a job besides its events: a `MetricsConsumer` thread stores the ranks'
step timings from `<job>.metrics` in `<run_dir>/metrics` (Parquet) and feeds `JobMetrics` (stragglers);
`/metrics` serves it all to Prometheus (control.prometheus_port >= 0); the job's status goes to Redis
every pass and beside the timings, for the dashboard, once a second.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from megascale.config import JobConfig

from . import log
from .metrics import prometheus
from .metrics.prometheus import JobMetrics
from .metrics.store import MetricsConsumer, ParquetStore
from .recovery import StragglerWatch
from .state import JobStatus, JobStore


class Telemetry:
    def __init__(self, store: JobStore, cfg: JobConfig, kafka: str, run_dir: str):
        self.store, self.job = store, store.job
        self.metrics = JobMetrics(self.job, cfg.ranks_per_node)
        self.stragglers = StragglerWatch(self.metrics, cfg)
        days = cfg.logging.timings_keep_days
        self.timings = ParquetStore(Path(run_dir) / "metrics", max_steps=cfg.logging.timings_keep_steps,
                                    max_age_s=days * 86400 if days is not None else None)
        self.consumer = MetricsConsumer(kafka, self.job, self.timings, on_records=self.stragglers.observe)
        self.prometheus_url: Optional[str] = None
        self._http = None
        self._shown: dict = {}  # the newest status, as plain data, for /metrics

    def start(self, port: int) -> None:
        self.consumer.start()
        if port < 0:
            return
        try:
            self._http = prometheus.serve(
                lambda: self.metrics.families(self._shown, dropped=self.consumer.dropped_by_senders), port)
        except OSError as e:  # a taken port costs the scrape endpoint, not the job
            log.warning("cannot serve Prometheus metrics on port %d: %s", port, e.strerror or e)
            return
        host, bound = self._http.server_address[:2]
        self.prometheus_url = f"http://{host}:{bound}/metrics"
        log.info("Prometheus metrics at %s", self.prometheus_url)

    def stop(self) -> None:
        self.consumer.stop(timeout=5)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()

    def write_status(self, status: JobStatus, to_timings: bool) -> None:
        """Redis every pass (`status`); the timings store when `to_timings` (the dashboard reads it there)."""
        self.store.write_status(status)
        self._shown = dataclasses.asdict(status)
        if to_timings:
            try:
                self.timings.write_status(self.job, self._shown)
            except OSError as e:
                log.warning("cannot write the dashboard's status file: %s", e)
