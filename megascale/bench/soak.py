"""`megascale bench soak [--minutes N] [--fault-interval S] [--quick] [--samples FILE] [--no-reference]`: the
main example's shape (2 nodes x 4 GPT ranks, tp2·pp2(vpp2)·dp2, + a spare; real Redis, broker, driver, executors,
keepers, checkpoints) run for N minutes while every fault kind is injected in turn at seeded random times, then measured
the way a team running for weeks would: what each fault kind cost, whether anything leaks, whether steps slow
down, whether recovery replayed exactly, and whether the job left anything behind. `--samples FILE` keeps the
raw samples the slopes and drift were fitted from; `--no-reference` skips the uninterrupted run the losses are
compared with, for a long run that measures leaks (with `--fault-interval` longer than the run: no faults,
every process lives the whole run).

Faults (issue 21), one every `--fault-interval` seconds on average, each once the job runs again:
  kill-rank, kill-executor, hang-rank (SIGSTOP), freeze-node (executor SIGSTOP), crash-mid-persist (a rank
  killed while a checkpoint is being written), corrupt-checkpoint (the newest, then its node killed so the
  restore reads it), kill-redis, restart-broker, slow-rank, nan-loss (the reporting rank's next step report
  says NaN), kill-driver (kill-redis, restart-broker and kill-driver are a kill -9: the supervisor restarts
  each).
Lost time per fault: from the injection until training is back past the step it had reached, less the time those
steps take at the median step time. `ettr` is the driver's own (docs/recovery.md: the time that trained new steps over
the wall time); `start_s` and `lost_to_faults_s` are what it lost to start-up and to the faults.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import psutil
import yaml
from kafka import KafkaConsumer, TopicPartition

import megascale.data
from megascale.bench import BenchFailed
from megascale.bench.host_probe import host_probe
from megascale.bench.incarnations import incarnation_memory
from megascale.bench.loader_memory import loader_memory
from megascale.bench.soak_fits import (anon_mb, cpu_cores_by_kind, file_pages_added, host_drift, lost_seconds,
                                       process_slopes, restart_ratios, shmem_mb, slope_per_hour, step_time_drift,
                                       step_time_follows_host)
from megascale.bench.soak_processes import job_processes, leftovers, life_key, process_kind, temp_names
from megascale.common.messages import topic
from megascale.config import CheckpointConfig
from megascale.driver.chaos import inject
from megascale.driver.services import JobHandle
from megascale.driver.recovery.timings import recovered, recoveries_after
from megascale.driver.state import JobState, JobStore

JOB = "bench-soak"
STOP_TIMEOUT_S = 150.0  # `megascale stop` waits up to 90 s for a job to end
# kill-driver last: the driver's first life then spans most of a 30-minute run, long enough to fit its slope
FAULTS = ("kill-rank", "kill-executor", "hang-rank", "freeze-node", "crash-mid-persist", "corrupt-checkpoint",
          "kill-redis", "restart-broker", "slow-rank", "nan-loss", "kill-driver")
FAULT_SETTLE_S = 60.0  # after an injection: steps it slowed and samples of processes it made rebuild (left out of fits)
PHASES = ("detection_s", "diagnosis_s", "restart_s", "catchup_s")  # a recovery's total_s (recovery/timings.py)
LOSS_RTOL = 1e-5  # the recovery tests' tolerance: reference and job may use different thread counts per rank


def job_config(root: Path, steps: int) -> dict:
    """examples/gpt-tiny.yaml's model, layout and control defaults, on the shipped corpus, with room for restarts."""
    corpus = Path(megascale.data.__file__).parent / "corpus" / "python_docs.jsonl"
    return {"name": JOB,
            "model": {"layers": 8, "hidden": 128, "heads": 4, "ffn": 512, "vocab": 512, "seq": 64, "block": "parallel",
                      "window": 32, "tied_embeddings": True},
            "parallelism": {"tp": 2, "pp": 2, "vpp": 2, "dp": 2, "sequence_parallel": True},
            "batch": {"micro": 2, "global": 16},
            "optimizer": {"name": "lamb", "lr": 0.01, "weight_decay": 0.01, "clip_grad": 1.0,
                          "schedule": {"kind": "constant"}},
            "data": {"source": "text", "path": str(corpus), "tokenizer": "byte"},
            "checkpoint": {"uri": str(root / "ckpt"), "every": 20},
            "cluster": {"nodes": 2, "ranks_per_node": 4, "spares": 1},
            "control": {"max_restarts": 10_000},
            "train": {"steps": steps, "run_dir": str(root / "runs"), "log_every": 1}}


