"""An in-process restart keeps the rank's model and optimizer (megascale.train.KeptTrainer): the next incarnation
restores into the same allocations instead of building anew. A step abandoned part-way (gradients accumulated,
the optimizer not yet stepped) must leave nothing behind: once restored, the kept trainer trains exactly as a new
one restored from the same state does (bit for bit on one rank; on 2 ranks with real gloo groups, over two
restarts, every loss of an uninterrupted run within 1e-6 relative, with threads and descriptors flat). With
nothing to restore it starts from a new model's weights; a kept trainer that does not fit the next incarnation
(another layout or config) is freed, not reused."""
from __future__ import annotations

import copy
import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from megascale.checkpoint import shutdown_keeper
from megascale.config import from_dict
from megascale.executor.rank import release
from megascale.launch import run_ranks
from megascale.parallel.topology import single_device_context
from megascale.parallel.zero import DistributedOptimizer
from megascale.rank import init_rank, shutdown_rank
from megascale.train import KeptTrainer, Trainer, checkpoint_parts, layout_of, train_rank

from incarnation_support import threads_and_fds

STEPS = 6
INCARNATIONS = 4  # in _incarnations: 3 fail part-way


def job(zero: int = 2, parallelism: dict | None = None, **train):
    return from_dict({"model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
                      "parallelism": {"zero": zero, **(parallelism or {})}, "batch": {"micro": 1, "global": 4},
                      "optimizer": {"name": "adamw", "lr": 0.01, "schedule": {"kind": "constant"}},
                      "train": {"steps": STEPS, **train}})


def abandon_a_step(trainer: Trainer) -> None:
    """Runs a step's forward and backward (gradients reduced into the shard), then fails before the update."""
    def fail(*_):
        raise RuntimeError("the step is abandoned")

    trainer.optimizer.grad_norm = fail
    with pytest.raises(RuntimeError, match="abandoned"):
        trainer.step()
    del trainer.optimizer.grad_norm
    assert trainer.optimizer.grad_shard.abs().sum() > 0  # what the abandoned step left


def saved(trainer: Trainer) -> dict:
    return {name: copy.deepcopy(part.state_dict()) for name, part in checkpoint_parts(trainer).items()}


def restore(trainer: Trainer, state: dict) -> None:
    for name, part in checkpoint_parts(trainer).items():
        part.load_state_dict(copy.deepcopy(state[name]))


def train(trainer: Trainer, steps: int) -> list[float]:
    return [trainer.step().loss for _ in range(steps)]


@pytest.mark.parametrize("zero", [1, 2])
def test_a_kept_trainer_abandoned_mid_step_trains_on_as_a_new_one_restored_from_the_same_state(zero):
    cfg = job(zero)
    torch.manual_seed(0)
    trainer = Trainer(cfg, single_device_context())
    train(trainer, 3)
    state = saved(trainer)
    abandon_a_step(trainer)
    weights = trainer.optimizer.param_buffer.data_ptr()
    kept = KeptTrainer()
    kept.keep(trainer)
    assert kept.take(cfg, single_device_context()) is trainer  # the next incarnation's groups
    assert trainer.optimizer.param_buffer.data_ptr() == weights  # the same allocation
    restore(trainer, state)
    try:
        losses = train(trainer, 3)
    finally:
        trainer.close()

    new = Trainer(cfg, single_device_context())
    try:
        restore(new, state)
        assert train(new, 3) == losses
        assert torch.equal(new.optimizer.param_buffer, trainer.optimizer.param_buffer)
        assert torch.equal(new.optimizer.exp_avg_sq, trainer.optimizer.exp_avg_sq)
    finally:
        new.close()


