"""`python -m megascale.executor --job JOB --node N --redis URL --kafka BOOTSTRAP --work-dir DIR`."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from megascale.config import ControlConfig

from . import log
from .allocator import AllocatorError, rank_allocator_env
from .daemon import Executor


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megascale.executor", description="one node's executor daemon")
    p.add_argument("--job", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--redis", required=True, help="redis://host:port of the job's control plane")
    p.add_argument("--kafka", required=True, help="Kafka bootstrap servers, host:port[,host:port]")
    p.add_argument("--work-dir", required=True, type=Path, help="this node's logs and rank files")
    p.add_argument("--heartbeat-s", type=float, default=ControlConfig.heartbeat_s)
    p.add_argument("--redis-grace-s", type=float, default=30.0,
                   help="exit (stopping the ranks) when Redis stays unreachable this long")
    p.add_argument("--standby", type=int, default=0,
                   help="warm rank processes to keep while this node's ranks train (control.standby_ranks)")
    p.add_argument("--ranks-per-node", type=int, default=0, help="warm processes to keep while idle, with --standby")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # its reconnect noise; we log outages once
    try:
        rank_allocator_env()  # a bad choice stops the node at once, in one line, and the good one is logged
    except AllocatorError as e:
        log.error("%s", e)
        return 2
    return Executor(args.job, args.node, args.redis, args.kafka, args.work_dir, args.heartbeat_s,
                    args.redis_grace_s, args.standby, args.ranks_per_node).run()


if __name__ == "__main__":
    sys.exit(main())
