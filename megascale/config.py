"""One YAML file describes a job; this module parses and validates it.

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

from megascale.checkpoint.filesystems import UnknownFilesystem
from megascale.checkpoint.filesystems import check as check_filesystem
from megascale.common import typed
from megascale.elastic import shrunk_dp


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
    grad_bucket_mb: float = 4.0
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


@dataclass
class ServicesConfig:
    redis: Optional[str] = None  # redis://host:port; None = embedded
    kafka: Optional[str] = None  # bootstrap servers; None = embedded


@dataclass
class ClusterConfig:
    """Where the ranks run: `nodes` executor daemons with `ranks_per_node` ranks each, plus hot spares."""
    backend: Literal["local"] = "local"  # the Kubernetes backend plugs in behind the same interface
    nodes: int = 1
    ranks_per_node: Optional[int] = None  # None = world size / nodes
    spares: int = 0


@dataclass
class ControlConfig:
    """Timings of the control plane (`megascale run`): heartbeats, failure detection, restarts."""
    heartbeat_s: float = 5.0
    dead_after_s: float = 15.0  # a node silent this long is declared dead (3 default heartbeat intervals)
    max_restarts: int = 3  # automatic rank restarts after a rank fails, before the job fails
    start_timeout_s: float = 120.0  # for nodes to report in and ranks to start
    command_timeout_s: float = 60.0  # for an executor to acknowledge a command
    auto_recover: bool = True  # diagnose, evict and replace failed nodes by itself; False = a dead node pauses the job
    hang_after_s: float = 120.0  # heartbeats arrive but the step has not advanced this long: a hang (0 = off)
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


def _positive(where: str, value: int | float) -> None:
    if value <= 0:
        raise ConfigError(f"{where}={value}: must be > 0")


def validate(cfg: JobConfig) -> JobConfig:
    """Checks every derived constraint; returns cfg so calls can chain."""
    m, p, b, o = cfg.model, cfg.parallelism, cfg.batch, cfg.optimizer
    for name in ("layers", "hidden", "heads", "ffn", "vocab", "seq"):
        _positive(f"model.{name}", getattr(m, name))
    for name in ("tp", "pp", "vpp", "dp"):
        _positive(f"parallelism.{name}", getattr(p, name))
    _positive("batch.micro", b.micro)
    _positive("batch.global", b.global_)
    _positive("optimizer.lr", o.lr)
    _positive("train.steps", cfg.train.steps)
    _positive("parallelism.grad_bucket_mb", p.grad_bucket_mb)
    if m.hidden % m.heads:
        raise ConfigError(f"model.heads={m.heads} does not divide model.hidden={m.hidden}")
    if (m.hidden // m.heads) % 2:
        raise ConfigError(f"model.hidden/model.heads={m.hidden // m.heads} must be even for rotary positions")
    if m.heads % p.tp:
        raise ConfigError(f"parallelism.tp={p.tp} does not divide model.heads={m.heads}")
    _validate_kv_heads(m, p)
    if m.ffn % p.tp:
        raise ConfigError(f"parallelism.tp={p.tp} does not divide model.ffn={m.ffn}")
    if m.vocab % p.tp:
        raise ConfigError(f"parallelism.tp={p.tp} does not divide model.vocab={m.vocab}")
    if m.layers % (p.pp * p.vpp):
        raise ConfigError(f"model.layers={m.layers} is not divisible by parallelism.pp*vpp={p.pp * p.vpp}")
    if p.sequence_parallel and m.seq % p.tp:
        raise ConfigError(f"parallelism.tp={p.tp} does not divide model.seq={m.seq} (needed by sequence_parallel)")
    if m.window is not None and not 0 < m.window <= m.seq:
        raise ConfigError(f"model.window={m.window}: must be in 1..model.seq={m.seq}")
    _positive("model.rotary_base", m.rotary_base)
    _positive("model.norm_eps", m.norm_eps)
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout}: must be in [0, 1)")
    if b.global_ % (b.micro * p.dp):
        raise ConfigError(f"batch.global={b.global_} is not divisible by batch.micro*parallelism.dp={b.micro * p.dp}")
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError(f"parallelism.vpp={p.vpp} needs parallelism.pp > 1")
    if p.vpp > 1 and cfg.microbatches % p.pp:
        raise ConfigError(
            f"batch: {cfg.microbatches} microbatches per DP rank is not divisible by parallelism.pp={p.pp} "
            "(needed by vpp > 1)"
        )
    if len(o.betas) != 2 or not all(0.0 <= x < 1.0 for x in o.betas):
        raise ConfigError(f"optimizer.betas={list(o.betas)}: must be two numbers in [0, 1)")
    if o.clip_grad < 0:
        raise ConfigError(f"optimizer.clip_grad={o.clip_grad}: must be >= 0")
    if o.weight_decay < 0:
        raise ConfigError(f"optimizer.weight_decay={o.weight_decay}: must be >= 0")
    if o.schedule.warmup_steps < 0:
        raise ConfigError(f"optimizer.schedule.warmup_steps={o.schedule.warmup_steps}: must be >= 0")
    if cfg.checkpoint.every < 0:
        raise ConfigError(f"checkpoint.every={cfg.checkpoint.every}: must be >= 0")
    if cfg.checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.keep={cfg.checkpoint.keep}: must be >= 1")
    if (cfg.checkpoint.every or cfg.checkpoint.resume) and not cfg.checkpoint.uri:
        raise ConfigError("checkpoint.uri: required when checkpoint.every > 0 or checkpoint.resume is set")
    if cfg.checkpoint.init_from is not None and not cfg.checkpoint.init_from.startswith("hf:"):
        raise ConfigError(f"checkpoint.init_from={cfg.checkpoint.init_from}: expected hf:DIR "
                          "(a transformers save_pretrained directory)")
    try:
        check_filesystem(cfg.checkpoint.filesystem, cfg.checkpoint.filesystem_options, cfg.checkpoint.uri)
    except UnknownFilesystem as e:
        raise ConfigError(str(e)) from None
    _positive("checkpoint.keeper_idle_s", cfg.checkpoint.keeper_idle_s)
    _positive("checkpoint.persist_timeout_s", cfg.checkpoint.persist_timeout_s)
    _positive("data.prefetch", cfg.data.prefetch)
    _positive("data.shuffle_window", cfg.data.shuffle_window)
    if cfg.data.seed < 0:
        raise ConfigError(f"data.seed={cfg.data.seed}: must be >= 0")
    if cfg.data.source != "synthetic" and not cfg.data.path:
        raise ConfigError(f"data.path: required when data.source={cfg.data.source}")
    if not cfg.data.tokenizer.strip():
        raise ConfigError("data.tokenizer: must be byte, bpe or a path to a tokenizer")
    if cfg.data.document_mask and cfg.data.source == "synthetic":
        raise ConfigError("data.document_mask: needs data.source text or shards (synthetic data has no documents)")
    _validate_cluster(cfg)
    _validate_eval(cfg)
    if not cfg.name or not all(c.isalnum() or c in "-_." for c in cfg.name):
        raise ConfigError(f"name={cfg.name!r}: use letters, digits, '-', '_' or '.'")
    return cfg


def _validate_eval(cfg: JobConfig) -> None:
    e = cfg.eval
    if e.every < 0:
        raise ConfigError(f"eval.every={e.every}: must be >= 0 (0 turns validation off)")
    _positive("eval.steps", e.steps)
    if not 0.0 <= e.split < 1.0:
        raise ConfigError(f"eval.split={e.split}: must be in [0, 1)")
    if e.split and e.data:
        raise ConfigError("eval.split: set either eval.data (a held-out path) or eval.split, not both")
    if (e.split or e.data) and cfg.data.source == "synthetic":
        raise ConfigError(f"eval.{'split' if e.split else 'data'}: needs data.source text or shards "
                          "(synthetic data validates on a held-out seed)")
    if e.every and cfg.data.source != "synthetic" and not (e.split or e.data):
        raise ConfigError(f"eval.every={e.every}: needs held-out data: eval.data (a path) or eval.split "
                          "(a fraction of data.path's documents)")
    if cfg.logging.peak_tflops is not None:
        _positive("logging.peak_tflops", cfg.logging.peak_tflops)


def _validate_kv_heads(m: ModelConfig, p: ParallelismConfig) -> None:
    if m.kv_heads is None:
        return
    _positive("model.kv_heads", m.kv_heads)
    if m.heads % m.kv_heads:
        raise ConfigError(f"model.kv_heads={m.kv_heads} does not divide model.heads={m.heads}")
    if m.kv_heads % p.tp:
        raise ConfigError(f"parallelism.tp={p.tp} does not divide model.kv_heads={m.kv_heads} "
                          "(each TP rank holds whole k/v heads)")


def _validate_cluster(cfg: JobConfig) -> None:
    c, ctl, world = cfg.cluster, cfg.control, cfg.parallelism.world_size
    _positive("cluster.nodes", c.nodes)
    if c.spares < 0:
        raise ConfigError(f"cluster.spares={c.spares}: must be >= 0")
    if c.ranks_per_node is None and world % c.nodes:
        raise ConfigError(f"cluster.nodes={c.nodes} does not divide the world size {world} (tp*pp*dp)")
    if c.ranks_per_node is not None and c.nodes * c.ranks_per_node != world:
        raise ConfigError(f"cluster.nodes*ranks_per_node={c.nodes * c.ranks_per_node} must equal the world size "
                          f"{world} (tp*pp*dp)")
    if cfg.ranks_per_node % cfg.parallelism.tp:
        raise ConfigError(f"cluster: {cfg.ranks_per_node} ranks per node is not a multiple of parallelism.tp="
                          f"{cfg.parallelism.tp} (a TP group stays inside one node)")
    for name in ("heartbeat_s", "dead_after_s", "start_timeout_s", "command_timeout_s"):
        _positive(f"control.{name}", getattr(ctl, name))
    if ctl.dead_after_s < 2 * ctl.heartbeat_s:
        raise ConfigError(f"control.dead_after_s={ctl.dead_after_s}: "
                          f"must be at least twice control.heartbeat_s={ctl.heartbeat_s}")
    if ctl.hang_after_s < 0:
        raise ConfigError(f"control.hang_after_s={ctl.hang_after_s}: must be >= 0 (0 turns hang detection off)")
    _positive("control.selfcheck_budget_s", ctl.selfcheck_budget_s)
    if ctl.prometheus_port < -1 or ctl.prometheus_port > 65535:
        raise ConfigError(f"control.prometheus_port={ctl.prometheus_port}: "
                          "must be -1 (off), 0 (any free port) or a port")
    if ctl.max_restarts < 0:
        raise ConfigError(f"control.max_restarts={ctl.max_restarts}: must be >= 0")
    if not 1 <= ctl.straggler_evict_after <= 16:  # a finding keeps its last 16 confidences
        raise ConfigError(f"control.straggler_evict_after={ctl.straggler_evict_after}: must be 1 to 16 steps")
    if not 0.5 <= ctl.straggler_evict_confidence < 1:
        raise ConfigError(f"control.straggler_evict_confidence={ctl.straggler_evict_confidence}: "
                          f"must be in [0.5, 1)")
    if ctl.no_spare == "shrink" and shrunk_dp(cfg, c.nodes - 1) is None:
        raise ConfigError(f"control.no_spare=shrink: no dp below parallelism.dp={cfg.parallelism.dp} runs on "
                          f"{c.nodes - 1} of cluster.nodes={c.nodes} with batch.global={cfg.batch.global_}; use pause")
    if ctl.evict_stragglers and not ctl.auto_recover:
        raise ConfigError("control.evict_stragglers: needs control.auto_recover (a straggler's node is replaced "
                          "by eviction; without it the job would restart onto the same slow node)")
    _positive("comm.timeout_s", cfg.comm.timeout_s)


def from_dict(raw: Any) -> JobConfig:
    try:
        cfg = typed.read(JobConfig, raw, _YAML)
    except typed.Invalid as e:
        raise ConfigError(e.describe("config")) from None
    return validate(cfg)


def load_config(path: str | Path, overrides: Optional[list[str]] = None) -> JobConfig:
    """Reads a job YAML; `overrides` are `a.b=value` strings (value parsed as YAML)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{at}") from None
    for item in overrides or []:
        apply_override(raw, item)
    return from_dict(raw)


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
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return run_dir


def with_run_dir(cfg: JobConfig, run_dir: str | Path) -> JobConfig:
    """`cfg` with "{run_dir}" in checkpoint.uri replaced by this run's directory: checkpoints of
    their own for every run, so a second run of the same YAML never restores the first one's."""
    uri = cfg.checkpoint.uri
    if not uri or RUN_DIR not in uri:
        return cfg
    resolved = dataclasses.replace(cfg.checkpoint, uri=uri.replace(RUN_DIR, str(run_dir)))
    return dataclasses.replace(cfg, checkpoint=resolved)
