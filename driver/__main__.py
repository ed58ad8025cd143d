"""`python -m megascale.driver --job JOB --redis URL --kafka BOOTSTRAP`: drive a submitted job until it ends."""
from __future__ import annotations

import argparse
import logging
import os
import sys

import redis

from megascale.common.auth import SECRETS_ENV, redacted
from megascale.common.processes import pid_alive

from . import log
from .arrow_pool import pool_in_use
from .reconcile import Driver
from .state import JobStore
from .supervisor import finish_for_supervisor


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megascale.driver", description="drive one job to its end")
    p.add_argument("--job", required=True)
    p.add_argument("--redis", required=True, help="redis://host:port holding the job's state")
    p.add_argument("--kafka", required=True, help="Kafka bootstrap servers")
    p.add_argument("--supervisor-pid", type=int, help="the `megascale run` that started this driver: should it be "
                   "killed, the job goes on, and this driver does its last duties when the job ends")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # reconnect noise during broker restarts
    pool_in_use()
    store = JobStore.from_url(args.redis, args.job)
    try:
        code = Driver(store, args.redis, args.kafka).run()
    except redis.AuthenticationError as e:  # restarting will not help: say why in the log's last line
        log.error("Redis at %s refuses this job's login from %s (%s): that file is not the one the job "
                  "started with", redacted(args.redis), os.environ.get(SECRETS_ENV, "no secrets file"), e)
        return 1
    orphaned = args.supervisor_pid and not pid_alive(args.supervisor_pid)
    if code == 0 and orphaned and (rec := store.load()) and rec.terminal:  # the job ended, nobody else will tidy
        finish_for_supervisor(args.job)
    return code


if __name__ == "__main__":
    sys.exit(main())
