"""The dashboard over a real run's timings: JSON endpoints, the CLI, and the page rendered by headless Chromium
(its DOM, and a screenshot's pixels: the findings the detector made, standing and cleared, drawn on the heatmap)."""
from __future__ import annotations

import argparse
import collections
import gzip
import html.parser
import json
import struct
import subprocess
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import pytest
from megascale.bench.stragglers import by_step, slow_down
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


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                  "--hide-scrollbars", "--force-device-scale-factor=1", "--virtual-time-budget=5000"]
STANDING, CLEARED = (123, 44, 191), (154, 160, 166)  # index.html's .finding-box strokes: #7b2cbf, #9aa0a6
SLOWER = (178, 24, 43)  # index.html's ratioColour at 2x its stage peers and beyond
TRACE = Path(__file__).parents[1] / "metrics" / "data" / "gpt-tiny-8-ranks.jsonl.gz"
LAST = 100  # steps of it shown


def chromium_run(chromium: str, tmp_path, url: str, *args: str) -> str:
    done = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}", *args, url],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def png_pixels(path) -> list[list[tuple[int, int, int]]]:
    """The pixels of an 8-bit RGB(A), non-interlaced PNG, as Chromium writes screenshots, row by row. Decoded by hand
    (zlib and the five PNG row filters) rather than adding an image library for one test."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, at = {}, 8
    while at < len(data):
        size, kind = struct.unpack(">I4s", data[at:at + 8])
        chunks[kind] = chunks.get(kind, b"") + data[at + 8:at + 8 + size]
        at += size + 12
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert depth == 8 and colour in (2, 6) and interlace == 0
    channels = 3 if colour == 2 else 4
    raw, stride, rows, prev = zlib.decompress(chunks[b"IDAT"]), width * channels, [], bytearray(width * channels)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, corner = prev[i], prev[i - channels] if i >= channels else 0
            p = left + up - corner
            nearest = min((abs(p - left), 0, left), (abs(p - up), 1, up), (abs(p - corner), 2, corner))[2]
            line[i] = (line[i] + (0, left, up, (left + up) // 2, nearest)[kind]) & 0xFF
        rows.append(line)
        prev = line
    return [[tuple(row[x * channels:x * channels + 3]) for x in range(width)] for row in rows]


@pytest.fixture
def recovered(tmp_path, facts):
    """The main example's shape (8 ranks, 2 nodes): a recorded fault-free run (tests/driver/metrics/data) with
    rank 3 made three times slower for steps 30-49 (its finding clears after) and rank 6 from step 85 to the
    end (its finding stands)."""
    with gzip.open(TRACE, "rt") as f:
        steps = by_step([json.loads(line) for line in f])[:LAST]
    for i, step in enumerate(steps, start=1):
        for rank in [3] * (30 <= i < 50) + [6] * (i >= 85):
            steps[i - 1] = step = slow_down(step, rank, 3.0)
    run = facts.write_run_dir(tmp_path / "runs" / "demo-20240101-000000",
                              [r for step in steps for r in step.values()], ranks_per_node=4)
    server = Dashboard(RunDirSource(run), 4, port=0).start()
    try:
        yield server
    finally:
        server.stop()


def test_heatmap_in_headless_chromium_shows_slowdown_and_standing_and_cleared_findings(recovered, chromium, tmp_path):
    url = recovered.url + "?value=slowdown"
    dom = Elements()
    dom.feed(chromium_run(chromium, tmp_path, url, "--dump-dom"))
    rows = dom.having("hm-row")
    assert [int(r["data-rank"]) for r in rows] == list(range(8))
    assert [int(r["data-node"]) for r in rows] == [0] * 4 + [1] * 4
    assert len(dom.having("hm-cell")) == 8 * LAST  # every rank has a cell for every step
    cells = dom.having("grid-cell")
    assert len(cells) == 8 and {(int(c["data-pp"])) for c in cells} == {0, 1}
    assert [int(c["data-rank"]) for c in cells if c.get("stroke") not in (None, "none")] == [6]  # standing now
    boxes = dom.having("finding-box")
    cleared = [b for b in boxes if "cleared" in b["class"].split()]
    standing = [b for b in boxes if b not in cleared]
    assert [int(b["data-rank"]) for b in cleared] == [3] and [int(b["data-rank"]) for b in standing] == [6]
    assert 28 <= int(cleared[0]["data-from"]) <= 32 and 50 <= int(cleared[0]["data-to"]) < 85
    assert 83 <= int(standing[0]["data-from"]) <= 87 and int(standing[0]["data-to"]) == LAST
    table = dom.having("finding")
    assert [(int(f["data-rank"]), "cleared" in f["class"]) for f in table] == [(3, True), (6, False)]

    def shade(rank: int, step: int) -> tuple[int, ...]:
        row = next(i for i, r in enumerate(rows) if int(r["data-rank"]) == rank)
        (cell,) = [c for c in dom.having("hm-cell")[row * LAST:(row + 1) * LAST] if int(c["data-step"]) == step]
        return tuple(int(x) for x in cell["fill"][4:-1].split(","))

    red, _, blue = shade(3, 40)  # colour = slowdown vs its stage peers: red where it is three times slower
    assert red - blue > 100 and abs(shade(3, 20)[0] - shade(3, 20)[2]) < 100, (shade(3, 40), shade(3, 20))

    shot = tmp_path / "dashboard.png"
    chromium_run(chromium, tmp_path, url, f"--screenshot={shot}", "--window-size=1400,1000")
    lines = png_pixels(shot)
    pixels = collections.Counter(p for line in lines for p in line)
    assert pixels[STANDING] > 40 and pixels[CLEARED] > 40, (pixels[STANDING], pixels[CLEARED])
    # The slowdown colours as drawn: the pixel lines with at least 5 cells' width at 2x and beyond form two
    # bands, rank 3's and rank 6's rows (three rows apart, give or take the 1-2 px a finding box's outline
    # hides at the top of a band); every other rank keeps pace.
    width, height = (float(dom.having("hm-cell")[0][k]) for k in ("width", "height"))
    red = [y for y, line in enumerate(lines) if line.count(SLOWER) >= 5 * width]
    bands = [y for i, y in enumerate(red) if i == 0 or red[i - 1] != y - 1]
    assert len(bands) == 2 and abs(bands[1] - bands[0] - 3 * height) <= 3, (bands, height)


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
    assert status == 200 and b'megascale_rank_step_seconds{job="demo",node="node1",rank="3"}' in body


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
    assert run_cli("trace", str(run), "--steps", "2:5", "-o", str(out)) == 0  # a run directory as the JOB
    assert json.loads(out.read_text())["otherData"]["steps"] == [2, 5]
    capsys.readouterr()
    assert run_cli("trace", str(tmp_path), "-o", str(out)) == 2
    assert f"{tmp_path}: no per-rank timings" in capsys.readouterr().err


def test_a_driver_run_directory_is_read_through_its_metrics_store(real_run, tmp_path):
    from megascale.driver.metrics.sources import ParquetSource, open_source
    from megascale.driver.metrics.store import ParquetStore

    ParquetStore(tmp_path / "metrics").write("demo", real_run, node="node0", incarnation=1)
    source = open_source(str(tmp_path))
    assert isinstance(source, ParquetSource) and source.job == "demo"


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
