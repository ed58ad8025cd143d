"""The `megascale` command line: one subcommand per capability, each registered by its own module."""
from __future__ import annotations

import argparse
import importlib
import sys

from megascale.config import ConfigError

# Each module exposes `register(subparsers)`; it adds its subcommands and sets `func` on them.
COMMAND_MODULES = [
    "megascale.commands",
    "megascale.interop.cli",
    "megascale.bench.cli",
    "megascale.data.cli",
    "megascale.diagnostics.cli",
    "megascale.driver.cli",
    "megascale.driver.metrics.cli",
    "megascale.driver.k8s.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megascale", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"ConfigError: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
