"""`python -m megascale.driver --job JOB --redis URL --kafka BOOTSTRAP`: drive a submitted job until it ends."""
from __future__ import annotations

import argparse
import logging
import sys

from .reconcile import Driver
from .state import JobStore


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megascale.driver", description="drive one job to its end")
    p.add_argument("--job", required=True)
    p.add_argument("--redis", required=True, help="redis://host:port holding the job's state")
    p.add_argument("--kafka", required=True, help="Kafka bootstrap servers")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # reconnect noise during broker restarts
    return Driver(JobStore.from_url(args.redis, args.job), args.redis, args.kafka).run()


if __name__ == "__main__":
    sys.exit(main())
