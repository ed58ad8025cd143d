"""Core subcommand: `train` (one job's ranks on this machine)."""
from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    # `run` (the full control plane) lives in megascale.driver.cli.
    _add_train_parser(subparsers, "train", "train a job's ranks as local processes (no control plane)")


def _add_train_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    train = subparsers.add_parser(name, help=help_text)
    train.add_argument("config", help="job YAML, or a run directory to continue (RUN_DIR --resume)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config field, e.g. --set parallelism.tp=2")
    train.add_argument("--steps", type=int, help="override train.steps")
    train.add_argument("--run-dir", help="override train.run_dir")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument("--resume", action="store_true", help="continue from the newest committed checkpoint")
    train.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    from megascale.config import ConfigError, load_config, with_run_dir
    from megascale.launch import launch_local
    from megascale.preflight import preflight

    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.run_dir:
        overrides.append(f"train.run_dir={args.run_dir}")
    if args.resume:
        overrides.append("checkpoint.resume=true")
    run_dir = Path(args.config)
    if args.resume and run_dir.name == "config.yaml" and (run_dir.parent / "metrics.jsonl").exists():
        raise ConfigError(f"{run_dir}: the config a run saved: continue that run with "
                          f"`megascale train {run_dir.parent} --resume`")
    if not run_dir.is_dir():
        return launch_local(preflight(load_config(args.config, overrides)), progress=not args.quiet)
    # A run directory: that run goes on there, from its config.yaml (with any --set applied, and saved as
    # its config.yaml again) and its own checkpoints, as `megascale export RUN_DIR` reads them.
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir}: not a run directory (no config.yaml): give a job YAML, or a directory "
                          "`megascale train` printed")
    if not args.resume:
        raise ConfigError(f"{run_dir}: a run directory: continue that run with --resume")
    if args.run_dir:
        raise ConfigError(f"--run-dir: {run_dir} is the run directory already")
    cfg = with_run_dir(load_config(run_dir / "config.yaml", overrides), run_dir.resolve())
    return launch_local(preflight(cfg), progress=not args.quiet, run_dir=run_dir.resolve())
