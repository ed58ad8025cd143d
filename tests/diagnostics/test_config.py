"""Bad thresholds, config, nodes and fault specs fail early with one line naming the field."""
import pytest
from megascale.diagnostics import DiagnosticsConfig, NodeSpec, Threshold, run_suite
from megascale.diagnostics.cli import main
from megascale.diagnostics.config import validate_nodes
from megascale.diagnostics.faults import parse_faults

from megascale.config import ConfigError


@pytest.mark.parametrize("override, field", [
    ("thresholds.gemm.flops.min_ratio=1.5", "thresholds.gemm.flops.min_ratio"),
    ("thresholds.gemm.flops.min_ratio=0", "thresholds.gemm.flops.min_ratio"),
    ("thresholds.gemm.flops.min_ratio=abc", "thresholds.gemm.flops.min_ratio"),
    ("thresholds.loopback.latency.max_ratio=0.5", "thresholds.loopback.latency.max_ratio"),
    ("thresholds.loopback.bandwidth.expected=-1", "thresholds.loopback.bandwidth.expected"),
    ("thresholds.gemm.tflops.min_ratio=0.5", "thresholds.gemm.tflops.min_ratio"),
    ("thresholds.gemm.flops.slack=1", "thresholds.gemm.flops.slack"),
    ("thresholds.health.host_memory.min_ratio=0.5", "thresholds.health.host_memory"),
    ("thresholds.health.shm.min_value=-2", "thresholds.health.shm.min_value"),
    ("budget_s=0", "budget_s"),
    ("budget_s=fast", "budget_s"),
    ("budgets.gemm=-1", "budgets.gemm"),
    ("budgets.ib=1", "budgets.ib"),
    ("checks=gemm,bogus", "checks"),
    ("backend=mpi", "backend"),
    ("gemm_size=-3", "gemm_size"),
    ("isolate=maybe", "isolate"),
    ("no_such_key=1", "no_such_key"),
    ("novalue", "novalue"),
])
def test_bad_override_names_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        DiagnosticsConfig().apply_overrides([override])
    message = str(err.value)
    assert field in message and "\n" not in message


def test_thresholds_set_in_code_are_validated_too():
    cfg = DiagnosticsConfig(thresholds={"all_reduce.latency": Threshold(min_ratio=0.5)})
    with pytest.raises(ConfigError, match="thresholds.all_reduce.latency.min_ratio"):
        cfg.validate()
    with pytest.raises(ConfigError, match=r"^checks is empty"):
        DiagnosticsConfig(checks=()).validate()


def test_from_dict_and_overrides_apply():
    cfg = DiagnosticsConfig.from_dict({
        "budget_s": 30, "checks": ["gemm", "health"], "isolate": False,
        "thresholds": {"gemm.flops": {"min_ratio": 0.8}, "loopback.bandwidth": {"expected": 10}},
        "budgets": {"gemm": 1},
    })
    assert cfg.budget_s == 30.0 and cfg.checks == ("gemm", "health") and cfg.isolate is False
    assert cfg.threshold("gemm.flops").min_ratio == 0.8
    assert cfg.threshold("loopback.bandwidth") == Threshold(min_ratio=0.5, expected=10.0)
    assert cfg.budget("gemm") == 1.0 and cfg.budget("health") == 5.0
    cfg.apply_overrides(["interfaces=lo", "thresholds.loopback.bandwidth.expected=none"])
    assert cfg.interfaces == ("lo",) and cfg.threshold("loopback.bandwidth").expected is None


@pytest.mark.parametrize("nodes, field", [
    ([], "nodes is empty"),
    ([NodeSpec("a"), NodeSpec("a")], "nodes[1].node_id='a' is duplicated"),
    ([NodeSpec("bad id")], "nodes[0].node_id"),
    ([NodeSpec("a", devices=())], "nodes[0].devices"),
    ([NodeSpec("a", devices=(0, 0))], "nodes[0].devices"),
    ([NodeSpec("a", topology="")], "nodes[0].topology"),
    ([NodeSpec("a", host="203.0.113.9")], "nodes[0].host='203.0.113.9' is not this machine"),
])
def test_bad_nodes(nodes, field):
    with pytest.raises(ConfigError) as err:
        validate_nodes(nodes)
    assert field in str(err.value)


