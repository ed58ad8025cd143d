"""One YAML file describes a job; this module parses it (config_checks.py validates it).

Every error is a `ConfigError` whose message is one line naming the field,
e.g. `parallelism.tp=3 does not divide model.heads=8`.
"""
from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from megascale.common import typed


class ConfigError(ValueError):
    """A job config that cannot run; the message names the offending field."""


@dataclass
class ModelConfig:
    arch: Literal["gpt", "llama"] = "gpt"  # gpt: LayerNorm + GeLU MLP; llama: RMSNorm + SwiGLU MLP
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: Optional[int] = None  # grouped-query attention: fewer k/v heads than heads; None = heads
    ffn: int = 512  # the MLP's inner width (llama: the width of gate and of up)
    vocab: int = 512
    seq: int = 64
    block: Literal["serial", "parallel"] = "serial"
    window: Optional[int] = None  # sliding-window attention span; None = full causal
    tied_embeddings: bool = False  # lm_head shares wte's weight; off by default for both archs
    dropout: float = 0.0
    rotary_base: float = 10000.0
    norm_eps: float = 1e-5  # LayerNorm / RMSNorm epsilon
    init_std: float = 0.02
    seed: int = 1234

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads


@dataclass
class OverlapConfig:
    """Communication/computation overlap (MegaScale §3.2); false = the plain engine."""

    tp: bool = False  # chunked all-gather+GEMM / GEMM+reduce-scatter in sequence-parallel regions
    pp: bool = True  # async sends, receives posted one step ahead
    dp: bool = True  # per-bucket reduce-scatter during backward, prefetched all-gathers


@dataclass
class ParallelismConfig:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    grad_bucket_mb: Optional[float] = None  # None: about AUTO_BUCKETS buckets of this rank's gradients (zero.py)
    zero: Literal[1, 2] = 2  # 1: full gradient buffer per DP rank; 2: gradients sharded over DP too
    overlap: OverlapConfig = field(default_factory=OverlapConfig)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass
class BatchConfig:
    micro: int = 2
    global_: int = 8  # `global` in YAML


@dataclass
class ScheduleConfig:
    kind: Literal["constant", "cosine", "linear"] = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1


@dataclass
class OptimizerConfig:
    name: Literal["lamb", "adamw"] = "lamb"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.01
    clip_grad: float = 1.0  # global grad-norm clip; 0 disables
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)


@dataclass
class PrecisionConfig:
    dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU


@dataclass
class DataConfig:
    source: Literal["synthetic", "text", "shards"] = "synthetic"
    path: Optional[str] = None
    seed: int = 0
    # For source=text: byte; bpe (trained locally, sized to model.vocab); or a path to a Hugging Face
    # tokenizer.json, a folder holding one, or a folder with GPT-2 vocab.json + merges.txt. With
    # source=shards a path is checked against the tokenizer the dataset was prepared with.
    tokenizer: str = "byte"
    prefetch: int = 4  # batches the node's loader keeps ready in shared memory
    shuffle_window: int = 8  # shards whose documents are shuffled together
    # Attention stays inside each document packed into a sequence (documents end at the tokenizer's
    # end-of-text, or start at its begin-of-text); off, a token also attends to earlier documents.
    document_mask: bool = False


@dataclass
class CheckpointConfig:
    uri: Optional[str] = None
    every: int = 0  # steps; 0 disables
    keep: int = 3
    resume: bool = False  # start from the newest committed checkpoint under uri (`train --resume`)
    # A registered file system by name: local, hdfs, s3, gcs, or a plugin the cluster admin installed
    # (entry points megascale.filesystems); never code a spec names. None = the one the uri implies.
    filesystem: Optional[str] = None
    filesystem_options: dict[str, str] = field(default_factory=dict)  # its options as data, e.g. region
    keeper_idle_s: float = 900.0  # the node's snapshot keeper exits this long after its last rank disconnects
    # Training blocked on a persist (the previous checkpoint still writing) is not a hang for this long.
    persist_timeout_s: float = 600.0
    # A save due while the previous checkpoint still persists: wait for it, or skip this one and train
    # on (the last step's save is never skipped).
    when_busy: Literal["wait", "skip"] = "wait"
    # Weights a job starts from when it has no checkpoint to resume: hf:DIR, a transformers
    # save_pretrained directory whose model matches the `model` section (`megascale import`).
    init_from: Optional[str] = None
    # Steps between in-memory snapshots, replicated to the next node, not persisted (needs uri);
    # None = 1 if a snapshot costs <= 2% of a step, else the smallest interval that does (measured); 0 = off.
    memory_every: Optional[int] = None

    @property
    def enabled(self) -> bool:
        """Whether ranks checkpoint at all: persisted checkpoints, a resume, or in-memory snapshots."""
        return bool(self.every or self.resume or (self.uri and self.memory_every != 0))


@dataclass
class ServicesConfig:
    redis: Optional[str] = None  # redis://host:port; None = embedded
    kafka: Optional[str] = None  # bootstrap servers; None = embedded
    # The embedded broker holds every message in memory (tansu 0.6 has neither retention nor DeleteRecords):
    # past this RSS the supervisor restarts it empty on its port, as after a crash. At least 64.
    broker_max_mb: float = 1024.0


