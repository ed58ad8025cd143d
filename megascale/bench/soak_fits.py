"""The soak's arithmetic, apart from the job it runs: time lost per fault, per-process leak slopes and step-time
drift per run of steps, each from plain records (progress, leak samples, committed steps' metrics)."""
from __future__ import annotations

import statistics
from typing import Callable, Optional

import numpy as np

from megascale.bench.host_probe import median_between


def lost_seconds(progress: list[tuple[float, int]], injected: float, step_s: float) -> Optional[float]:
    """From the injection until the step passes the highest step reached before it, less those steps' time."""
    before = max((s for t, s in progress if t <= injected), default=0)
    back = next(((t, s) for t, s in progress if t > injected and s > before), None)
    if back is None:
        return None
    return round(max(0.0, back[0] - injected - (back[1] - before) * step_s), 2)


Windows = tuple[tuple[float, float], ...]  # (wall start, end) of what a fault disturbed


def fit_points(samples: list[dict], value: Callable[[dict], Optional[float]], after_s: float,
               disturbed: Windows = ()) -> tuple[np.ndarray, np.ndarray]:
    """(hours, values) of the samples from `after_s` past the first, those taken in a `disturbed` window left
    out: a rank rebuilding its model in a restart reads ~8 MB under its steady level for a sample or two, and
    the return to that level would be fitted as growth."""
    start = samples[0]["time"] if samples else 0
    points = [((s["time"] - start) / 3600.0, v) for s in samples if s["time"] - start >= after_s
              and not any(lo <= s["time"] < hi for lo, hi in disturbed) and (v := value(s)) is not None]
    return (np.array([t for t, _ in points], dtype=float), np.array([v for _, v in points], dtype=float))


def anon_mb(memory) -> float:
    """A process's anonymous memory in MB from its `psutil` memory_info: resident less its file-backed and
    shared-memory pages (libraries, the loader's ring, checkpoint segments), which come and go as they are
    touched; a leak grows here."""
    return (memory.rss - memory.shared) / 2**20