@pytest.mark.parametrize("faults, allowed, field", [
    ({"MEGASCALE_DIAG_SLOW_GEMM": "0.3"}, False, "needs allow_fault_injection"),
    ({"MEGASCALE_DIAG_SLOW_GEMM": "1.5"}, True, "MEGASCALE_DIAG_SLOW_GEMM='1.5'"),
    ({"MEGASCALE_DIAG_SLOW_RANK": "30"}, True, "expected RANK:MILLISECONDS"),
    ({"MEGASCALE_DIAG_SLOW_NET": "-1"}, True, "MEGASCALE_DIAG_SLOW_NET='-1'"),
    ({"MEGASCALE_DIAG_LOOPBACK_RATE_MB": "0"}, True, "MEGASCALE_DIAG_LOOPBACK_RATE_MB='0'"),
    ({"MEGASCALE_DIAG_MELT": "1"}, True, "unknown fault"),
])
def test_bad_faults(faults, allowed, field, monkeypatch):
    monkeypatch.delenv("MEGASCALE_DIAG_ALLOW_FAULTS", raising=False)
    with pytest.raises(ConfigError, match=r"nodes\[n1\]\.faults") as err:
        parse_faults("n1", faults, allowed)
    assert field in str(err.value)


def test_faults_parse():
    f = parse_faults("n1", {"MEGASCALE_DIAG_SLOW_GEMM": "1:0.25", "MEGASCALE_DIAG_SLOW_RANK": "1:30",
                            "MEGASCALE_DIAG_SLOW_NET": "20", "MEGASCALE_DIAG_HANG_RANK": "0"}, True)
    assert f.gemm_factor(1) == 0.25 and f.gemm_factor(0) == 1.0
    assert f.slow_rank == {1: 0.03} and f.slow_net_s == 0.02 and f.hang_rank == 0


def test_run_suite_rejects_bad_input_before_running(fast_config):
    with pytest.raises(ConfigError, match="interfaces: nosuchnic0 not found"):
        run_suite([NodeSpec("a")], DiagnosticsConfig(interfaces=("nosuchnic0",)))
    with pytest.raises(ConfigError, match="needs allow_fault_injection"):
        run_suite([NodeSpec("a", faults={"MEGASCALE_DIAG_SLOW_GEMM": "0.5"})], fast_config)


@pytest.mark.parametrize("argv, message", [
    (["diagnose", "--nodes", "a,,b"], "--nodes='a,,b' has an empty node id"),
    (["diagnose", "--nodes", "a,a"], "nodes[1].node_id='a' is duplicated"),
    (["diagnose", "--budget-s", "0"], "budget_s=0.0 must be a number > 0"),
    (["diagnose", "--checks", "gemm,nope"], "checks: unknown check 'nope'"),
    (["diagnose", "--set", "thresholds.gemm.flops.min_ratio=2"], "thresholds.gemm.flops.min_ratio=2.0 "
                                                                 "must be in (0, 1]"),
    (["diagnose", "--interfaces", "nosuchnic0"], "interfaces: nosuchnic0 not found"),
    (["diagnose", "--inject", "a:SLOW_GEMM=0.5", "--nodes", "a"], "needs allow_fault_injection"),
    (["diagnose", "--inject", "zz:SLOW_GEMM=0.5", "--nodes", "a"], "--inject 'zz:SLOW_GEMM=0.5'"),
])
def test_cli_bad_input_exits_2(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("MEGASCALE_DIAG_ALLOW_FAULTS", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ConfigError: ") and message in err[-1]