def test_a_kept_trainer_with_nothing_to_restore_starts_from_a_new_models_weights():
    cfg = job()
    torch.manual_seed(1)
    trainer = Trainer(cfg, single_device_context())
    train(trainer, 2)
    abandon_a_step(trainer)
    kept = KeptTrainer()
    kept.keep(trainer)
    torch.manual_seed(1)  # as FreshState puts a rank's random streams back before each incarnation
    assert kept.take(cfg, single_device_context()) is trainer  # with a new data source
    trainer.reinitialize()
    torch.manual_seed(1)
    new = Trainer(cfg, single_device_context())
    try:
        for name in ("param_buffer", "master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(getattr(trainer.optimizer, name), getattr(new.optimizer, name)), name
        assert (trainer.optimizer.step_count, trainer.step_index) == (0, 0)
        assert train(trainer, 2) == train(new, 2)
    finally:
        trainer.close()
        new.close()


@pytest.mark.parametrize("change", [{"model": {"layers": 3}}, {"optimizer": {"lr": 0.02}}, {"parallelism": {"tp": 2}}])
def test_a_kept_trainer_that_does_not_fit_the_next_incarnation_is_freed_not_reused(change):
    cfg = job()
    trainer = Trainer(cfg, single_device_context())
    kept = KeptTrainer()
    kept.keep(trainer)
    other = from_dict({section: {**cfg.to_dict()[section], **values} for section, values in
                       {**cfg.to_dict(), **change}.items() if isinstance(values, dict)})
    ctx = single_device_context()
    if other.parallelism.tp == 2:  # another layout: a context of another shape
        ctx = dataclasses.replace(ctx, layout=layout_of(other))
    assert kept.take(other, ctx) is None
    assert trainer.optimizer.gradients._hooks == []  # closed: unhooked, its memory free to go
    assert kept.take(cfg, single_device_context()) is None  # taken once


def _incarnations(ctx, cfg, run_dir: str) -> dict:
    """Incarnations 1, 2 and 3 fail part-way through steps 4, 5 and 6 on every rank (as a leave order would end
    them); each next one restores the step before into the kept trainer; incarnation 4 trains to the end."""
    rank = ctx.rank
    shutdown_rank(ctx)  # run_ranks's own group: each incarnation joins its own rendezvous
    kept, weights, held = KeptTrainer(), [], []
    original = DistributedOptimizer.grad_norm

    for incarnation in range(1, INCARNATIONS + 1):
        def fail_part_way(self, failing_step=3 + incarnation):
            if incarnation < INCARNATIONS and self.step_count == failing_step - 1:
                raise RuntimeError(f"incarnation {incarnation} ends part-way")
            return original(self)

        DistributedOptimizer.grad_norm = fail_part_way
        ctx = init_rank(layout_of(cfg), rank, f"file://{run_dir}/rendezvous-{incarnation}", cfg.comm,
                        backend="gloo", threads=1, sequence_parallel=cfg.parallelism.sequence_parallel)
        try:
            train_rank(ctx, cfg, run_dir, kept=kept)
        except RuntimeError as e:
            assert incarnation < INCARNATIONS, e
        finally:
            shutdown_rank(ctx)
        release()
        held.append(threads_and_fds())
        if kept._trainer is not None:
            weights.append(kept._trainer.optimizer.param_buffer.data_ptr())
    DistributedOptimizer.grad_norm = original
    if rank == 0:
        shutdown_keeper(cfg.checkpoint.uri)  # it would serve this machine's ranks as long as pytest runs
    log = (Path(run_dir) / f"rank-{rank}.log").read_text()
    return {"weights": weights, "kept": log.count("kept from the last incarnation"), "held": held}


def _uninterrupted(ctx, cfg, run_dir: str) -> None:
    train_rank(ctx, cfg, run_dir)
    if ctx.rank == 0:
        shutdown_keeper(cfg.checkpoint.uri)


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.parametrize("parallelism", [{"dp": 2}, {"tp": 2, "sequence_parallel": True}], ids=["dp2", "tp2-sp"])
def test_two_ranks_restart_in_process_on_their_kept_models_with_the_uninterrupted_losses_leaking_nothing(
        parallelism, tmp_path):
    def cfg_in(run_dir: Path):
        run_dir.mkdir()
        return from_dict({**job(parallelism=parallelism).to_dict(),
                          "checkpoint": {"uri": f"file://{run_dir}/checkpoints", "every": 1, "resume": True},
                          "logging": {"tensorboard": False}})

    reference, restarted = tmp_path / "reference", tmp_path / "restarted"
    cfg = cfg_in(reference)
    run_ranks(_uninterrupted, layout_of(cfg), cfg, str(reference), backend="gloo",
              sequence_parallel=cfg.parallelism.sequence_parallel)
    cfg = cfg_in(restarted)
    results = run_ranks(_incarnations, layout_of(cfg), cfg, str(restarted), backend="gloo")
    for rank, result in enumerate(results):
        assert result["kept"] == INCARNATIONS - 1, f"rank {rank} built a new model"
        weights = result["weights"]  # kept after every incarnation but the last (it finished: closed)
        assert weights == [weights[0]] * (INCARNATIONS - 1), f"rank {rank}: the kept weights moved"
        # Nothing more per incarnation from the second on. (A rank then holds 7 threads, as it does from the first
        # on when nothing is kept: the first incarnation that restores leaves one gloo group's 3 threads alive.)
        held = result["held"][1:]
        threads = [n for n, _ in held]
        assert threads == [threads[0]] * len(held), f"rank {rank}: threads after each incarnation {threads}"
        (_, fds_first), (_, fds_last) = held[0], held[-1]
        assert not Counter(fds_last) - Counter(fds_first), f"rank {rank}: descriptors kept"
    expected, got = losses(reference), losses(restarted)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(expected[step], rel=1e-6), step
