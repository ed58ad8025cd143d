"""Where the driver's /metrics listens: $MEGASCALE_METRICS_HOST when set (the operator's pod sets 0.0.0.0 for an
in-cluster Prometheus; here a second loopback address stands in for it), else 127.0.0.1 (the other tests)."""
from __future__ import annotations

import urllib.request

from megascale.driver.metrics.prometheus import HOST_ENV, families, serve


def test_metrics_endpoint_binds_the_address_the_environment_names(monkeypatch):
    monkeypatch.setenv(HOST_ENV, "127.0.0.2")
    server = serve(lambda: families("j", {"state": "Running", "step": 7}), 0)
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.2"
        with urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=5) as reply:
            assert 'megascale_job_step{job="j"} 7.0' in reply.read().decode()
    finally:
        server.shutdown()
        server.server_close()
