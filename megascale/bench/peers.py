"""`megascale bench peers`: tokens/s of megascale, torch-native (composed the TorchTitan way) and megatron-core
training the same model from the same weights on the same batches with AdamW, per parallel layout.

Same math is enforced: the step-0 losses of the three must agree within STEP0_TOLERANCE, otherwise the
peer's cell is invalid (no tokens/s, a `why`). A cell a peer cannot run at all also says why.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Callable, Optional

import torch

from megascale.bench import overlap
from megascale.common import netemu
from megascale.common.errors import first_line
from megascale.config import ClusterConfig, JobConfig, from_dict
from megascale.launch import run_ranks
from megascale.model.gpt import GPT
from megascale.parallel.topology import ParallelContext
from megascale.synthetic import SyntheticSource
from megascale.train import layout_of

IMPLS = ("megascale", "torch_native", "megatron_core")
# tp always with sequence parallelism; pipelines always interleaved (vpp 2), as in megatron's and TorchTitan's.
CONFIGS = {
    "1rank": {},
    "tp2_sp": {"tp": 2, "sequence_parallel": True},
    "pp2_vpp2": {"pp": 2, "vpp": 2},
    "dp2": {"dp": 2},
    "tp2_pp2_dp2": {"tp": 2, "pp": 2, "vpp": 2, "dp": 2, "sequence_parallel": True},
}
STEP0_TOLERANCE = 1e-4
EMULATED_GOAL = 1.2  # megascale's tokens/s over megatron-core's at 8 ranks on the emulated network
INSTALL_HINT = "megatron-core is not installed: pip install -e '.[peers]'"


def peer_job(parallelism: dict, quick: bool, zero: int = 1) -> JobConfig:
    """The benchmarked model: megascale's gpt arch (rotary, LayerNorm, tanh GeLU, no biases, untied), which
    GPTModel and the torch-native module both express exactly; fp32, no dropout, constant-lr AdamW.
    `zero: 1` by default: megatron-core's distributed optimizer shards the same way (optimizer state over
    DP, a full gradient buffer reduce-scattered once per step); `zero: 2` is reported beside it."""
    return from_dict({
        "name": "bench-peers",
        "model": {"layers": 4, "hidden": 128 if quick else 256, "heads": 4, "ffn": 512 if quick else 1024,
                  "vocab": 1024, "seq": 64 if quick else 128, "dropout": 0.0},
        "parallelism": {**parallelism, "zero": zero},
        "batch": {"micro": 2, "global": 16},
        "optimizer": {"name": "adamw", "lr": 1e-3, "schedule": {"kind": "constant"}},
        "precision": {"dtype": "fp32"},
    })


def reference_state(cfg: JobConfig) -> dict[str, torch.Tensor]:
    """The initial weights every implementation starts from: megascale's 1-rank GPT's."""
    return GPT(cfg.model).state_dict()


def mapped_weights(state: dict[str, torch.Tensor], outer: dict[str, str],
                   per_layer: Callable[[str, str, torch.Tensor], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`state` (megascale's 1-rank GPT) in a peer's names: `outer` renames what is outside the blocks,
    `per_layer(layer, name in the block, tensor)` gives what one block parameter becomes there."""
    out = {outer[name]: t for name, t in state.items() if name in outer}
    for name, t in state.items():
        if name.startswith("blocks."):
            _, layer, rest = name.split(".", 2)
            out.update(per_layer(layer, rest, t))
    return out


def source_of(cfg: JobConfig, ctx: ParallelContext) -> SyntheticSource:
    """The batches megascale's trainer reads on this rank (its DP share of the global batch)."""
    return SyntheticSource(vocab=cfg.model.vocab, seq=cfg.model.seq, global_batch=cfg.batch.global_,
                           dp_rank=ctx.dp.rank, dp_size=ctx.dp.size, seed=cfg.data.seed)


def train_megascale(ctx: ParallelContext, cfg: JobConfig, steps: int) -> dict:
    from megascale.train import Trainer

    trainer = Trainer(cfg, ctx)
    stats = [trainer.step() for _ in range(steps)]
    trainer.finish()
    trainer.close()
    return {"losses": [s.loss for s in stats], "step_times": [s.step_time for s in stats]}


def megatron_missing() -> bool:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return True
    return False


def _rank_fn(impl: str):
    if impl == "megascale":
        return train_megascale
    if impl == "torch_native":
        from megascale.bench.peers_torch import train_torch_native

        return train_torch_native
    from megascale.bench.peers_megatron import train_megatron

    return train_megatron


def measure(impl: str, cfg: JobConfig, steps: int, place: Optional[Callable[[int], None]] = None) -> dict:
    """{"tokens_per_s", "step0_loss"} of one implementation; step 0 is the warm-up, the rest are timed.
    `place(rank)` puts a rank process onto its node of an emulated network first."""
    ranks = run_ranks(_rank_fn(impl), layout_of(cfg), cfg, steps, sequence_parallel=cfg.parallelism.sequence_parallel,
                      backend="gloo", place=place)
    step_time = max(statistics.median(r["step_times"][1:]) for r in ranks)
    # Every last-stage rank reports its DP share's loss; TP ranks report the same one.
    step0 = statistics.mean(r["losses"][0] for r in ranks if r["losses"])
    return {"tokens_per_s": cfg.batch.global_ * cfg.model.seq / step_time, "step0_loss": step0}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def _measure_config(cfg: JobConfig, steps: int, rounds: int, missing: bool, **launch) -> dict[str, tuple]:
    """{impl: (tokens/s, step-0 loss, why)}. The implementations take turns, in reversed order every other
    round, and each keeps its best round: a load spike on a shared machine then decides no ratio."""
    cells: dict[str, tuple] = {}
    for turn in range(rounds):
        for impl in IMPLS if turn % 2 == 0 else IMPLS[::-1]:
            if impl == "megatron_core" and missing:
                cells[impl] = (None, None, INSTALL_HINT)
                continue
            if impl in cells and cells[impl][0] is None:
                continue  # it failed in an earlier round
            try:
                result = measure(impl, cfg, steps, **launch)
            except RuntimeError as e:
                cells[impl] = (None, None, first_line(e))
                continue
            best = max(result["tokens_per_s"], cells[impl][0]) if impl in cells else result["tokens_per_s"]
            cells[impl] = (best, result["step0_loss"], None)
    return cells


