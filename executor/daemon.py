"""The executor's loop: read commands (Redis), run them, watch ranks, heartbeat (Kafka).

It also ships its ranks' per-step timings (`<run_dir>/timings-rank<R>.jsonl`) to
`<job>.metrics` through one `MetricsPublisher`, which batches on its own thread and drops
rather than block: telemetry never stalls the heartbeat.

One thread on purpose: a command and a heartbeat never race over the ranks, and the loop's
cadence (at most `POLL_S` between looks at the ranks) bounds how stale a heartbeat can be.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Optional

import redis
from kafka import KafkaProducer
from kafka.errors import KafkaError
from megascale.executor.metrics_publisher import MetricsPublisher
from megascale.common import auth
from megascale.common.errors import first_line
from megascale.common.messages import JsonlTail

from megascale.common.messages import (
    Ack,
    Command,
    Heartbeat,
    MessageError,
    Metric,
    acks_key,
    command_stream,
    decode,
    encode,
    selfchecks_key,
    topic,
)

from . import log
from .host import halted_state, host_metrics, identity
from megascale.common.rankspec import RankSpec
from megascale.config import ControlConfig
from megascale.common.comm_env import comm_env
from .ranks import RankGroup, restarts_in_process
from .selfcheck import SelfCheck, Worker, spawn
from .standby import JobTraining, Standbys
from .throttle import SlowRanks

POLL_S = 0.25
STOP_GRACE_S = 5.0
# For ranks to leave their incarnation (in-process restart): abandoning a step, closing the checkpointer and
# data loader and collecting the model's garbage took 0.2-1.2 s (111 leaves, 8 ranks on the 2-core test host);
# this is over 3 times the slowest. A rank still inside after it is blocked where no abort reaches (seen: a TP
# collective whose gloo send was already on the wire to a peer that stopped reading, which gloo never wakes:
# 4 leaves in 164, docs/recovery.md) and is stopped, its stacks logged and its process replaced; at 10 s this
# wait was most of what such a recovery cost.
LEAVE_TIMEOUT_S = 4.0


class Executor:
    def __init__(self, job: str, node: str, redis_url: str, kafka: str, work_dir: Path,
                 heartbeat_s: float = ControlConfig.heartbeat_s,
                 redis_grace_s: float = 30.0, standby: int = 0, ranks_per_node: int = 0):
        """`standby`: warm rank processes to keep while this node's ranks train (`ranks_per_node` while idle)."""
        self.job, self.node, self.kafka = job, node, kafka
        self.work_dir = work_dir
        self.heartbeat_s, self.redis_grace_s = heartbeat_s, redis_grace_s
        self.boot_id = secrets.token_hex(6)
        self.host, self.ip = identity()
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=2,
                                          **auth.redis_auth(redis_url))
        self.signer = auth.env_signer()  # heartbeats and metrics carry the job's HMAC
        self.group: Optional[RankGroup] = None
        self.standbys = Standbys(work_dir, standby, ranks_per_node if standby else 0, settle_s=2 * heartbeat_s)
        self.job_training = JobTraining(self.redis, job, every_s=heartbeat_s)
        self.slow = SlowRanks(self.redis, job, node)  # `megascale chaos slow-rank` faults on this node's ranks
        self.run_dir: Optional[Path] = None  # the job's, where ranks write their flight recorders
        self.background: Optional[tuple[int, SelfCheck]] = None  # a self-check beside the ranks, by command seq
        self.worker: Optional[Worker] = None  # a diagnostics worker loading for the next self-check
        self.phase = "idle"
        self.seq = 0
        self.acked = 0
        self.stream_id = "0-0"
        self._recovered_acks = False
        self._producer: Optional[KafkaProducer] = None
        self._kafka_down_since: Optional[float] = None
        self._redis_down_since: Optional[float] = None
        self._stop = False
        self._next_heartbeat = 0.0
        self.stale_after_s: Optional[float] = None  # the job's control.hang_after_s
        self._stale_reported: Optional[float] = None
        self.timings = MetricsPublisher(job, node, kafka)
        self._tail = JsonlTail()

    # -- main loop ---------------------------------------------------------------------------

    def run(self) -> int:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "_stop", True))
        log.info("node %s of job %s up (boot %s, pid %d, host %s/%s)", self.node, self.job, self.boot_id,
                 os.getpid(), self.host, self.ip)
        host_metrics()  # primes psutil's CPU counter so the first heartbeat's figure is real
        code = 0
        try:
            while not self._stop:
                wait_s = max(0.0, min(POLL_S, self._next_heartbeat - time.monotonic(), self._stale_in()))
                for cmd in self._read_commands(wait_s):
                    self._execute(cmd)
                self._report_background()
                changed = self.group.poll() if self.group else False
                if self.standbys.wanted:  # no standbys wanted (control.standby_ranks=0): no Redis read either
                    self.standbys.refill(self._training())
                self.slow.apply(self.group)
                self._publish_metrics()
                self._publish_timings()
                # A NaN loss, or training resumed after a restart: the driver hears of it now.
                if changed or (self.group and (self.group.nonfinite or self.group.first_step_news)):
                    self._heartbeat()
                self._heartbeat_if_due()
                if self._redis_down_since and time.monotonic() - self._redis_down_since > self.redis_grace_s:
                    log.error("Redis unreachable for %.0f s: the job's control plane is gone; exiting",
                              self.redis_grace_s)
                    code = 1
                    break
        finally:
            if self.background:
                self.background[1].kill()
            if self.worker:
                self.worker.close()
            self.standbys.close()
            self.slow.stop()
            if self.group and self.group.alive():
                self.group.stop(STOP_GRACE_S, tick=self._heartbeat_if_due)
            self.phase = "exiting"
            self._heartbeat()
            self._publish_timings()  # the last steps' lines, then send what is queued
            self.timings.close(timeout=3)
            if self._producer:
                self._producer.close(timeout=2)
        log.info("node %s exiting", self.node)
        return code

    # -- commands (Redis) --------------------------------------------------------------------

    def _redis_ok(self) -> None:
        if self._redis_down_since:
            log.info("Redis reachable again")
        self._redis_down_since = None

    def _redis_failed(self, e: Exception) -> None:
        if not self._redis_down_since:
            log.warning("Redis unreachable (%s); retrying", first_line(e))
            self._redis_down_since = time.monotonic()
        time.sleep(POLL_S)

    def _read_commands(self, wait_s: float) -> list[Command]:
        key = command_stream(self.job, self.node)
        try:
            if not self._recovered_acks:  # a restarted executor skips what it already did
                raw = self.redis.hget(acks_key(self.job), self.node)
                self.acked = json.loads(raw)["seq"] if raw else 0
                self._recovered_acks = True
            found = self.redis.xread({key: self.stream_id}, count=100, block=max(1, int(wait_s * 1000)))
            self._redis_ok()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            self._redis_failed(e)
            return []
        commands = []
        for _, entries in found or []:
            for entry_id, fields in entries:
                self.stream_id = entry_id.decode()
                try:
                    cmd = decode(fields.get(b"msg", b""), expect=Command)
                except MessageError as e:
                    log.warning("ignored malformed command %s: %s", self.stream_id, e)
                    continue
                if cmd.job != self.job or cmd.node != self.node:
                    log.warning("ignored command %d for %s/%s", cmd.seq, cmd.job, cmd.node)
                elif cmd.seq > self.acked:
                    commands.append(cmd)
        return commands

    def _execute(self, cmd: Command) -> None:
        log.info("command %d: %s %s", cmd.seq, cmd.op, _brief(cmd.args))
        handler = {"start": self._start, "stop": self._stop_ranks, "diagnose": lambda a: self._diagnose(cmd.seq, a),
                   "flight": self._flight, "exit": self._exit}.get(cmd.op)
        try:
            ok, detail = handler(cmd.args) if handler else (False, f"unknown op {cmd.op!r}")
        except Exception as e:  # a command that cannot run is reported to the driver, not fatal here
            log.exception("command %d (%s) failed", cmd.seq, cmd.op)
            ok, detail = False, f"{type(e).__name__}: {e}"
        ack = Ack(job=self.job, node=self.node, seq=cmd.seq, op=cmd.op, ok=ok, detail=detail)
        # An unrecorded ack would make the driver wait forever; Redis outages are short. Hand-written, not
        # redis-py's Retry: the give-up is one outage clock (redis_grace_s) shared with command reads.
        while True:
            try:
                self.redis.hset(acks_key(self.job), self.node, encode(ack))
                self._redis_ok()
                break
            except (redis.ConnectionError, redis.TimeoutError) as e:
                self._redis_failed(e)
                if self._redis_down_since and time.monotonic() - self._redis_down_since > self.redis_grace_s:
                    self._stop = True
                    return
        self.acked = cmd.seq
        self._heartbeat()  # the driver sees the effect at once, not a heartbeat period later

    def _start(self, args: dict) -> tuple[bool, str]:
        incarnation = int(args["incarnation"])
        if self.group and self.group.incarnation == incarnation:
            return True, f"incarnation {incarnation} already started"
        self.slow.stop()
        if self.worker is not None:  # loaded for a self-check this recovery did not ask of this node: its torch
            self.worker.close()      # import would otherwise idle beside the ranks until the next recovery
            self.worker = None
        config = args["config"]
        kept: dict = {}
        if self.group and restarts_in_process(config):  # the same rank in the same place joins in its process
            kept = {r: p for r, p in self.group.waiting_for_next().items()
                    if r in args["ranks"] and p.local_rank == args["ranks"].index(r)}
        if self.group and self.group.alive():
            self.group.stop(STOP_GRACE_S, tick=self._heartbeat_if_due,
                            only=[p for p in self.group.procs if p.rank not in kept])
        self.stale_after_s = config.get("control", {}).get("hang_after_s")
        env = comm_env(config.get("comm", {}).get("env", {}), dict(os.environ))
        # The node's checkpoint keeper is this node's alone and ends with this executor (see checkpoint/keeper.py).
        env.update(MEGASCALE_NODE=self.node, MEGASCALE_NODE_PID=str(os.getpid()))
        spec = RankSpec(job=self.job, node=self.node, incarnation=incarnation, world_size=int(args["world_size"]),
                        config=config, run_dir=args["run_dir"], init_method=args["init_method"],
                        resume=bool(args.get("resume")))
        self.run_dir = Path(args["run_dir"])
        for rank in args["ranks"]:  # files grow across incarnations: ship only what this one writes
            self._tail.skip_to_end(self._timings_path(rank))
        self.group = RankGroup(self.work_dir, spec, list(args["ranks"]), env, kept, self.standbys)
        self.phase = "running"
        joined = f" ({len(kept)} in their processes)" if kept else ""
        return True, f"started ranks {args['ranks']} of incarnation {incarnation}{joined}"

    def _training(self) -> Optional[bool]:
        """For the standbys: True while this node's ranks are in the job's incarnation that trains (it made a
        step), False while the node has none (idle, a spare) and the job trains, None in between (a start or
        restart under way). By the driver's word (JobTraining): only one rank reports its steps."""
        if self.group is None:
            return False if self.job_training() else None
        running = self.phase == "running" and self.group.training() and self.group.restored_step() is not None
        return True if running and self.job_training() else None

    def _stop_ranks(self, args: dict) -> tuple[bool, str]:
        if args.get("selfcheck") and (self.worker is None or self.worker.proc.poll() is not None):
            self.worker = spawn(self.work_dir)  # loads while the ranks stop: the check that follows starts at once
        self.slow.stop()
        detail = "ranks stopped"
        if self.group and self.group.in_process:
            waiting = self.group.leave(LEAVE_TIMEOUT_S, STOP_GRACE_S, tick=self._heartbeat_if_due)
            detail += f"; {waiting} wait in their processes for the next incarnation"
        elif self.group and self.group.alive():
            self.group.stop(STOP_GRACE_S, tick=self._heartbeat_if_due)
        self.phase = "idle"
        return True, detail

    def _diagnose(self, seq: int, args: dict) -> tuple[bool, str]:
        """Self-check of this node (executor/selfcheck.py). `background`: beside its ranks, acknowledged at once,
        the result under `selfchecks_key` when it ends; else the ranks must be stopped and the ack is the result."""
        if self.background:  # the driver asks again: the newer request is the one it waits for
            self.background[1].kill()
            self.background = None
        if args.get("background"):
            self.background = (seq, SelfCheck(self.node, self.work_dir, args, self._take_worker()))
            return True, "self-check running beside the ranks"
        if self.group and self.group.training():
            return False, "ranks still running: stop them before diagnosing"
        self.phase = "diagnosing"
        self._heartbeat()
        check = SelfCheck(self.node, self.work_dir, args, self._take_worker())
        while (result := check.result()) is None:
            self._heartbeat_if_due()  # a long self-check must not look like a dead node
            time.sleep(0.05)
        self.phase = "idle"
        return result

    def _take_worker(self) -> Optional[Worker]:
        worker, self.worker = self.worker, None
        return worker

    def _report_background(self) -> None:
        """A finished background self-check's result, for the driver; kept for the next pass while Redis is down."""
        if self.background is None or (result := self.background[1].result()) is None:
            return
        seq, (ok, detail) = self.background[0], result
        ack = Ack(job=self.job, node=self.node, seq=seq, op="diagnose", ok=ok, detail=detail)
        try:
            self.redis.hset(selfchecks_key(self.job), self.node, encode(ack))
        except (redis.ConnectionError, redis.TimeoutError) as e:
            self._redis_failed(e)
            return
        log.info("background self-check (command %d) %s", seq, "passed" if ok else "failed")
        self.background = None

    def _flight(self, args: dict) -> tuple[bool, str]:
        """This node's ranks' flight recorders (readable while a rank hangs), newest `last` records each."""
        from megascale.common.flight_format import read_records

        if self.group is None or self.run_dir is None:
            return True, json.dumps({})
        last, out, halted = int(args.get("last", 64)), {}, {}
        for p in self.group.procs:
            if not p.running:  # its recorder, if any, is an earlier incarnation's: the driver would blame stale ops
                out[str(p.rank)] = {"error": f"rank {p.rank} has no process group in this incarnation yet"}
                continue
            if state := halted_state(p.proc.pid):
                halted[str(p.rank)] = state
            try:
                out[str(p.rank)] = [dataclasses.asdict(r)
                                    for r in read_records(self.run_dir / f"flight-rank{p.rank}.bin")[-last:]]
            except (OSError, ValueError) as e:  # no recorder (stand-in rank) or half-written: say so, keep the rest
                out[str(p.rank)] = {"error": first_line(e)}
        if halted:
            out["halted"] = halted
        return True, json.dumps(out)

    def _exit(self, args: dict) -> tuple[bool, str]:
        self._stop = True
        return True, "exiting"

    # -- heartbeats and metrics (Kafka) ------------------------------------------------------

    def _producer_or_none(self) -> Optional[KafkaProducer]:
        if self._producer is None:
            try:
                # No idempotence: a restarted broker forgets producer ids, and an idempotent
                # producer then fails every send. Heartbeats are periodic; a duplicate is harmless.
                # gzip: the embedded broker keeps every message in memory, 2.3 KB per 1.2 KB heartbeat
                # (4 ranks) sent plain and 0.6 KB gzipped.
                self._producer = KafkaProducer(bootstrap_servers=self.kafka, enable_idempotence=False, acks=1,
                                               compression_type="gzip", linger_ms=0, max_block_ms=500,
                                               request_timeout_ms=5000, delivery_timeout_ms=15000,
                                               reconnect_backoff_max_ms=1000, metadata_max_age_ms=5000)
            except KafkaError as e:
                self._kafka_failed(e)
        return self._producer

    def _kafka_failed(self, e: Exception) -> None:
        if self._kafka_down_since is None:
            log.warning("Kafka unreachable at %s (%s); heartbeats resume when it is back", self.kafka, type(e).__name__)
            self._kafka_down_since = time.monotonic()

    def _send(self, name: str, payload: bytes) -> None:
        producer = self._producer_or_none()
        if producer is None:
            return
        try:
            producer.send(topic(self.job, name), key=self.node.encode(), value=payload)
            if self._kafka_down_since is not None:
                log.info("Kafka reachable again after %.1f s", time.monotonic() - self._kafka_down_since)
                self._kafka_down_since = None
        except KafkaError as e:  # metadata unavailable (broker down): drop this one, the next follows
            self._kafka_failed(e)

    def _heartbeat_if_due(self) -> None:
        if time.monotonic() >= self._next_heartbeat or self._step_went_stale():
            self._heartbeat()

    def _stale_in(self) -> float:
        """Seconds until the newest step becomes older than control.hang_after_s (inf: not to be reported)."""
        at = self.group.newest().get("time") if self.group else None
        if at is None or not self.stale_after_s or at == self._stale_reported:
            return math.inf
        return at + self.stale_after_s - time.time()

    def _step_went_stale(self) -> bool:
        """True once per step, when it becomes older than control.hang_after_s: the driver hears of a
        possible hang now, not up to a heartbeat interval later."""
        if self._stale_in() > 0:
            return False
        self._stale_reported = self.group.newest()["time"]  # type: ignore[union-attr]
        return True

    def _heartbeat(self) -> None:
        self._next_heartbeat = time.monotonic() + self.heartbeat_s
        self.seq += 1
        group = self.group
        newest = group.newest() if group else {}
        nonfinite = group.take_nonfinite() if group else None
        if group:
            group.first_step_news = False
        if nonfinite:  # the driver stops on the first NaN, even one a later finite step hid
            newest = {**newest, **nonfinite}
        now = time.time()
        waiting, waiting_since = (group.waiting() if group else None) or (None, None)
        hb = Heartbeat(job=self.job, node=self.node, host=self.host, ip=self.ip, boot_id=self.boot_id, seq=self.seq,
                       time=now, interval_s=self.heartbeat_s, phase=self.phase,  # type: ignore[arg-type]
                       incarnation=group.incarnation if group else None,
                       ranks=group.statuses() if group else [], step=newest.get("step"),
                       step_age_s=round(now - newest["time"], 3) if "time" in newest else None,
                       step_time=newest.get("step_time"), loss=newest.get("loss"),
                       tokens_per_s=newest.get("tokens_per_s"), val_step=newest.get("val_step"),
                       val_loss=newest.get("val_loss"), val_ppl=newest.get("val_ppl"),
                       restored_step=group.restored_step() if group else None,
                       waiting=waiting, waiting_since=waiting_since, errors=list(group.errors) if group else [],
                       metrics=host_metrics())
        self._send("heartbeats", encode(hb, self.signer))

    def _publish_metrics(self) -> None:
        if not self.group or not self.group.steps:
            return
        steps, self.group.steps = self.group.steps, []
        for s in steps:
            try:
                metric = Metric(job=self.job, node=self.node, rank=s["rank"], incarnation=self.group.incarnation,
                                step=int(s["step"]), loss=float(s["loss"]), step_time=float(s["step_time"]),
                                tokens_per_s=float(s["tokens_per_s"]), time=time.time(),
                                grad_norm=s.get("grad_norm"), lr=s.get("lr"), val_loss=s.get("val_loss"),
                                val_ppl=s.get("val_ppl"))
            except (KeyError, TypeError, ValueError):
                continue  # a rank wrote a line without the step statistics; nothing to publish
            self._send("metrics", encode(metric, self.signer))


    def _timings_path(self, rank: int) -> Path:
        assert self.run_dir is not None
        return self.run_dir / f"timings-rank{rank}.jsonl"  # where megascale.launch.train_rank writes them

    def _publish_timings(self) -> None:
        if not self.group or self.run_dir is None:
            return
        incarnation = self.group.incarnation
        for rec in self._tail.read(self._timings_path(p.rank) for p in self.group.procs):
            self.timings.publish({**rec, "incarnation": incarnation})


def _brief(args: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in args.items() if k != "config")
