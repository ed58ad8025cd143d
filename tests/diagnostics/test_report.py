"""The JSON report's schema is stable (versioned), judging follows the documented rules, and the
parsers for ib_write_bw / nvidia-smi / kernel-log output read real-world samples."""
import json

import pytest
from megascale.diagnostics import (
    SCHEMA_VERSION,
    CheckResult,
    IsolationResult,
    NodeStatus,
    Report,
    Threshold,
)
from megascale.diagnostics.health import parse_smi, parse_xids
from megascale.diagnostics.loopback import parse_ib_write_bw
from megascale.diagnostics.report import judge_pending

REPORT_V1 = {"schema_version": int, "passed": bool, "started_at": str, "elapsed_s": float, "budget_s": float,
             "backend": str, "device": str, "bad_nodes": list, "nodes": list, "checks": list, "isolation": list}
CHECK_V1 = {"check": str, "metric": str, "nodes": list, "target": str, "value": (float, type(None)), "unit": str,
            "status": str, "baseline": (float, type(None)), "baseline_source": str,
            "threshold": (float, type(None)), "comparison": str, "elapsed_s": float, "budget_s": float, "detail": str}
NODE_V1 = {"node_id": str, "host": str, "topology": str, "devices": list, "passed": bool, "failed": list}
ISOLATION_V1 = {"topology": str, "suspects": list, "bad_nodes": list, "pairs": list}


def assert_shape(obj: dict, schema: dict) -> None:
    assert set(obj) == set(schema), f"fields changed: bump SCHEMA_VERSION ({sorted(set(obj) ^ set(schema))})"
    for key, kind in schema.items():
        assert isinstance(obj[key], kind), f"{key} is {type(obj[key]).__name__}"


def sample_report() -> Report:
    row = CheckResult("gemm", "flops", ["n0"], "cpu:0", 150.0, "GFLOP/s", "pass", 160.0, "median", 112.0, ">=",
                      0.2, 0.25, "n=384")
    return Report(SCHEMA_VERSION, True, "2024-01-01T00:00:00+00:00", 1.5, 60.0, "gloo", "cpu", [],
                  [NodeStatus("n0", "127.0.0.1", "local-tor", [0], True, [])], [row],
                  [IsolationResult("local-tor", ["n2", "n3"], ["n3"], [["n2", "n3", 1, False]])])


def test_schema_v1_is_stable():
    assert SCHEMA_VERSION == 1
    data = json.loads(sample_report().to_json())
    assert_shape(data, REPORT_V1)
    assert_shape(data["checks"][0], CHECK_V1)
    assert_shape(data["nodes"][0], NODE_V1)
    assert_shape(data["isolation"][0], ISOLATION_V1)


def rows(values, metric="flops", check="gemm"):
    return [CheckResult(check, metric, [f"n{i}"], "cpu:0", v, "u") for i, v in enumerate(values)]


def test_judging_relative_and_absolute():
    th = {"gemm.flops": Threshold(min_ratio=0.7)}
    r = rows([100.0, 95.0, 30.0, 98.0])
    judge_pending(r, th)
    # even count: the better middle value (98) is the baseline, so one straggler cannot drag it down
    assert [x.status for x in r] == ["pass", "pass", "fail", "pass"]
    assert r[2].baseline == 98.0 and r[2].threshold == pytest.approx(68.6) and r[2].comparison == ">="
    lat = rows([10.0, 12.0, 50.0], metric="latency", check="loopback")
    judge_pending(lat, {"loopback.latency": Threshold(max_ratio=4.0)})
    assert [x.status for x in lat] == ["pass", "pass", "fail"] and lat[2].threshold == 48.0
    configured = rows([5.0])
    judge_pending(configured, {"gemm.flops": Threshold(min_ratio=0.5, expected=20.0)})
    assert configured[0].status == "fail" and configured[0].baseline_source == "configured"
    disk = rows([3.0], metric="shm", check="health")
    judge_pending(disk, {"health.shm": Threshold(min_value=4.0)})
    assert disk[0].status == "fail" and disk[0].baseline_source == "absolute" and disk[0].threshold == 4.0


IB_WRITE_BW = """
---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Dual-port       : OFF          Device         : mlx5_0
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 65536      183500           0.00               11468.77             0.183500
---------------------------------------------------------------------------------------
"""


def test_parsers():
    assert parse_ib_write_bw(IB_WRITE_BW) == pytest.approx(11.46877)
    gbits = IB_WRITE_BW.replace("MB/sec", "Gb/sec").replace("11468.77", "196.50")
    assert parse_ib_write_bw(gbits) == pytest.approx(196.5 / 8)
    with pytest.raises(ValueError):
        parse_ib_write_bw("Couldn't connect to 127.0.0.1:18515")
    smi = "0, 00000000:18:00.0, 0\n1, 00000000:3B:00.0, 2\n2, 00000000:86:00.0, [N/A]\n"
    assert parse_smi(smi) == {0: ("00000000:18:00.0", 0), 1: ("00000000:3B:00.0", 2), 2: ("00000000:86:00.0", None)}
    log = ("[ 12.3] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.\n"
           "[ 13.0] NVRM: Xid (PCI:0000:18:00): 13, Graphics Exception\n")
    assert parse_xids(log) == [("0000:3b:00", 79), ("0000:18:00", 13)]
