"""The per-node executor daemon: starts and watches the node's ranks, heartbeats to Kafka, obeys the driver.

Run one per node: `python -m megascale.executor --job JOB --node N --redis URL --kafka HOST:PORT`.
It shares only `megascale.common.messages` with the driver.
"""
import logging

log = logging.getLogger("megascale.executor")
