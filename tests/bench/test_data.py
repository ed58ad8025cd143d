"""`megascale bench data --quick`: one loader per node reads 1/ranks_per_node of what per-rank loaders read."""
from types import SimpleNamespace

import pytest
from megascale.bench.data import run


@pytest.mark.slow
def test_bench_quick():
    result = run(SimpleNamespace(quick=True, json=True))
    assert result["disk_read_ratio"] == pytest.approx(1 / result["ranks_per_node"])
    assert result["tree"]["loaders"] == 1 and result["every_rank"]["loaders"] == result["ranks_per_node"]
    assert 0 <= result["data_wait_fraction"] < 0.1  # the < 1% goal is for the full run on an idle machine
