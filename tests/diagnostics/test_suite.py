"""The whole suite on the local backend: injected faults are caught by the right check on the right
node, pairwise isolation names the bad node among 4, and a healthy cluster passes via the CLI."""
import json

from megascale.diagnostics import SCHEMA_VERSION, DiagnosticsConfig, NodeSpec, run_suite
from megascale.diagnostics.cli import main


def failing(report, check, metric):
    return sorted(",".join(r.nodes) for r in report.checks if r.check == check and r.metric == metric
                  and r.status == "fail")


def test_injected_faults_are_caught_and_isolated(fast_config):
    fast_config.allow_fault_injection = True
    nodes = [
        NodeSpec("n0", devices=(0, 1), faults={"MEGASCALE_DIAG_LOOPBACK_RATE_MB": "20"}),  # throttled NIC path
        NodeSpec("n1", devices=(0, 1), faults={"MEGASCALE_DIAG_SLOW_GEMM": "0.1"}),  # slow GEMM on both devices
        NodeSpec("n2", devices=(0, 1), faults={"MEGASCALE_DIAG_SLOW_RANK": "1:40"}),  # one slow rank
        NodeSpec("n3", devices=(0, 1), faults={"MEGASCALE_DIAG_SLOW_NET": "40"}),  # slow inter-node traffic
    ]
    report = run_suite(nodes, fast_config)
    assert not report.passed
    assert failing(report, "loopback", "bandwidth") == ["n0"]
    assert failing(report, "gemm", "flops") == ["n1", "n1"]
    assert failing(report, "all_to_all", "bus_bandwidth") == ["n2"]
    a2a = next(r for r in report.checks if r.check == "all_to_all" and r.nodes == ["n2"])
    assert "straggler: local rank 1 on n2" in a2a.detail
    # n2 + n3 fail in round 1; re-pairing each with a healthy node names n3 alone.
    [iso] = report.isolation
    assert iso.suspects == ["n2", "n3"] and iso.bad_nodes == ["n3"]
    assert [p[2] for p in iso.pairs] == [1, 1, 2, 2]
    assert report.bad_nodes == ["n0", "n1", "n2", "n3"]
    by_node = {n.node_id: n.failed for n in report.nodes}
    assert by_node["n3"] == ["all_reduce.isolation"] and by_node["n2"] == ["all_to_all.bus_bandwidth"]
    for r in report.checks:
        assert r.status in ("pass", "fail", "skip")
        assert r.status == "skip" or r.budget_s > 0
    assert report.elapsed_s < report.budget_s


def test_healthy_cluster_passes_via_cli_json(fast_config, capsys, tmp_path):
    argv = ["diagnose", "--nodes", "a,b,c", "--ranks-per-node", "2", "--json", "--interfaces", "lo",
            "--output", str(tmp_path / "report.json"), "--set", f"checkpoint_dir={tmp_path}"]
    for check, seconds in fast_config.budgets.items():
        argv += ["--set", f"budgets.{check}={seconds}"]
    for key in ("all_to_all_mb", "all_reduce_mb", "alloc_mb"):
        argv += ["--set", f"{key}={getattr(fast_config, key)}"]
    argv += [f"--set=thresholds.{key}.{name}={value}" for key, th in fast_config.thresholds.items()
             for name, value in vars(th).items() if value is not None]
    code = main(argv)
    data = json.loads(capsys.readouterr().out)
    failures = [(r["check"], r["metric"], r["nodes"], r["value"], r["threshold"], r["detail"])
                for r in data["checks"] if r["status"] == "fail"]
    assert code == 0 and data["passed"] and not failures, failures
    assert data["schema_version"] == SCHEMA_VERSION and data["bad_nodes"] == [] and data["isolation"] == []
    assert json.loads((tmp_path / "report.json").read_text()) == data
    measured = {(r["check"], r["metric"]) for r in data["checks"] if r["status"] == "pass"}
    assert measured >= {("loopback", "bandwidth"), ("loopback", "latency"), ("all_to_all", "bus_bandwidth"),
                        ("all_reduce", "bus_bandwidth"), ("all_reduce", "latency"),
                        ("all_reduce", "pair_bus_bandwidth"), ("gemm", "flops"), ("health", "device_memory"),
                        ("health", "host_memory"), ("health", "checkpoint_disk"), ("health", "shm")}
    assert data["elapsed_s"] < 3 * 60


def test_suite_budget_is_enforced(fast_config):
    fast_config.budget_s = 0.3  # per node: gemm on the first node uses it all
    fast_config.checks = ("gemm",)
    fast_config.budgets["gemm"] = 1.0
    report = run_suite([NodeSpec("a", devices=(0,)), NodeSpec("b", devices=(0,))], fast_config)
    assert report.elapsed_s < 2.0
    [not_run] = [r for r in report.checks if r.metric == "not_run"]
    assert not_run.nodes == ["b"] and not_run.status == "fail" and "budget" in not_run.detail


def test_single_rank_nodes_skip_what_needs_peers(fast_config):
    fast_config.checks = ("all_to_all", "all_reduce")
    report = run_suite([NodeSpec("solo", topology="tor-a")], fast_config)
    assert report.passed and [r.status for r in report.checks] == ["skip", "skip"]


def test_topology_groups_all_reduce(fast_config):
    cfg = DiagnosticsConfig(**{**fast_config.__dict__, "checks": ("all_reduce",)}).validate()
    nodes = [NodeSpec("a", topology="t1"), NodeSpec("b", topology="t2"), NodeSpec("c", topology="t1")]
    report = run_suite(nodes, cfg)
    targets = sorted({r.target for r in report.checks})
    assert targets == ["pair:a+c", "tor:t1", "tor:t2"]


def test_hung_rank_fails_its_check_instead_of_hanging(fast_config):
    fast_config.allow_fault_injection = True
    fast_config.checks = ("all_to_all",)
    fast_config.collective_timeout_s = 1.5
    report = run_suite([NodeSpec("n0", devices=(0, 1), faults={"MEGASCALE_DIAG_HANG_RANK": "1"})], fast_config)
    [row] = report.checks
    assert row.status == "fail" and row.value is None and report.bad_nodes == ["n0"]
    assert row.detail.startswith("rank 1 (node n0, local rank 1) hung and was killed")
    assert "rank 0 (node n0, local rank 0): RuntimeError" in row.detail  # its peer timed out and said so
    assert row.elapsed_s < 10