class Soak:
    """A launched job (`launched_job`): its status, progress and leak samples, and fault injection."""

    def __init__(self, root: Path, rng: random.Random, env: dict):
        self.root, self.rng, self.env = root, rng, env
        self.handle = JobHandle.load(JOB)
        self.store = JobStore.from_url(self.handle.redis_url, JOB, secrets=self.handle.job_secrets())
        self.progress: list[tuple[float, int]] = []  # (time, step) every ~0.5 s
        self.samples: list[dict] = []
        self._known: dict[int, psutil.Process] = {}  # the job's processes at the last sample

    def status(self) -> dict:
        try:
            return json.loads(self.store.r.get(self.store.k_status) or "{}")
        except Exception:  # noqa: BLE001 - Redis itself may be the fault being injected
            return {}

    def step(self) -> int:
        return self.status().get("step") or 0

    def watch(self, seconds: float, sample_every: float, until: Callable[[], bool] = lambda: False) -> None:
        """Records progress (and a leak sample every `sample_every` s) for up to `seconds` or until `until()`."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not until():
            self.progress.append((time.time(), self.step()))
            if not self.samples or time.time() - self.samples[-1]["time"] >= sample_every:
                self.samples.append(self.sample())
            time.sleep(0.5)

    def running(self) -> bool:
        status = self.status()
        return status.get("state") == JobState.RUNNING.value and bool(status.get("step"))

    def active_nodes(self) -> list[str]:
        return [s.node for s in self.store.load().slots("active")]

    # -- faults ------------------------------------------------------------------------------------------

    def inject(self, kind: str, node: Optional[str] = None) -> str:
        """Injects one fault of `kind` (FAULTS) into `node`, or a node drawn at random."""
        node = node or self.rng.choice(self.active_nodes())
        handle = self.handle = JobHandle.load(JOB)
        if kind == "nan-loss":  # the reporting rank's node, whichever it is
            return inject(self.store, "nan-loss")
        if kind in ("kill-rank", "hang-rank"):
            return inject(self.store, "kill-rank" if kind == "kill-rank" else "hang", node)
        if kind in ("kill-executor", "freeze-node"):
            return inject(self.store, "kill-node" if kind == "kill-executor" else "freeze-node", node)
        if kind == "slow-rank":
            rank = self.rng.randrange(8)
            return inject(self.store, "slow-rank", rank=rank, factor=2.0, duration_s=20.0)
        if kind == "crash-mid-persist":
            return self._crash_mid_persist(node)
        if kind == "corrupt-checkpoint":
            done = inject(self.store, "corrupt-checkpoint", checkpoint=CheckpointConfig(uri=str(self.root / "ckpt")))
            return f"{done}; {inject(self.store, 'kill-node', node)}"  # its restore reads storage
        pid = {"kill-driver": handle.driver_pid, "kill-redis": handle.redis_pid,
               "restart-broker": handle.kafka_pid}[kind]
        os.kill(pid, signal.SIGKILL)
        return f"{kind}: killed pid {pid}"

    def _crash_mid_persist(self, node: str) -> str:
        """Kills a rank of `node` while a step directory has shards and no manifest yet (polled every 5 ms)."""
        ckpt, deadline = self.root / "ckpt", time.monotonic() + 120
        seen = {d.name for d in ckpt.glob("step-*")}
        while time.monotonic() < deadline:
            for d in ckpt.glob("step-*"):
                if d.name not in seen and any(d.glob("*.safetensors")) and not (d / "manifest.json").exists():
                    return f"during the persist of {d.name}: " + inject(self.store, "kill-rank", node)
            time.sleep(0.005)
        return "no persist seen within 120 s: " + inject(self.store, "kill-rank", node)

    # -- leak samples --------------------------------------------------------------------------------------

    def processes(self) -> list[psutil.Process]:
        pids = {self.handle.supervisor_pid, self.handle.driver_pid, self.handle.redis_pid, self.handle.kafka_pid}
        self._known = job_processes(filter(None, pids), self._known)
        return list(self._known.values())

    def sample(self) -> dict:
        processes: dict[str, dict] = {}  # life_key -> its kind and use
        for p in self.processes():
            try:
                with p.oneshot():
                    cmdline = p.cmdline()
                    if not cmdline:  # a zombie between its exit and its parent's wait
                        continue
                    threads, memory, cpu = p.num_threads(), p.memory_info(), p.cpu_times()
                    processes[life_key(p.pid, p.create_time(), cmdline, threads)] = {
                        "kind": process_kind(cmdline), "rss_mb": memory.rss / 2**20,
                        "anon_mb": anon_mb(memory), "shmem_mb": shmem_mb(p.pid), "fds": p.num_fds(), "threads": threads,
                        "cpu_s": cpu.user + cpu.system}
            except psutil.Error:
                continue
        out = {"time": time.time(), "processes": processes, "shm_segments": len(os.listdir("/dev/shm"))}
        try:
            out["redis_keys"] = self.store.r.dbsize()
            out["redis_rss_mb"] = psutil.Process(self.handle.redis_pid).memory_info().rss / 2**20
            _, offsets = self.store.offsets()  # the driver's, saved every second
            ends = self._end_offsets()
            out["heartbeat_lag"] = sum(max(0, end - offsets.get(p, 0)) for p, end in ends.items())
        except Exception:  # noqa: BLE001 - a sample while Redis or the broker restarts
            pass
        return out

    def _end_offsets(self) -> dict[int, int]:
        """The heartbeat topic's end offset per partition (a fresh client: the broker may have been restarted)."""
        consumer = KafkaConsumer(bootstrap_servers=self.handle.kafka, request_timeout_ms=5000)
        try:
            name = topic(JOB, "heartbeats")
            parts = [TopicPartition(name, p) for p in consumer.partitions_for_topic(name) or ()]
            return {tp.partition: end for tp, end in consumer.end_offsets(parts).items()}
        finally:
            consumer.close()


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@contextlib.contextmanager
def launched_job(root: Path, rng: random.Random, bench: str) -> Iterator[Soak]:
    """`job_config` launched under its own MEGASCALE_HOME in `root`; stopped, and waited for, however the block
    ends. `bench` names the benchmark in the one-line error of a failed launch."""
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job_config(root, steps=1_000_000)))
    env = {**os.environ, "MEGASCALE_HOME": str(root / "home")}
    os.environ["MEGASCALE_HOME"] = env["MEGASCALE_HOME"]  # JobHandle.load reads it here
    launch = subprocess.Popen([sys.executable, "-m", "megascale.cli", "launch", str(path)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        try:
            _, err = launch.communicate(timeout=120)
        except BaseException:  # a kill (SIGTERM) or the timeout: a launch cut short would leave its job unstopped
            _finish(launch)
            raise
        if launch.returncode:
            raise SystemExit(f"megascale bench {bench}: {(err.strip() or 'launch failed').splitlines()[-1]}")
        yield Soak(root, rng, env)
    finally:
        if JobHandle.load(JOB) is not None:  # `megascale stop`: waits for the job's end, also one half-started
            subprocess.run([sys.executable, "-m", "megascale.cli", "stop", JOB], env=env, capture_output=True,
                           timeout=STOP_TIMEOUT_S)


def _finish(launch: subprocess.Popen) -> None:
    """Lets a launch that was interrupted write its job's handle (so that the job can be stopped); killed if
    it does not end within a minute."""
    try:
        launch.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        launch.kill()
        launch.communicate()


def losses_against_uninterrupted(soak: Soak, compare: bool = True) -> tuple[list[dict], dict]:
    """The stopped job's metrics (a replayed step's latest line counts), and how its losses compare with an
    uninterrupted `megascale train` of the same job to the same step (null without `compare`)."""
    metrics = read_metrics(Path(JobHandle.load(JOB).run_dir))
    if not compare:
        return metrics, {"loss_equal_to_uninterrupted": None, "loss_steps_compared": 0, "loss_mismatched_steps": []}
    reference = reference_losses(soak.root, soak.env, max((m["step"] for m in metrics), default=0))
    latest = {m["step"]: m["loss"] for m in metrics}
    mismatched = [s for s, loss in latest.items() if s in reference
                  and abs(loss - reference[s]) > LOSS_RTOL * max(1.0, abs(reference[s]))]
    equal = bool(reference) and not mismatched and set(latest) <= set(reference)
    return metrics, {"loss_equal_to_uninterrupted": equal, "loss_steps_compared": len(set(latest) & set(reference)),
                     "loss_mismatched_steps": mismatched[:10]}


def run(args: argparse.Namespace) -> dict:
    quick = bool(getattr(args, "quick", False))
    minutes = getattr(args, "minutes", None) or (3.0 if quick else 30.0)
    interval = getattr(args, "fault_interval", 0.0) or (30.0 if quick else 120.0)
    if minutes <= 0 or interval <= 0:
        raise SystemExit("megascale bench soak: --minutes and --fault-interval must be > 0")
    samples_file = getattr(args, "samples", None)
    compare_losses = not getattr(args, "no_reference", False)
    if samples_file:  # a path that cannot be written fails now, not after the run
        try:
            Path(samples_file).write_text("")
        except OSError as e:
            raise BenchFailed(f"--samples {samples_file}: {e.strerror}") from None
    rng = random.Random(21)
    # before the job, alone on the CPUs: what each in-process restart leaves in a rank, apart from time
    per_incarnation = incarnation_memory(cycles=4 if quick else 16)
    per_batch = loader_memory(batches=10_000 if quick else 100_000)
    shm_before, tmp_before = set(os.listdir("/dev/shm")), temp_names()
    with tempfile.TemporaryDirectory(prefix="megascale-bench-soak-") as tmp:
        root = Path(tmp)
        injected: list[dict] = []
        started = time.time()
        with host_probe(root / "host-probe.txt") as probe, launched_job(root, rng, "soak") as soak:
            soak.watch(600, 30, until=lambda: soak.step() >= 10)
            end = started + minutes * 60
            kinds = list(FAULTS)
            while time.time() < end:
                soak.watch(min(rng.uniform(0.5, 1.5) * interval, max(0.0, end - time.time())),
                           10 if quick else 30)
                if end - time.time() < interval / 4:  # too late to see this fault's recovery
                    break
                soak.watch(300, 30, until=soak.running)  # the previous fault recovered
                kind = kinds[len(injected) % len(kinds)]
                before = recovered(soak.status())
                at = time.time()
                injected.append({"kind": kind, "time": at, "done": soak.inject(kind), "recoveries_before": before})
            soak.watch(300, 30, until=soak.running)
            final_status = soak.status()
            keys = redis_keys_by_prefix(soak.store)
            host = probe.samples(), probe.realtime()
        metrics, losses = losses_against_uninterrupted(soak, compare_losses)
        time.sleep(2)  # the supervisor's last clean-up
        left = leftovers(root, shm_before, tmp_before)
    result = report(soak, injected, final_status, metrics, losses, left, interval, host)
    if samples_file:
        save_samples(Path(samples_file), soak, injected, metrics, host[0])
    growth = per_batch["rss_mb_per_100k_batches"]  # a node's loader packs a batch a step: per hour of this job
    per_batch["rss_mb_per_hour_at_this_jobs_rate"] = (round(growth * 3600 / result["step_s_median"] / 1e5, 2)
                                                     if growth is not None and result["step_s_median"] else None)
    return {**result, "rank_memory_by_incarnation": per_incarnation, "loader_memory_by_batches": per_batch,
            "minutes": round((time.time() - started) / 60, 1),
            "redis_keys_at_end": keys}


def save_samples(path: Path, soak: Soak, injected: list[dict], metrics: list[dict],
                 probe: list[tuple[float, float]]) -> None:
    """What the report was fitted from, for looking into a slope or a drift: every leak sample (per process:
    kind, RSS, fds, threads), the step progress, the injections, the committed steps' metrics and the host
    probe's (time, seconds)."""
    path.write_text(json.dumps({"samples": soak.samples, "progress": soak.progress, "injected": injected,
                                "metrics": metrics, "host_probe": probe}))


def redis_keys_by_prefix(store: JobStore) -> dict[str, int]:
    """The job's Redis keys at the end, counted by their first three `:`-separated parts."""
    counts: dict[str, int] = {}
    for key in store.r.scan_iter(count=1000):
        prefix = ":".join(key.decode(errors="replace").split(":")[:3])
        counts[prefix] = counts.get(prefix, 0) + 1
    return dict(sorted(counts.items()))


def reference_losses(root: Path, env: dict, steps: int) -> dict[int, float]:
    """An uninterrupted `megascale train` of the same job to `steps`."""
    ref = root / "reference"
    config = job_config(ref, steps)
    config["checkpoint"] = {"uri": str(ref / "ckpt"), "every": 0}
    path = root / "reference.yaml"
    path.write_text(yaml.safe_dump(config))
    subprocess.run([sys.executable, "-m", "megascale.cli", "train", str(path), "--quiet"], env=env, check=True,
                   capture_output=True)
    (metrics_file,) = (ref / "runs").glob("*/metrics.jsonl")
    return {m["step"]: m["loss"] for m in map(json.loads, metrics_file.read_text().splitlines())}


def report(soak: Soak, injected: list[dict], final: dict, metrics: list[dict], losses: dict,
           left: dict[str, int], interval: float, host: tuple[list[tuple[float, float]], bool] = ([], True)) -> dict:
    """`host`: the host probe's (time, seconds) samples and whether it ran at real-time priority."""
    step_s = statistics.median(m["step_time"] for m in metrics) if metrics else 0.0
    by_kind: dict[str, list[Optional[float]]] = {}
    ends = [f["recoveries_before"] for f in injected[1:]] + [recovered(final)]
    for fault, end in zip(injected, ends):
        # a fault the driver recovered from costs what its recoveries' timelines say (fault to caught up);
        # any other (driver, Redis, broker, slow rank) what the step progress shows
        own = [r for r in recoveries_after(final, fault["recoveries_before"]) if r["n"] <= end]
        fault["recoveries"] = [r["kind"] for r in own]
        fault["phases_s"] = [{k.removesuffix("_s"): r[k] for k in PHASES if k in r} for r in own]
        lost = (round(sum(r["total_s"] for r in own), 2) if own
                else lost_seconds(soak.progress, fault["time"], step_s))
        fault["lost_s"] = lost
        by_kind.setdefault(fault["kind"], []).append(lost)
    span = soak.samples[-1]["time"] - soak.samples[0]["time"] if soak.samples else 0.0
    after = 300.0 if span >= 600 else 60.0  # slopes after the first 5 minutes (1 in a short run)
    lived = 600.0 if span >= 600 else 60.0  # ... of processes sampled this long after their own first `after`
    settle = min(FAULT_SETTLE_S, interval / 2)  # --quick injects every ~30 s: a minute each would leave nothing
    disturbed = tuple((f["time"], f["time"] + settle) for f in injected)
    per_process = {name: process_slopes(soak.samples, name, after, lived, disturbed)
                   for name in ("rss_mb", "anon_mb", "shmem_mb", "fds", "threads")}
    drift = step_time_drift(metrics, disturbed=disturbed)
    host_drifts = host_drift(metrics, host[0], disturbed=disturbed)
    return {
        "fault_interval_s": interval,
        "faults": len(injected),
        "recoveries": recovered(final),
        "failed": int(final.get("state") != JobState.RUNNING.value),
        "ettr": final.get("ettr"),
        # what ETTR counts as lost, apart: submission to the first step, and the faults (whose recovery ended)
        "start_s": round(next((t for t, step in soak.progress if step), soak.progress[-1][0]) - soak.progress[0][0], 1)
        if soak.progress else None,
        "lost_to_faults_s": round(sum(f["lost_s"] for f in injected if f["lost_s"] is not None), 1),
        # not_back: faults after which training never passed its earlier step before the run ended
        "ettr_by_fault_kind": {k: {"faults": len(v), "not_back": v.count(None),
                                   "lost_s_mean": round(statistics.fmean(x for x in v if x is not None), 2)
                                   if any(x is not None for x in v) else None} for k, v in sorted(by_kind.items())},
        "steps": max((m["step"] for m in metrics), default=0),
        "step_s_median": round(step_s, 3),
        # per process kind (process_slopes): memory pooled over its long-lived processes and the steepest of
        # them; descriptors and threads the steepest; how many processes there were
        "rss_slope_mb_per_hour": {k: v["pooled"] for k, v in per_process["rss_mb"].items()},
        "anon_rss_slope_mb_per_hour": {k: v["pooled"] for k, v in per_process["anon_mb"].items()},
        "shmem_rss_slope_mb_per_hour": {k: v["pooled"] for k, v in per_process["shmem_mb"].items()},
        "rss_slope_steepest_process_mb_per_hour": {k: v["worst"] for k, v in per_process["rss_mb"].items()},
        "anon_rss_slope_steepest_process_mb_per_hour": {k: v["worst"] for k, v in per_process["anon_mb"].items()},
        "fds_slope_per_hour": {k: v["worst"] for k, v in per_process["fds"].items()},
        "threads_slope_per_hour": {k: v["worst"] for k, v in per_process["threads"].items()},
        "slope_processes": {k: v["processes"] for k, v in per_process["rss_mb"].items()},
        "rank_file_pages_mb_added_per_fault": file_pages_added(soak.samples, injected, settle),
        "shm_segments_slope_per_hour": slope_per_hour(soak.samples, lambda s: s["shm_segments"], after, disturbed),
        "redis_keys_slope_per_hour": slope_per_hour(soak.samples, lambda s: s.get("redis_keys"), after, disturbed),
        "redis_rss_slope_mb_per_hour": slope_per_hour(soak.samples, lambda s: s.get("redis_rss_mb"), after, disturbed),
        "heartbeat_lag_max": max((s["heartbeat_lag"] for s in soak.samples if "heartbeat_lag" in s), default=None),
        "step_time_drift": drift,
        "step_time_drift_all_steps": step_time_drift(metrics),
        "step_time_restart_ratios": restart_ratios(metrics, disturbed=disturbed),
        "host_speed_drift": host_drifts,
        # each drift over the host's in the same windows: what the job's own build-up would be
        "step_time_drift_host_adjusted": [round(d / h, 3) if h else None for d, h in zip(drift, host_drifts)],
        "host_probe_realtime": host[1],
        "step_time_follows_host": step_time_follows_host(metrics, host[0]),
        "cpu_cores_by_kind": cpu_cores_by_kind(soak.samples, after, disturbed),
        **losses,
        "leftovers": left,
        "injected": [{k: f[k] for k in ("kind", "done", "recoveries", "lost_s", "phases_s")} for f in injected],
        "cpus": os.cpu_count(),
        "load_1m": round(os.getloadavg()[0], 1),
    }
