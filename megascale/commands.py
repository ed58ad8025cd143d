"""Core subcommand: `train` (one job's ranks on this machine)."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    # `run` (the full control plane) lives in megascale.driver.cli.
    _add_train_parser(subparsers, "train", "train a job's ranks as local processes (no control plane)")


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
