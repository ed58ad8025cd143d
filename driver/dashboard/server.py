"""`megascale dashboard`: one static page (index.html, inline JS drawing SVG) and its JSON, on 127.0.0.1.

    /                  the page, with the data of the same query inlined (it renders without a request)
    /api/data          ?value=total|compute|slowdown|<segment> &from=A &to=B &step=S &window=N
    /api/trace         ?steps=A:B  a Chrome/Perfetto trace JSON of those steps
    /metrics           Prometheus exposition of the newest step of every rank
"""
from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import parse_qs, urlparse

from ..metrics import prometheus
from ..metrics.sources import TimingsSource
from ..metrics.stragglers import Thresholds, detect, slowness
from ..metrics.trace import parse_steps, to_chrome_trace
from . import data

log = logging.getLogger("megascale.driver")
PAGE = Path(__file__).with_name("index.html")
_DATA_SLOT = "/*__DATA__*/null"


class Dashboard:
    def __init__(self, source: TimingsSource, ranks_per_node: int, host: str = "127.0.0.1", port: int = 0,
                 window: int = 200, status: Optional[Callable[[], dict]] = None,
                 thresholds: Thresholds = Thresholds()):
        self.source, self.ranks_per_node, self.window = source, ranks_per_node, window
        self.thresholds = thresholds
        self._status = status  # the driver's own status dict, when the driver runs the dashboard
        self._lock = threading.Lock()  # sources read files incrementally: one request at a time
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> "Dashboard":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="dashboard", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- content -----------------------------------------------------------------------------

    def status(self) -> dict:
        return {**self.source.status(), **(self._status() if self._status else {})}

    def data(self, query: dict[str, str]) -> dict:
        def number(name: str) -> Optional[int]:
            text = query.get(name)
            if not text:
                return None
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"{name}={text!r} is not a step number") from None

        with self._lock:
            return data.build(self.source, self.ranks_per_node, self.status(), thresholds=self.thresholds,
                              value=query.get("value") or "total",
                              window=number("window") or self.window, first=number("from"), last=number("to"),
                              step=number("step"))

    def page(self, query: dict[str, str]) -> bytes:
        # Inlined so the first render needs no request; "</" is escaped so the JSON cannot end the script.
        payload = json.dumps(self.data(query)).replace("</", "<\\/")
        return PAGE.read_text().replace(_DATA_SLOT, payload).encode()

    def trace(self, steps: str) -> dict:
        with self._lock:
            first, last = parse_steps(steps, self.source.step_range())
            return to_chrome_trace(self.source.read(first, last), self.ranks_per_node, self.source.job)

    def metrics(self) -> str:
        with self._lock:
            span = self.source.step_range()
            records = self.source.read(max(span[0], span[1] - data.HISTORY_STEPS), span[1]) if span else []
            status = self.status()
        newest: dict[int, dict] = {}
        for r in records:
            newest[r["rank"]] = r
        findings = detect(records, self.ranks_per_node, thresholds=self.thresholds)
        return prometheus.render(self.source.job, status, newest.values(), findings,
                                 slowness(records, thresholds=self.thresholds), self.ranks_per_node)

    def _handler(self) -> type:
        dashboard = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                url = urlparse(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                try:
                    if url.path in ("/", "/index.html"):
                        self._reply(200, "text/html; charset=utf-8", dashboard.page(query))
                    elif url.path == "/api/data":
                        self._reply(200, "application/json", json.dumps(dashboard.data(query)).encode())
                    elif url.path == "/api/trace":
                        body = json.dumps(dashboard.trace(query.get("steps", "-100"))).encode()
                        name = f"{dashboard.source.job}-trace.json"
                        disposition = {"Content-Disposition": f'attachment; filename="{name}"'}
                        self._reply(200, "application/json", body, disposition)
                    elif url.path == "/metrics":
                        self._reply(200, prometheus.CONTENT_TYPE, dashboard.metrics().encode())
                    elif url.path == "/healthz":
                        self._reply(200, "text/plain", b"ok\n")
                    else:
                        self._reply(404, "text/plain", b"not found: try / or /api/data\n")
                except ValueError as e:  # a bad query: tell the browser what to fix
                    self._reply(400, "application/json", json.dumps({"error": str(e)}).encode())
                except Exception as e:  # keep serving; the log has the reason
                    log.exception("dashboard: %s failed", url.path)
                    self._reply(500, "application/json", json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())

            def _reply(self, code: int, kind: str, body: bytes, headers: Optional[dict] = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args: object) -> None:
                log.debug("dashboard: " + fmt, *args)

        return Handler
