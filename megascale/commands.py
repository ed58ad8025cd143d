"""Core subcommands: `train` (one job's ranks on this machine) and `bench NAME`."""
from __future__ import annotations

import argparse
import importlib
import json
import sys

# name -> "module:function"; the function takes the parsed args and returns a JSON-able dict.
BENCHMARKS = {
    "engine": "megascale.parallel.bench:run",
    "overlap": "megascale.parallel.bench_overlap:run",
    "init": "megascale.rendezvous.bench:run",
    "data": "megascale.data.bench:run",
    "checkpoint": "megascale.checkpoint.bench:run",
    "heartbeat": "megascale.driver.bench:run",
    "timers": "megascale.driver.metrics.bench:run",
    "recovery": "megascale.driver.bench_recovery:run",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    # `run` (the full control plane) lives in megascale.driver.cli.
    _add_train_parser(subparsers, "train", "train a job's ranks as local processes (no control plane)")

    bench = subparsers.add_parser("bench", help="run a benchmark and print its ratios")
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.add_argument("--json", action="store_true", help="print the result as one JSON object")
    bench.add_argument("--quick", action="store_true", help="smaller sizes (for smoke tests)")
    bench.add_argument("--fault-interval", type=float, default=0.0, metavar="S",
                       help="recovery: seconds from one injected fault to the next (0 = 1 s after each recovery)")
    bench.set_defaults(func=_bench)


def _add_train_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    train = subparsers.add_parser(name, help=help_text)
    train.add_argument("config", help="job YAML")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config field, e.g. --set parallelism.tp=2")
    train.add_argument("--steps", type=int, help="override train.steps")
    train.add_argument("--run-dir", help="override train.run_dir")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument("--resume", action="store_true", help="continue from the newest committed checkpoint")
    train.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    from megascale.config import load_config
    from megascale.launch import launch_local
    from megascale.preflight import preflight

    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.run_dir:
        overrides.append(f"train.run_dir={args.run_dir}")
    if args.resume:
        overrides.append("checkpoint.resume=true")
    return launch_local(preflight(load_config(args.config, overrides)), progress=not args.quiet)


def _bench(args: argparse.Namespace) -> int:
    module, _, function = BENCHMARKS[args.name].partition(":")
    result = getattr(importlib.import_module(module), function)(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    sys.stdout.flush()
    return 0