def shmem_mb(pid: int) -> Optional[float]:
    """A process's resident shared-memory pages in MB (the loader's ring, snapshot and replica segments, flight
    recorders), None once it is gone. Read from /proc/<pid>/status's RssShmem: psutil gives these only summed
    with the file-backed pages (`shared`), and the two grow for different reasons."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return next((int(line.split()[1]) / 1024 for line in status if line.startswith("RssShmem:")), None)
    except OSError:
        return None


def _slope(t: np.ndarray, v: np.ndarray) -> float:
    return float(np.polyfit(t, v, 1)[0])


def slope_per_hour(samples: list[dict], value: Callable[[dict], Optional[float]], after_s: float,
                   disturbed: Windows = ()) -> Optional[float]:
    """Per hour, a line through `fit_points`; None with fewer than 3."""
    t, v = fit_points(samples, value, after_s, disturbed)
    if len(t) < 3:
        return None
    return round(_slope(t, v), 2)


def growth_per_100(series: list[float]) -> Optional[float]:
    """Growth per 100 points of `series` (one per incarnation, or per 1,000 batches a loader served), a line
    fitted through its second half; None with fewer than 8 points, whose second half is still the heap's
    warm-up (about 5 incarnations)."""
    if len(series) < 8:
        return None
    half = series[len(series) // 2:]
    return round(_slope(np.arange(len(half)), np.array(half, dtype=float)) * 100, 1)


def process_slopes(samples: list[dict], field: str, after_s: float, min_span_s: float,
                   disturbed: Windows = ()) -> dict[str, dict]:
    """Per process kind, from each process sampled for `min_span_s` or more after its own first `after_s` (its
    warm-up): `pooled`, one per-hour slope of `field` fitted through all of them, each about its own level
    (a leak common to the kind's processes, with all their samples behind it); `worst`, the steepest of any one
    of them (a leak of one process, but on 10-20-minute lives also the largest of several ±2 MB wanders);
    `processes`, how many. Summing a kind's processes instead counts those that faults start and end as leaks."""
    lives: dict[str, list[dict]] = {}
    for sample in samples:
        for key, proc in sample.get("processes", {}).items():
            lives.setdefault(key, []).append({"time": sample["time"], **proc})
    out: dict[str, dict] = {}
    centred: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for life in lives.values():
        kind = out.setdefault(life[0]["kind"], {"pooled": None, "worst": None, "processes": 0})
        if life[-1]["time"] - life[0]["time"] - after_s < min_span_s:
            continue
        t, v = fit_points(life, lambda s: s.get(field), after_s, disturbed)
        if len(t) < 3:
            continue
        slope = round(_slope(t, v), 2)
        kind["worst"] = slope if kind["worst"] is None else max(kind["worst"], slope)
        kind["processes"] += 1
        centred.setdefault(life[0]["kind"], []).append((t - t.mean(), v - v.mean()))
    for name, parts in centred.items():
        t, v = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        out[name]["pooled"] = round(float(t @ v / (t @ t)), 2)
    return dict(sorted(out.items()))


def file_pages_added(samples: list[dict], injected: list[dict], settle_s: float,
                     kind: str = "executor.rank") -> dict[str, Optional[float]]:
    """The MB of file-backed pages (`file_mb`: library code, mapped files) that a `kind` process living through
    a fault added across it (the last sample before it to the first `settle_s` after), on average, for a
    fault of a kind that process had not lived through before (`first`: its recovery runs code the process
    never ran) and for a repeat (`repeat`), with how many of each were seen (`first_n`, `repeat_n`): pages
    of code run once stay resident, so a leak here grows on repeats too. Counted per process: ranks that
    faults start anew meet each kind for the first time, however often the job has."""
    added: dict[str, list[float]] = {"first": [], "repeat": []}
    lived: dict[str, set[str]] = {}  # process -> fault kinds it lived through
    for fault in injected:
        before = next((s for s in reversed(samples) if s["time"] < fault["time"]), None)
        after = next((s for s in samples if s["time"] >= fault["time"] + settle_s), None)
        if before is None or after is None:
            continue
        for key, proc in after["processes"].items():
            if proc["kind"] == kind and key in before["processes"]:
                seen = lived.setdefault(key, set())
                added["repeat" if fault["kind"] in seen else "first"].append(
                    file_mb(proc) - file_mb(before["processes"][key]))
                seen.add(fault["kind"])
    return {**{k: round(statistics.fmean(v), 2) if v else None for k, v in added.items()},
            **{f"{k}_n": len(v) for k, v in added.items()}}


def file_mb(use: dict) -> float:
    """A sampled process's file-backed MB: resident less anonymous, less shared memory where it was read."""
    return use["rss_mb"] - use["anon_mb"] - (use.get("shmem_mb") or 0.0)


def _runs(metrics: list[dict]) -> list[list[dict]]:
    """The committed steps' metrics cut into runs of consecutive steps: a recovery that replays steps starts a
    new run, an in-process restart that replays none does not. Not cut at every incarnation on purpose: a
    kept rank process lives through in-process restarts, and what builds up in it (garbage, a leak) would be
    cut into pieces too short to show."""
    runs, current = [], []
    for m in metrics:
        if current and m["step"] != current[-1]["step"] + 1:
            runs.append(current)
            current = []
        current.append(m)
    runs.append(current)
    return runs


def _steady_steps(run: list[dict], warmup: int, disturbed: Windows) -> list[dict]:
    """A run's steps past its `warmup` steps, less those started within a `disturbed` window."""
    return [m for m in run[warmup:]
            if not any(lo <= m.get("timings", {}).get("start", -1.0) < hi for lo, hi in disturbed)]


def _tenths(steps: list[dict]) -> Optional[tuple[list[dict], list[dict]]]:
    """The first and the last 10% of `steps`; None under 50 (a tenth under 5 steps)."""
    if len(steps) < 50:
        return None
    tenth = len(steps) // 10
    return steps[:tenth], steps[-tenth:]


def _median_time(steps: list[dict]) -> float:
    return statistics.median(m["step_time"] for m in steps)


def _wall(steps: list[dict]) -> tuple[float, float]:
    """When `steps` ran: the first one's start to the last one's end (wall clock, as the host probe's)."""
    first, last = steps[0].get("timings", {}), steps[-1].get("timings", {})
    return first.get("start", 0.0), last.get("start", 0.0) + steps[-1]["step_time"]


def _runs_in_tenths(metrics: list[dict], warmup: int, disturbed: Windows) -> list[tuple[list[dict], list[dict]]]:
    """Per run of steps long enough for a drift, its first and last tenth of steady steps."""
    return list(filter(None, (_tenths(_steady_steps(run, warmup, disturbed)) for run in _runs(metrics))))


def step_time_drift(metrics: list[dict], warmup: int = 5, disturbed: Windows = ()) -> list[float]:
    """Per run of consecutive steps (`_runs`), the median step time of its last 10% over its first 10%,
    leaving out the steps that started within a `disturbed` (wall start, end) window: a slow rank slows
    steps on purpose, and a restarted driver, Redis or broker takes the job's cores while it starts. Drift is
    for what builds up (garbage collection, leaks), not for what a fault does at once."""
    return [round(_median_time(last) / _median_time(first), 3)
            for first, last in _runs_in_tenths(metrics, warmup, disturbed)]


def host_drift(metrics: list[dict], probe: list[tuple[float, float]], warmup: int = 5,
               disturbed: Windows = ()) -> list[Optional[float]]:
    """Beside each `step_time_drift`, the same ratio of the host probe's times (megascale/bench/host_probe.py:
    its median while the last tenth of the run's steps ran over its median while the first tenth ran); None
    where either tenth had fewer than 3 probe samples. The host slowing down reads here as much as in the
    drift; something building up in the job reads in the drift alone."""
    out: list[Optional[float]] = []
    for first, last in _runs_in_tenths(metrics, warmup, disturbed):
        before, after = median_between(probe, *_wall(first)), median_between(probe, *_wall(last))
        out.append(round(after / before, 3) if before and after else None)
    return out


def step_time_follows_host(metrics: list[dict], probe: list[tuple[float, float]], window: int = 50,
                           warmup: int = 100) -> Optional[dict]:
    """How closely step time follows the host probe over the whole run: per `window` consecutive committed steps
    (past the first `warmup`), the median step time and the probe's median while they ran; their `correlation`
    and `elasticity` (the slope of log step time on log probe time: 1.25 means a host 1% slower made steps
    1.25% slower; both None where either never moved). None with fewer than 8 windows that have 5 probe samples
    or more."""
    points = []
    for i in range(warmup, len(metrics) - window + 1, window):
        steps = metrics[i:i + window]
        host = median_between(probe, *_wall(steps), least=5)
        if host is not None:
            points.append((host, _median_time(steps)))
    if len(points) < 8:
        return None
    x, y = np.log([p[0] for p in points]), np.log([p[1] for p in points])
    if not (x.std() and y.std()):  # one of them never moved: nothing to follow
        return {"windows": len(points), "correlation": None, "elasticity": None}
    return {"windows": len(points), "correlation": round(float(np.corrcoef(x, y)[0, 1]), 3),
            "elasticity": round(_slope(x, y), 2)}


def restart_ratios(metrics: list[dict], warmup: int = 5, disturbed: Windows = ()) -> list[float]:
    """Across each restart between two runs of steps long enough for a drift, the median step time of the last
    10% of the one before over the first 10% of the one after. What builds up in an incarnation (its model,
    optimizer, groups, their garbage) a restart clears: the ratios sit above 1 as the drifts do. What slows the
    host does not end at a restart: the ratios scatter about 1 whatever the drifts say."""
    tenths = [_tenths(_steady_steps(run, warmup, disturbed)) for run in _runs(metrics)]
    return [round(_median_time(before[1]) / _median_time(after[0]), 3)
            for before, after in zip(tenths, tenths[1:]) if before and after]


def cpu_cores_by_kind(samples: list[dict], after_s: float, disturbed: Windows = ()) -> dict[str, dict]:
    """Per process kind, the cores its processes used (CPU seconds over wall seconds between two samples, for
    processes in both) in the first and in the last 10% of the intervals from `after_s` past the first sample,
    those ending in a `disturbed` window left out. On a node whose cores the ranks share with the control
    plane, a driver, broker or Redis whose work grows with the job's age slows every step: it shows here."""
    start = samples[0]["time"] if samples else 0
    intervals: list[dict[str, float]] = []
    for before, now in zip(samples, samples[1:]):
        if now["time"] - start < after_s or any(lo <= now["time"] < hi for lo, hi in disturbed):
            continue
        cores: dict[str, float] = {}
        for key, proc in now["processes"].items():
            earlier = before["processes"].get(key)
            if earlier is not None and "cpu_s" in proc and "cpu_s" in earlier:
                cores[proc["kind"]] = (cores.get(proc["kind"], 0.0)
                                       + (proc["cpu_s"] - earlier["cpu_s"]) / (now["time"] - before["time"]))
        intervals.append(cores)
    if len(intervals) < 2:
        return {}
    tenth = max(1, len(intervals) // 10)
    kinds = sorted({kind for cores in intervals for kind in cores})
    return {kind: {part: round(statistics.fmean(c.get(kind, 0.0) for c in window), 3)
                   for part, window in (("first", intervals[:tenth]), ("last", intervals[-tenth:]))}
            for kind in kinds}
