"""Elastic data parallelism (control.no_spare: shrink): the smaller layout a job restarts at when it lost
nodes and no spare is left, and the config its ranks get there.

Only dp shrinks: tp and pp (the model's partition) and batch.global stay, so each DP rank runs more
microbatches (gradient accumulation) and the optimizer sees the same global batch every step. The
checkpoint restores onto any dp (megascale/checkpoint/restore_plan.py), and the data position it
carries counts global sequences, so the smaller job consumes the same samples.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from megascale.config import JobConfig


def shrunk_dp(cfg: JobConfig, nodes: int) -> Optional[int]:
    """The largest dp below parallelism.dp that `nodes` whole nodes hold, keeping every constraint the
    config has on dp (batch.global divisible by batch.micro*dp; vpp > 1: microbatches divisible by pp);
    None if there is none."""
    p, b, rpn = cfg.parallelism, cfg.batch, cfg.ranks_per_node
    for dp in range(p.dp - 1, 0, -1):
        world = dp * p.tp * p.pp
        if world % rpn or world // rpn > nodes:  # ranks fill whole nodes, as at full size
            continue
        if b.global_ % (b.micro * dp):
            continue
        if p.vpp > 1 and (b.global_ // (b.micro * dp)) % p.pp:
            continue
        return dp
    return None


def nodes_at(cfg: JobConfig, dp: Optional[int]) -> int:
    """The nodes a job runs on at `dp` (None: the configured layout, cluster.nodes)."""
    if dp is None:
        return cfg.cluster.nodes
    return dp * cfg.parallelism.tp * cfg.parallelism.pp // cfg.ranks_per_node


def resized(config: dict, cfg: JobConfig, dp: Optional[int]) -> dict:
    """The job's config (as submitted) at `dp`, for its ranks: parallelism.dp and the cluster it fills;
    unchanged for None. Its control.no_spare is `pause`: the shrunk job may have no smaller layout, which
    validation refuses under `shrink`, and the driver reads no_spare from the job's own config only."""
    if dp is None:
        return config
    parallelism = {**config.get("parallelism", {}), "dp": dp}
    cluster = {**config.get("cluster", {}), "nodes": nodes_at(cfg, dp), "ranks_per_node": cfg.ranks_per_node}
    control = {**config.get("control", {}), "no_spare": "pause"}
    return {**config, "parallelism": parallelism, "cluster": cluster, "control": control}


def layout_at(cfg: JobConfig, dp: Optional[int]) -> JobConfig:
    """`cfg` as the ranks of an incarnation at `dp` have it (their groups, their nodes)."""
    if dp is None:
        return cfg
    return dataclasses.replace(cfg, parallelism=dataclasses.replace(cfg.parallelism, dp=dp),
                               cluster=dataclasses.replace(cfg.cluster, nodes=nodes_at(cfg, dp),
                                                           ranks_per_node=cfg.ranks_per_node))
