"""Small sizes and short budgets so the whole folder runs in well under 90 s on 2 cores.

Test hosts are shared and noisy, so relative thresholds here are looser than the production
defaults (0.25x of the baseline instead of 0.5-0.7x) and every injected fault is 10x or more.
"""
import pytest
from megascale.diagnostics import DiagnosticsConfig


@pytest.fixture
def fast_config(tmp_path) -> DiagnosticsConfig:
    cfg = DiagnosticsConfig(
        budgets={"health": 2.0, "gemm": 0.25, "loopback": 0.6, "all_to_all": 1.5, "all_reduce": 1.5},
        interfaces=("lo",),
        all_to_all_mb=1.0,
        all_reduce_mb=2.0,
        alloc_mb=16.0,
        checkpoint_dir=str(tmp_path),
        collective_timeout_s=3.0,
        spawn_grace_s=10.0,
    )
    cfg.set("thresholds.health.checkpoint_disk.min_value", 0.1)
    for key, th in cfg.thresholds.items():
        if th.min_ratio is not None:
            cfg.set(f"thresholds.{key}.min_ratio", 0.25)
        if th.max_ratio is not None:
            cfg.set(f"thresholds.{key}.max_ratio", 10.0)
    return cfg.validate()
