"""`megascale bench NAME`: run one benchmark and print its report."""
from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys

from megascale.bench import BENCHMARKS, BenchFailed
from megascale.common.typed import non_negative_number, positive_number
from megascale.config import ClusterConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="run a benchmark and print its ratios")
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.add_argument("--json", action="store_true", help="print the result as one JSON object")
    bench.add_argument("--quick", action="store_true", help="smaller sizes (for smoke tests)")
    bench.add_argument("--real", action="store_true",
                       help="recovery: real GPT ranks in the main example's shape, one fault of each kind")
    bench.add_argument("--fault-interval", type=non_negative_number, default=0.0, metavar="S",
                       help="recovery: seconds from one injected fault to the next (0 = 1 s after each recovery); "
                            "soak: the mean interval (0 = 120 s, 30 s with --quick)")
    bench.add_argument("--faults", type=int, default=0, metavar="N",
                       help="recovery (stand-in ranks): inject N faults, cycling through the kinds (0 = each once), "
                            "and report the driver's memory growth per 100 recoveries")
    bench.add_argument("--minutes", type=non_negative_number, default=0.0, metavar="N",
                       help="soak: how long to run (0 = 30 minutes, 3 with --quick)")
    bench.add_argument("--samples", metavar="FILE",
                       help="soak: also write the raw samples its slopes and drift were fitted from (JSON)")
    bench.add_argument("--no-reference", action="store_true",
                       help="soak: skip the uninterrupted run its losses are compared with (it takes about 0.6x "
                            "the soak's minutes again); loss_equal_to_uninterrupted is then null")
    bench.add_argument("--link-gbit", type=positive_number, default=ClusterConfig.link_gbit, metavar="GBIT",
                       help="overlap, peers: each emulated node's link rate (default: cluster.link_gbit's, "
                            "%(default)s)")
    bench.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    # A kill (SIGTERM) unwinds the benchmark: the jobs, brokers and servers it started are stopped by its clean-up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # Imported on demand: each benchmark pulls in its own area (torch, Kafka, Redis).
    try:
        result = importlib.import_module(f"megascale.bench.{BENCHMARKS[args.name]}").run(args)
    except BenchFailed as e:
        print(f"megascale bench {args.name}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    sys.stdout.flush()
    return 0
