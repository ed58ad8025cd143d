"""The job driver: a reconcile loop over a durable job state machine, node health from heartbeats,
commands to executors, a backend that starts and stops nodes, and the `megascale run` CLI around it.

It shares only `megascale.common.messages` with the executors.
"""
import logging

log = logging.getLogger("megascale.driver")