@dataclass
class ClusterConfig:
    """Where the ranks run: `nodes` executor daemons with `ranks_per_node` ranks each, plus hot spares."""
    backend: Literal["local"] = "local"  # the Kubernetes backend plugs in behind the same interface
    nodes: int = 1
    ranks_per_node: Optional[int] = None  # None = world size / nodes
    spares: int = 0
    # emulated: each node in its own network namespace, linked to the others at link_gbit (megascale/common/netemu.py)
    network: Literal["loopback", "emulated"] = "loopback"
    link_gbit: float = 2.0
    link_latency_ms: float = 0.0  # not emulated (no delay qdisc on this kernel): anything but 0 is refused


@dataclass
class ControlConfig:
    """Timings of the control plane (`megascale run`): heartbeats, failure detection, restarts."""
    heartbeat_s: float = 2.0
    # A node silent this long is declared dead (3 heartbeat intervals); while no node at all is heard, the
    # broker or the way to it is the likelier cause, and the limit is 3x this (driver/recovery/detection.py).
    dead_after_s: float = 6.0
    max_restarts: int = 3  # automatic rank restarts after a rank fails, before the job fails
    standby_ranks: int = 1  # warm rank processes per training node, ranks_per_node on a spare (0 = off)
    start_timeout_s: float = 120.0  # for nodes to report in and ranks to start
    command_timeout_s: float = 60.0  # for an executor to acknowledge a command
    auto_recover: bool = True  # diagnose, evict and replace failed nodes by itself; False = a dead node pauses the job
    hang_after_s: float = 120.0  # heartbeats arrive but the step has not advanced this long: a hang (0 = off)
    # ... or for this many of the slowest of the recent step intervals, once there are some, if sooner (never
    # sooner than dead_after_s; 0 = hang_after_s only). A step that takes 5x its recent worst is stuck: the safety
    # factor NVIDIA's resiliency extension applies to the intervals it observes (10 cost every hang ~6 s more).
    hang_after_steps: float = 5.0
    selfcheck: bool = True  # self-check the nodes a fault points at (driver/recovery/selfcheck.py)
    selfcheck_checks: str = "gemm"  # comma-separated `megascale diagnose --checks`
    selfcheck_budget_s: float = 30.0  # per node
    crashed_selfcheck: Literal["evict", "retry"] = "evict"  # a crashed rank's node failing its check: evict,
                                                            # or check once more
    evict_stragglers: bool = False  # a rank the straggler policy names is a fault (its node gets checked)
    straggler_evict_after: int = 5  # ... once its finding has stood this many judged steps
    straggler_evict_confidence: float = 0.99999  # ... with at least this confidence (observability.md)
    prometheus_port: int = 0  # the driver serves /metrics here; 0 = a free port, written to the job state file;
                              # -1 = off
    # A node lost and no spare left: pause until one reports, or shrink to the largest dp the remaining
    # nodes hold (same global batch) until a restart finds the nodes to grow back (megascale/elastic.py)
    no_spare: Literal["pause", "shrink"] = "pause"
    # After a fault, ranks whose process is alive and well leave their incarnation and join the next one in the
    # same process (in_process), or every rank process is replaced (process) (docs/recovery.md)
    restart: Literal["in_process", "process"] = "in_process"


@dataclass
class CommConfig:
    """Communication settings every rank gets; `env` is merged over the executor's defaults."""
    timeout_s: float = 600.0  # collective timeout (gloo and NCCL), via init_process_group
    env: dict[str, str] = field(default_factory=dict)  # e.g. NCCL_IB_TIMEOUT: 22


@dataclass
class TrainConfig:
    steps: int = 20
    log_every: int = 1
    gc_every: int = 50  # steps between synchronised gc.collect() on every rank
    run_dir: str = "runs"
    recompute: Literal["none", "selective", "full"] = "none"  # activation recomputation (parallel/recompute.py)


@dataclass
class EvalConfig:
    """Validation: the loss on held-out data, forward only, every `every` steps and after the last one."""
    every: int = 0  # steps between validations; 0 = off
    steps: int = 10  # batches (each batch.global sequences) per validation; the same batches every time
    # Held-out data: a path of the same kind as data.path (text, or a prepared shards directory) ...
    data: Optional[str] = None
    # ... or this fraction of data.path's documents, never trained on (chosen by document, not by token)
    split: float = 0.0


@dataclass
class LoggingConfig:
    """Experiment logs beside metrics.jsonl."""
    tensorboard: bool = True  # event files under <run_dir>/tensorboard (`tensorboard --logdir <run_dir>`)
    wandb: bool = False  # Weights & Biases, offline, under <run_dir>/wandb (needs `pip install wandb`)
    # Per-device peak FLOP/s for MFU; None = the bf16 dense peak of a known GPU, else MFU is not logged
    peak_tflops: Optional[float] = None
    # Each rank's per-step JSON-lines files (timings, progress) roll over past this size, keeping one earlier
    # part: at most twice this each, however long the run. 0 = never
    jsonl_max_mb: float = 64.0
    # The driver's store of every rank's step timings (<run_dir>/metrics, ~100 bytes a rank-step): it deletes step
    # ranges (1,000 steps each) wholly this many steps behind the newest, and files older than this many days.
    # None = keep them all
    timings_keep_steps: Optional[int] = None
    timings_keep_days: Optional[float] = None

    def jsonl_max_bytes(self) -> Optional[int]:
        return int(self.jsonl_max_mb * 2**20) if self.jsonl_max_mb else None


