"""The dashboard over a real run's timings: JSON endpoints, the CLI, and the page rendered by headless Chromium
(its DOM, and a screenshot's pixels: the findings the detector made, standing and cleared, drawn on the heatmap)."""
from __future__ import annotations

import argparse
import collections
import html.parser
import json
import struct
import subprocess
import urllib.error
import urllib.request
import zlib

import pytest
from megascale.bench.stragglers import slow_down
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


def chromium_run(chromium: str, tmp_path, url: str, *args: str) -> str:
    done = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}", *args, url],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def png_pixels(path) -> list[tuple[int, int, int]]:
    """Every pixel of an 8-bit RGB(A), non-interlaced PNG, as Chromium writes screenshots. Decoded by hand
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
    return [tuple(row[x * channels:x * channels + 3]) for row in rows for x in range(width)]


@pytest.fixture
def recovered(real_run, tmp_path, facts):
    """The real run, then its rank 3 at full speed again for 40 steps (its finding clears), then rank 1
    three times slower for 14 steps (a finding standing at the end): served with `?value=slowdown`."""
    even = [r for r in real_run if 5 < r["step"] < facts.ONSET]
    steps = sorted({r["step"] for r in even})
    extra = []
    for i in range(54):
        step = {r["rank"]: {**r, "step": facts.STEPS + 1 + i} for r in even if r["step"] == steps[i % len(steps)]}
        extra += (slow_down(step, 1, 3.0) if i >= 40 else step).values()
    run = facts.write_run_dir(tmp_path / "runs" / "demo-20240101-000000", real_run + extra)
    server = Dashboard(RunDirSource(run), facts.RANKS_PER_NODE, port=0).start()
    try:
        yield server
    finally:
        server.stop()


def test_heatmap_in_headless_chromium_shows_slowdown_and_standing_and_cleared_findings(recovered, chromium,
                                                                                       tmp_path, facts):
    url = recovered.url + "?value=slowdown"
    dom = Elements()
    dom.feed(chromium_run(chromium, tmp_path, url, "--dump-dom"))
    rows = dom.having("hm-row")
    assert [int(r["data-rank"]) for r in rows] == [0, 1, 2, 3] and [int(r["data-node"]) for r in rows] == [0, 0, 1, 1]
    last = facts.STEPS + 54
    assert len(dom.having("hm-cell")) == 4 * last  # every rank has a cell for every step
    cells = dom.having("grid-cell")
    assert sorted((int(c["data-tp"]), int(c["data-pp"]), int(c["data-dp"])) for c in cells) == \
        [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    assert [int(c["data-rank"]) for c in cells if c.get("stroke") not in (None, "none")] == [1]  # standing now
    boxes = dom.having("finding-box")
    cleared = [b for b in boxes if "cleared" in b["class"].split()]
    standing = [b for b in boxes if b not in cleared]
    assert [int(b["data-rank"]) for b in cleared] == [facts.SLOW_RANK]
    assert facts.ONSET <= int(cleared[0]["data-from"]) < int(cleared[0]["data-to"]) < facts.STEPS + 40
    assert [int(b["data-rank"]) for b in standing] == [1] and int(standing[0]["data-to"]) == last
    assert int(standing[0]["data-from"]) > facts.STEPS + 40
    assert [int(f["data-rank"]) for f in dom.having("finding")] == [facts.SLOW_RANK, 1]  # the table: both
    assert [int(f["data-rank"]) for f in dom.having("cleared") if "finding" in f["class"]] == [facts.SLOW_RANK]

    def shade(rank: int, step: int) -> tuple[int, ...]:
        (cell,) = [c for c, r in zip(dom.having("hm-cell"), sum(([row] * last for row in rows), []))
                   if int(c["data-step"]) == step and int(r["data-rank"]) == rank]
        return tuple(int(x) for x in cell["fill"][4:-1].split(","))

    red, _, blue = shade(facts.SLOW_RANK, facts.STEPS)  # colour = slowdown vs its stage peers
    assert red - blue > 80, shade(facts.SLOW_RANK, facts.STEPS)

    shot = tmp_path / "dashboard.png"
    chromium_run(chromium, tmp_path, url, f"--screenshot={shot}", "--window-size=1400,1000")
    pixels = collections.Counter(png_pixels(shot))
    assert pixels[STANDING] > 100 and pixels[CLEARED] > 50, (pixels[STANDING], pixels[CLEARED])


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
