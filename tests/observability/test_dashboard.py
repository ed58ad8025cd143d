"""The dashboard over a real run's timings: JSON endpoints, the CLI, and the page rendered by headless Chromium."""
from __future__ import annotations

import argparse
import html.parser
import json
import subprocess
import urllib.error
import urllib.request

import pytest
from megascale.driver.dashboard.server import Dashboard
from megascale.driver.metrics import cli
from megascale.driver.metrics.sources import RunDirSource


@pytest.fixture
def dashboard(real_run, tmp_path, facts):
    run = facts.write_run_dir(tmp_path / "runs" / "demo-20240101-000000", real_run)
    server = Dashboard(RunDirSource(run), facts.RANKS_PER_NODE, port=0, thresholds=facts.THRESHOLDS).start()
    try:
        yield server
    finally:
        server.stop()


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Elements(html.parser.HTMLParser):
    """Start tags with their attributes, from the DOM Chromium dumps."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.append((tag, dict(attrs)))

    def having(self, cls: str) -> list[dict]:
        return [a for _, a in self.tags if cls in (a.get("class") or "").split()]


def test_page_in_headless_chromium_shows_a_heatmap_row_per_rank_and_the_straggler(dashboard, chromium, tmp_path, facts):
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
           f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=5000", "--dump-dom", dashboard.url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    dom = Elements()
    dom.feed(done.stdout)
    assert dom.having("hm-row"), "no heatmap rows in the rendered page"
    rows = dom.having("hm-row")
    assert [int(r["data-rank"]) for r in rows] == [0, 1, 2, 3]
    assert [int(r["data-node"]) for r in rows] == [0, 0, 1, 1]
    assert len(dom.having("hm-cell")) == 4 * facts.STEPS  # every rank has a cell for every step
    cells = dom.having("grid-cell")
    assert sorted((int(c["data-tp"]), int(c["data-pp"]), int(c["data-dp"])) for c in cells) == \
        [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    outlined = [int(c["data-rank"]) for c in cells if c.get("stroke") not in (None, "none")]
    assert outlined == [facts.SLOW_RANK]
    assert [int(f["data-rank"]) for f in dom.having("finding")] == [facts.SLOW_RANK]
    assert sorted(int(r["data-rank"]) for r in dom.having("tl-row")) == [0, 1, 2, 3]


def test_json_endpoints(dashboard, facts):
    status, body = get(dashboard.url + "api/data?value=compute")
    assert status == 200
    data = json.loads(body)
    assert data["job"] == "demo" and data["value"] == "compute" and data["layout"] == {"tp": 2, "pp": 1, "dp": 2}
    assert data["status"]["state"] == "finished" and data["range"] == [1, facts.STEPS]
    assert [f["rank"] for f in data["findings"]] == [facts.SLOW_RANK]
    assert data["timeline"]["step"] == facts.STEPS
    status, body = get(dashboard.url + f"api/data?step={facts.ONSET}")
    assert json.loads(body)["timeline"]["step"] == facts.ONSET
    status, body = get(dashboard.url + "api/data?value=nonsense")
    assert status == 400 and "unknown value" in json.loads(body)["error"]
    status, body = get(dashboard.url + "api/trace?steps=3:4")
    trace = json.loads(body)
    assert status == 200 and {e["args"]["step"] for e in trace["traceEvents"] if e["ph"] == "X"} == {3, 4}
    status, body = get(dashboard.url + "metrics")
    assert status == 200 and b'megascale_rank_step_seconds{job="demo",rank="3",node="node1"}' in body


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="megascale")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_trace_cli_from_a_job_name_and_from_a_run_dir(real_run, tmp_path, facts, capsys):
    runs = tmp_path / "runs"
    run = facts.write_run_dir(runs / "demo-20240101-000000", real_run)
    out = tmp_path / "trace.json"
    assert run_cli("trace", "demo", "--runs-root", str(runs), "--steps", "2:5", "-o", str(out)) == 0
    trace = json.loads(out.read_text())
    assert {e["args"]["step"] for e in trace["traceEvents"] if e.get("cat") == "step"} == {2, 3, 4, 5}
    assert run_cli("trace", "--run-dir", str(run), "--steps", "-3", "-o", str(out)) == 0
    assert json.loads(out.read_text())["otherData"]["steps"] == [facts.STEPS - 2, facts.STEPS]
    assert run_cli("trace", "nosuchjob", "--runs-root", str(runs), "-o", str(out)) == 2
    assert "no run of job 'nosuchjob'" in capsys.readouterr().err
    assert run_cli("trace", "--run-dir", str(run), "--steps", "9:3", "-o", str(out)) == 2


def test_dashboard_reads_the_drivers_parquet_store_and_status(real_run, tmp_path, facts):
    from megascale.driver.dashboard.data import build
    from megascale.driver.metrics.sources import open_source
    from megascale.driver.metrics.store import ParquetStore

    store = ParquetStore(tmp_path, steps_per_partition=5)
    store.write("demo", real_run, node="node0", incarnation=1)
    store.write_status("demo", {"state": "running", "restarts": 1, "ettr": 0.9})
    source = open_source(None, parquet=str(tmp_path))  # the only job in the store
    data = build(source, facts.RANKS_PER_NODE, thresholds=facts.THRESHOLDS, window=5)
    assert data["shown"] == [facts.STEPS - 4, facts.STEPS] and data["status"]["ettr"] == 0.9
    assert [row["key"] for row in data["heatmap"]["rows"]] == [0, 1, 2, 3]
    assert all(len(row["values"]) == 5 for row in data["heatmap"]["rows"])
    assert [f["rank"] for f in data["findings"]] == [facts.SLOW_RANK]