@dataclass
class JobConfig:
    name: str = "job"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    services: ServicesConfig = field(default_factory=ServicesConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def microbatches(self) -> int:
        """Microbatches each DP rank runs per step (gradient accumulation / pipeline depth)."""
        return self.batch.global_ // (self.batch.micro * self.parallelism.dp)

    @property
    def ranks_per_node(self) -> int:
        return self.cluster.ranks_per_node or self.parallelism.world_size // self.cluster.nodes

    def to_dict(self) -> dict:
        return typed.to_plain(self)


# A job YAML is written by people: a misspelt field is an error, and an empty section (`model:`) has its defaults.
_YAML = typed.Rules(forbid_unknown=True, none_is_default=True)


def from_dict(raw: Any) -> JobConfig:
    try:
        cfg = typed.read(JobConfig, raw, _YAML)
    except typed.Invalid as e:
        raise ConfigError(e.describe("config")) from None
    from megascale.config_checks import validate  # it reads the dataclasses above: imported once they exist

    return validate(cfg)


def load_config(path: str | Path, overrides: Optional[list[str]] = None) -> JobConfig:
    """Reads a job YAML; `overrides` are `a.b=value` strings (value parsed as YAML)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: a directory, not a config file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{at}") from None
    if isinstance(raw, dict):
        inputs_from_file(raw, path.resolve().parent)
    for item in overrides or []:
        apply_override(raw, item)
    return from_dict(raw)


# What a job reads, by its place in the YAML, and a prefix a value may carry before the path.
INPUT_PATHS = {("data", "path"): "", ("data", "tokenizer"): "", ("eval", "data"): "",
               ("checkpoint", "init_from"): "hf:"}


def inputs_from_file(raw: dict, base: Path) -> None:
    """Relative input paths in a config file are from the file's directory, wherever `megascale` runs:
    `megascale run /abs/path/job.yaml` from any directory reads the data the file names. (What `--set` gives
    stays relative to the current directory; outputs, train.run_dir and checkpoint.uri, are from there too.)"""
    from megascale.data.tokenizer import NAMES  # data.tokenizer: byte and bpe are names, not files

    for (section, key), prefix in INPUT_PATHS.items():
        node = raw.get(section)
        value = node.get(key) if isinstance(node, dict) else None
        if not isinstance(value, str) or not value.startswith(prefix) or value in NAMES:
            continue
        given = value.removeprefix(prefix)
        if given and not Path(given).expanduser().is_absolute():
            node[key] = prefix + str(base / given)


def apply_override(raw: dict, item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r}: expected key.path=value")
    node = raw
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {part} is not a mapping")
    try:
        node[leaf] = yaml.safe_load(value)
    except yaml.YAMLError:  # not YAML (e.g. "{run_dir}/ckpt"): the text itself
        node[leaf] = value


RUN_DIR = "{run_dir}"


def new_run_dir(cfg: JobConfig, name: str) -> Path:
    """Claims `<train.run_dir>/<name>-<timestamp>` for one run, with its config.yaml. Two runs started
    in the same second get distinct directories ("-2", "-3", ...): mkdir is the atomic claim."""
    stem = Path(cfg.train.run_dir).resolve() / f"{name}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    run_dir, attempt = stem, 1
    while True:
        try:
            run_dir.mkdir()
            break
        except FileExistsError:
            attempt += 1
            run_dir = stem.with_name(f"{stem.name}-{attempt}")
    save_config(cfg, run_dir)
    return run_dir


def save_config(cfg: JobConfig, run_dir: Path) -> None:
    """`cfg` as the run's config.yaml, which `megascale train RUN_DIR --resume` and `megascale export` read.
    A checkpoint.uri inside the run is saved as "{run_dir}/...", as a new run saves it, so that a run
    continued in place and then moved or copied still restores from its own checkpoints."""
    saved = cfg.to_dict()
    uri, inside = cfg.checkpoint.uri, str(Path(run_dir).resolve())
    if uri and (uri == inside or uri.startswith(inside + "/")):
        saved["checkpoint"]["uri"] = RUN_DIR + uri[len(inside):]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))


def with_run_dir(cfg: JobConfig, run_dir: str | Path) -> JobConfig:
    """`cfg` with "{run_dir}" in checkpoint.uri replaced by this run's directory: checkpoints of
    their own for every run, so a second run of the same YAML never restores the first one's."""
    uri = cfg.checkpoint.uri
    if not uri or RUN_DIR not in uri:
        return cfg
    resolved = dataclasses.replace(cfg.checkpoint, uri=uri.replace(RUN_DIR, str(run_dir)))
    return dataclasses.replace(cfg, checkpoint=resolved)
