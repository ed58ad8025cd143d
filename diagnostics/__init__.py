"""Node diagnostics: loopback, intra-node all-to-all, intra-ToR all-reduce, GEMM and health checks,
judged against cluster baselines, with pairwise isolation of bad nodes.

The driver calls `run_suite(nodes, config) -> Report`; `megascale diagnose` wraps the same API.
"""
from .config import CHECKS, DiagnosticsConfig, NodeSpec, Threshold, local_nodes
from .isolation import first_round_pairs, isolate
from .report import SCHEMA_VERSION, CheckResult, IsolationResult, NodeStatus, Report
from .suite import run_suite

__all__ = [
    "CHECKS", "SCHEMA_VERSION", "CheckResult", "DiagnosticsConfig", "IsolationResult", "NodeSpec", "NodeStatus",
    "Report", "Threshold", "first_round_pairs", "isolate", "local_nodes", "run_suite",
]