def run(args: argparse.Namespace) -> dict:
    steps, rounds = (3, 1) if args.quick else (5, 2)
    tokens: dict = {impl: {} for impl in IMPLS}
    losses: dict = {impl: {} for impl in IMPLS}
    why: dict = {impl: {} for impl in IMPLS}
    zero2: dict = {}
    missing = megatron_missing()
    if missing:
        print(INSTALL_HINT, file=sys.stderr)  # stdout carries the JSON
    for name, parallelism in CONFIGS.items():
        cells = _measure_config(peer_job(parallelism, args.quick), steps, rounds, missing)
        for impl, (speed, loss, reason) in cells.items():
            tokens[impl][name], losses[impl][name] = speed, loss
            if reason:
                why[impl][name] = reason
        _enforce_same_math(name, tokens, losses, why)
        if parallelism.get("dp", 1) > 1:  # ZeRO-2 costs a reduce-scatter per microbatch: what that costs here
            zero2[name] = max(measure("megascale", peer_job(parallelism, args.quick, zero=2), steps)["tokens_per_s"]
                              for _ in range(rounds))
    return {
        "model": {k: v for k, v in vars(peer_job({}, args.quick).model).items()
                  if k in ("arch", "layers", "hidden", "heads", "ffn", "vocab", "seq")},
        "batch": {"micro": 2, "global": 16},
        "steps_timed": steps - 1,
        "rounds": rounds,
        "tokens_per_s": tokens,
        "speedup_vs_torch_native": {c: _ratio(tokens["megascale"][c], tokens["torch_native"][c]) for c in CONFIGS},
        "speedup_vs_megatron_core": {c: _ratio(tokens["megascale"][c], tokens["megatron_core"][c]) for c in CONFIGS},
        "step0_loss": losses,
        "megascale_zero": 1,
        "megascale_zero2_tokens_per_s": zero2,
        "zero2_vs_zero1": {c: _ratio(zero2[c], tokens["megascale"][c]) for c in zero2},
        "why": {impl: cells for impl, cells in why.items() if cells},
        "emulated": emulated(args.quick, steps, rounds, missing, args.link_gbit),
    }


def emulated(quick: bool, steps: int, rounds: int, missing: bool, link_gbit: float = ClusterConfig.link_gbit) -> dict:
    """The 8-rank layout on `bench overlap`'s emulated 2-node network (TP inside a node, DP and PP across a
    `link_gbit` link per node), where communication costs wall time as on a cluster: the issue's 1.2x goal
    against megatron-core is set there. One line saying why when it cannot run (no root)."""
    try:
        netemu.require_net_admin()
    except netemu.NetworkError as e:
        return {"not_run": str(e)}
    name, cfg = "tp2_pp2_dp2", peer_job(CONFIGS["tp2_pp2_dp2"], quick)
    with overlap.emulated_nodes(f"bench-peers-{os.getpid()}", layout_of(cfg), link_gbit) as place:
        cells = _measure_config(cfg, steps, rounds, missing, place=place)
    tokens = {impl: {name: cells[impl][0]} for impl in IMPLS}
    losses = {impl: {name: cells[impl][1]} for impl in IMPLS}
    why = {impl: {name: cells[impl][2]} if cells[impl][2] else {} for impl in IMPLS}
    _enforce_same_math(name, tokens, losses, why)
    vs_megatron = _ratio(tokens["megascale"][name], tokens["megatron_core"][name])
    return {
        "config": name,
        "placement": overlap.PLACEMENT,
        "link_gbit": link_gbit,
        "tokens_per_s": {impl: cells[name] for impl, cells in tokens.items()},
        "speedup_vs_torch_native": _ratio(tokens["megascale"][name], tokens["torch_native"][name]),
        "speedup_vs_megatron_core": vs_megatron,
        "step0_loss": {impl: cells[name] for impl, cells in losses.items()},
        "why": {impl: cells[name] for impl, cells in why.items() if cells},
        "goal": {"speedup_vs_megatron_core": EMULATED_GOAL,
                 "met": vs_megatron is not None and vs_megatron >= EMULATED_GOAL},
    }


def _enforce_same_math(config: str, tokens: dict, losses: dict, why: dict) -> None:
    """A peer whose step-0 loss is not megascale's computes another function: its cell is invalid."""
    ours = losses["megascale"][config]
    for impl in IMPLS[1:]:
        theirs = losses[impl][config]
        if theirs is None:
            continue
        if ours is None:
            tokens[impl][config] = None
            why[impl][config] = "megascale did not run here, so the same math cannot be checked"
        elif abs(theirs - ours) > STEP0_TOLERANCE:
            tokens[impl][config] = None
            why[impl][config] = (f"invalid: step-0 loss {theirs:.6f} differs from megascale's {ours:.6f} by more "
                                 f"than {STEP0_TOLERANCE}")
