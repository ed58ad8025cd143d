"""The job config's derived constraints: what each field may be given the others (tp divides heads, the
global batch fits the layout, ...). Every refusal is a `ConfigError` naming the field, in one line.
"""
from __future__ import annotations

from megascale.checkpoint.filesystems import UnknownFilesystem
from megascale.checkpoint.filesystems import check as check_filesystem
from megascale.config import ConfigError, JobConfig, ModelConfig, ParallelismConfig
from megascale.elastic import shrunk_dp


MIN_BROKER_MB = 64


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
    if p.grad_bucket_mb is not None:
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
    if cfg.checkpoint.memory_every is not None and cfg.checkpoint.memory_every < 0:
        raise ConfigError(f"checkpoint.memory_every={cfg.checkpoint.memory_every}: must be >= 0 (0 = off; unset = "
                          "measured)")
    if cfg.checkpoint.memory_every and not cfg.checkpoint.uri:
        raise ConfigError("checkpoint.uri: required when checkpoint.memory_every > 0 (snapshots are held by the "
                          "keeper of that uri)")
    if cfg.checkpoint.init_from is not None and not cfg.checkpoint.init_from.startswith("hf:"):
        raise ConfigError(f"checkpoint.init_from={cfg.checkpoint.init_from}: expected hf:DIR "
                          "(a transformers save_pretrained directory)")
    try:
        check_filesystem(cfg.checkpoint.filesystem, cfg.checkpoint.filesystem_options, cfg.checkpoint.uri)
    except UnknownFilesystem as e:
        raise ConfigError(str(e)) from None
    _positive("checkpoint.keeper_idle_s", cfg.checkpoint.keeper_idle_s)
    if cfg.services.broker_max_mb < MIN_BROKER_MB:  # a fresh tansu holds ~20 MB: less would restart it forever
        raise ConfigError(f"services.broker_max_mb={cfg.services.broker_max_mb}: must be >= {MIN_BROKER_MB}")
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
    if cfg.logging.timings_keep_steps is not None:
        _positive("logging.timings_keep_steps", cfg.logging.timings_keep_steps)
    if cfg.logging.timings_keep_days is not None:
        _positive("logging.timings_keep_days", cfg.logging.timings_keep_days)
    if cfg.logging.jsonl_max_mb < 0:
        raise ConfigError(f"logging.jsonl_max_mb={cfg.logging.jsonl_max_mb}: must be >= 0 (0 = never roll over)")


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
    _positive("cluster.link_gbit", c.link_gbit)
    if c.link_latency_ms:
        raise ConfigError(f"cluster.link_latency_ms={c.link_latency_ms}: link delay is not emulated (this kernel has "
                          "no netem or fq qdisc, and tbf only queues); set it to 0")
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
    if ctl.hang_after_steps and ctl.hang_after_steps < 2:
        raise ConfigError(f"control.hang_after_steps={ctl.hang_after_steps}: must be 0 (off) or at least 2 step "
                          "intervals (a slow step is not a hang)")
    _positive("control.selfcheck_budget_s", ctl.selfcheck_budget_s)
    if ctl.prometheus_port < -1 or ctl.prometheus_port > 65535:
        raise ConfigError(f"control.prometheus_port={ctl.prometheus_port}: "
                          "must be -1 (off), 0 (any free port) or a port")
    if ctl.max_restarts < 0:
        raise ConfigError(f"control.max_restarts={ctl.max_restarts}: must be >= 0")
    if ctl.standby_ranks < 0:
        raise ConfigError(f"control.standby_ranks={ctl.standby_ranks}: must be >= 0 (0 = no warm rank processes)")
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
