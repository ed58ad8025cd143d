"""`megascale diagnose`: run the diagnostics suite on local-backend nodes and print or save the report."""
from __future__ import annotations

import argparse
import socket
import sys

from megascale.common import netemu
from megascale.config import ConfigError

from .faults import ALLOW_ENV, PREFIX


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("diagnose", help="check nodes' network, GPUs and health; name the bad ones",
                              description="Exit status: 0 all checks pass, 1 a check failed, 2 bad input.")
    p.add_argument("--nodes", help="comma-separated node ids (local backend: all on this host); default: this host")
    p.add_argument("--job", help="a running job on an emulated network (cluster.network: emulated): its nodes, each "
                   "checked from its own network namespace, so all_reduce pairs cross their links")
    p.add_argument("--ranks-per-node", type=int, help="ranks (devices) per node; default: GPUs on this host, else 2")
    p.add_argument("--checks", help="comma-separated subset of health,gemm,loopback,all_to_all,all_reduce")
    p.add_argument("--interfaces", help="comma-separated interfaces for loopback; default: every up IPv4 interface")
    p.add_argument("--budget-s", type=float, default=60.0, help="seconds per node for the whole suite (default 60)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. --set thresholds.gemm.flops.min_ratio=0.8 or --set budgets.gemm=1")
    p.add_argument("--inject", action="append", default=[], metavar="NODE:KEY=VALUE",
                   help=f"test-only fault, e.g. n1:SLOW_GEMM=0.3; needs {ALLOW_ENV}=1")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--output", help="also write the JSON report to this file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from . import DiagnosticsConfig, local_nodes, run_suite

    try:
        ids = _split_ids(args.nodes) if args.nodes else _job_nodes(args.job) if args.job else [
            socket.gethostname().split(".")[0] or "node0"]
        config = DiagnosticsConfig(budget_s=args.budget_s)
        overrides = list(args.overrides)
        if args.checks:
            overrides.append(f"checks={args.checks}")
        if args.interfaces:
            overrides.append(f"interfaces={args.interfaces}")
        config.apply_overrides(overrides)
        nodes = local_nodes(ids, args.ranks_per_node or _default_ranks())
        store_host = "127.0.0.1"
        if args.job:
            net = netemu.JobNetwork(args.job)
            for node in nodes:
                node.netns = net.namespace(node.node_id)
            store_host = net.host_address
        _inject(nodes, args.inject)
        log = None if args.json else (lambda msg: print(f"... {msg}", file=sys.stderr, flush=True))
        report = run_suite(nodes, config, log=log, store_host=store_host)
    except ConfigError as e:
        print(f"ConfigError: {e}", file=sys.stderr)
        return 2
    if args.output:
        with open(args.output, "w") as f:
            f.write(report.to_json() + "\n")
    print(report.to_json() if args.json else _table(report))
    return 0 if report.passed else 1


def _job_nodes(job: str) -> list[str]:
    ids = sorted(netemu.nodes(job), key=lambda n: (len(n), n))
    if not ids:
        raise ConfigError(f"--job={job}: no node of that job is on an emulated network now (cluster.network)")
    return ids


def _split_ids(text: str) -> list[str]:
    ids = [s.strip() for s in text.split(",")]
    if any(not s for s in ids):
        raise ConfigError(f"--nodes={text!r} has an empty node id")
    return ids


def _default_ranks() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _inject(nodes: list, items: list[str]) -> None:
    by_id = {n.node_id: n for n in nodes}
    for item in items:
        node_id, sep, rest = item.partition(":")
        key, eq, value = rest.partition("=")
        if not sep or not eq or node_id not in by_id:
            raise ConfigError(f"--inject {item!r}: expected NODE:KEY=VALUE with NODE in {','.join(by_id)}")
        key = key if key.startswith(PREFIX) else PREFIX + key
        by_id[node_id].faults[key] = value


def _table(report) -> str:
    lines = [f"{'check':<11} {'metric':<19} {'nodes':<14} {'target':<14} {'value':>16} {'threshold':>12}  status"]
    for c in report.checks:
        value = "-" if c.value is None else f"{c.value:.4g} {c.unit}"
        limit = f"{c.comparison} {c.threshold:.4g}" if c.threshold is not None else "-"
        note = f"  {c.detail}" if c.status != "pass" and c.detail else ""
        lines.append(f"{c.check:<11} {c.metric:<19} {','.join(c.nodes):<14} {c.target:<14} {value:>16} {limit:>12}"
                     f"  {c.status.upper()}{note}")
    for iso in report.isolation:
        lines.append(f"isolation tor:{iso.topology}: suspects {iso.suspects or '-'} -> bad {iso.bad_nodes or '-'}")
    verdict = "PASS" if report.passed else "FAIL"
    bad = f"; bad nodes: {','.join(report.bad_nodes)}" if report.bad_nodes else ""
    lines.append(f"{verdict}: {len(report.checks)} checks on {len(report.nodes)} nodes "
                 f"in {report.elapsed_s:.1f} s{bad}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (`python -m megascale.diagnostics.cli diagnose ...`)."""
    parser = argparse.ArgumentParser(prog="megascale")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
