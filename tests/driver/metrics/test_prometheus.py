"""Prometheus exposition format, and the Grafana dashboard querying only what the driver exports."""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from megascale.driver.metrics import prometheus
from megascale.driver.metrics.prometheus import METRICS, JobMetrics, render
from megascale.driver.metrics.stragglers import StragglerMonitor, detect, slowness

GRAFANA = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "megascale-dashboard.json"
STATUS = {"job": "demo", "state": "running", "step": 14, "total_steps": 100, "loss": 3.2, "tokens_per_s": 1.5e4,
          "restarts": 2, "ettr": 0.93, "mttr_s": 41.0, "val_step": 10, "val_loss": 3.4, "val_ppl": 29.96}


def parse(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Samples per sample name (what PromQL selects), read by prometheus_client's own parser."""
    samples: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def test_exposition_of_a_real_run(real_run, facts):
    newest = {r["rank"]: r for r in sorted(real_run, key=lambda r: r["step"])}
    th = facts.THRESHOLDS
    text = render("demo", STATUS, newest.values(), detect(real_run, 2, thresholds=th), slowness(real_run),
                  ranks_per_node=2, stored=len(real_run), dropped=0)
    families = parse(text)
    assert set(families) <= set(METRICS) and all(name.startswith("megascale_") for name in families)
    assert all(set(labels) == set(METRICS[name][2]) for name, rows in families.items() for labels, _ in rows)
    types = {family.name: family.type for family in text_string_to_metric_families(text)}
    assert types["megascale_job_restarts"] == "counter" and types["megascale_job_step"] == "gauge"
    assert families["megascale_job_info"] == [({"job": "demo", "state": "running"}, 1.0)]
    assert families["megascale_job_restarts_total"][0][1] == 2 and families["megascale_job_ettr_ratio"][0][1] == 0.93
    assert [families[f"megascale_job_val_{name}"] for name in ("loss", "perplexity", "step")] == [
        [({"job": "demo"}, 3.4)], [({"job": "demo"}, 29.96)], [({"job": "demo"}, 10.0)]]
    segments = families["megascale_rank_segment_seconds"]
    assert {tuple(sorted(labels)) for labels, _ in segments} == {("job", "node", "rank", "segment")}
    assert len(segments) == 4 * 10
    assert {labels["node"] for labels, _ in families["megascale_rank_step_seconds"]} == {"node0", "node1"}
    (straggler,) = families["megascale_straggler_slowdown_ratio"]
    assert straggler[0]["rank"] == str(facts.SLOW_RANK) and straggler[0]["dimension"] == "tp" and straggler[1] > 1.3
    assert families["megascale_stragglers"][0][1] == 1


def test_label_values_round_trip_and_missing_values_are_skipped():
    text = render('we"ird\\job\n', {"state": "running", "loss": None})
    assert 'job="we\\"ird\\\\job\\n"' in text  # escaped on the wire
    families = parse(text)
    assert families["megascale_job_info"][0][0]["job"] == 'we"ird\\job\n'
    assert "megascale_job_loss" not in families and "# TYPE megascale_job_loss" not in text


def test_job_metrics_served_on_metrics(real_run, facts):
    metrics = JobMetrics("demo", ranks_per_node=2, monitor=StragglerMonitor(2, thresholds=facts.THRESHOLDS))
    for step in sorted({r["step"] for r in real_run}):
        metrics.observe([r for r in real_run if r["step"] == step])
    server = prometheus.serve(lambda: metrics.families(STATUS, dropped=0), port=0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=10) as reply:
            assert reply.headers["Content-Type"] == prometheus.CONTENT_TYPE
            families = parse(reply.read().decode())
    finally:
        server.shutdown()
        server.server_close()
    assert families["megascale_metrics_records_total"][0][1] == len(real_run)
    assert max(families["megascale_rank_slowness_ratio"], key=lambda s: s[1])[0]["rank"] == "3"


# -- Grafana ------------------------------------------------------------------------------------

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers that are not functions, keywords or labels."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors, $__rate_interval
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        followed = expr[m.end():].lstrip()
        if followed.startswith("(") or m.group() in PROMQL_WORDS or expr[:m.start()].endswith("$"):
            continue  # a function call, a keyword, a Grafana variable
        names.add(m.group())
    return names


def test_metric_names_parser():
    assert metric_names('sum by (segment) (rate(megascale_a{job="$job"}[5m])) / on(job) megascale_b') == \
        {"megascale_a", "megascale_b"}


def test_grafana_dashboard_is_valid_and_queries_only_exported_metrics():
    dash = json.loads(GRAFANA.read_text())
    for field in ("title", "uid", "schemaVersion", "panels", "templating", "time", "refresh"):
        assert field in dash, f"dashboard has no {field!r}"
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["type"] == "query"
    used: set[str] = set(metric_names(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", variables["job"]["definition"])))
    ids, cells = set(), set()
    for panel in dash["panels"]:
        assert panel["id"] not in ids and panel["type"] in {"stat", "gauge", "timeseries", "heatmap", "table", "row"}
        ids.add(panel["id"])
        pos = panel["gridPos"]
        assert all(isinstance(pos[k], int) for k in "hwxy") and 0 <= pos["x"] and pos["x"] + pos["w"] <= 24
        area = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["refId"] and target["datasource"]["uid"] == "${datasource}"
            used |= metric_names(target["expr"])
    assert used <= set(METRICS), f"queries metrics the driver does not export: {sorted(used - set(METRICS))}"
    kinds = {p["type"] for p in dash["panels"]}
    assert {"heatmap", "timeseries", "gauge"} <= kinds
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    assert all(word in titles for word in ("throughput", "restarts", "ettr", "straggler"))
