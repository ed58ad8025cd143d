"""N ranks vs 1 rank: same initial weights and data, several optimizer steps.

Tolerances: per-step loss and grad norm within 1e-5 relative, final weights within 1e-4 absolute.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megascale.config import from_dict
from megascale.launch import run_ranks
from megascale.train import layout_of
from megascale.model.gpt import GPT
from megascale.parallel.state import full_stage_parameters
from megascale.parallel.topology import single_device_context
from megascale.train import Trainer

STEPS = 3


def job(parallelism: dict, block: str = "serial", window=None, optimizer: str = "lamb", tied: bool = False,
        global_batch: int = 8, micro: int = 1, layers: int = 4, overlap: bool | None = None):
    if overlap is not None:  # every overlap switch on, or every one off
        parallelism = {**parallelism, "overlap": {"tp": overlap, "pp": overlap, "dp": overlap}}
    return from_dict({
        "model": {"layers": layers, "hidden": 64, "heads": 4, "ffn": 128, "vocab": 128, "seq": 32, "block": block,
                  "window": window, "tied_embeddings": tied},
        "parallelism": parallelism,
        "batch": {"micro": micro, "global": global_batch},
        "optimizer": {"name": optimizer, "lr": 0.01, "schedule": {"kind": "constant"}},
        "train": {"steps": STEPS},
    })


def _train(ctx, cfg):
    trainer = Trainer(cfg, ctx)
    stats = [trainer.step() for _ in range(STEPS)]
    trainer.finish()
    params = full_stage_parameters(trainer.chunks, ctx)
    return {"loss": [s.loss for s in stats], "grad_norm": [s.grad_norm for s in stats], "params": params}


def single_rank(cfg):
    one = dataclasses.replace(cfg, parallelism=dataclasses.replace(
        cfg.parallelism, tp=1, pp=1, dp=1, vpp=1, sequence_parallel=False))
    return _train(single_device_context(), one)


def assert_parity(cfg):
    expected = single_rank(cfg)
    results = run_ranks(_train, layout_of(cfg), cfg, sequence_parallel=cfg.parallelism.sequence_parallel)
    for rank, got in enumerate(results):
        torch.testing.assert_close(got["loss"], expected["loss"], rtol=1e-5, atol=0, msg=f"rank {rank} loss")
        torch.testing.assert_close(got["grad_norm"], expected["grad_norm"], rtol=1e-5, atol=1e-7,
                                   msg=f"rank {rank} grad norm")
        for name, value in got["params"].items():
            reference = expected["params"].get(name, expected["params"].get("wte.weight"))  # tied copy
            torch.testing.assert_close(value, reference, rtol=0, atol=1e-4, msg=f"rank {rank} {name}")
    # Every parameter of the 1-rank model lives on some stage.
    seen = set().union(*(r["params"] for r in results))
    assert set(expected["params"]) <= seen
    # Training moved the weights: the comparison above is not of untouched initial values.
    assert expected["loss"][0] != expected["loss"][-1]


CASES = {
    "tp2": ({"tp": 2}, {}),
    "tp2_sp_ptb_window": ({"tp": 2, "sequence_parallel": True}, {"block": "parallel", "window": 8}),
    "tp2_tied_adamw": ({"tp": 2}, {"tied": True, "optimizer": "adamw"}),
    "pp2": ({"pp": 2}, {"global_batch": 4}),
    "pp2_vpp2_ptb": ({"pp": 2, "vpp": 2}, {"block": "parallel", "global_batch": 4}),
    "pp4_vpp1_tied": ({"pp": 4}, {"tied": True, "global_batch": 8}),
    "dp2_window_adamw": ({"dp": 2}, {"window": 8, "optimizer": "adamw"}),
    "dp4_ptb": ({"dp": 4}, {"block": "parallel"}),
    "tp2_sp_pp2_overlap_on": ({"tp": 2, "pp": 2, "sequence_parallel": True}, {"micro": 2, "overlap": True}),
    "tp2_sp_dp2_overlap_off": ({"tp": 2, "dp": 2, "sequence_parallel": True}, {"micro": 2, "overlap": False}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_single_rank(name):
    parallelism, model = CASES[name]
    assert_parity(job(parallelism, **model))


@pytest.mark.slow
def test_parity_pp4_vpp2():
    assert_parity(job({"pp": 4, "vpp": 2}, window=16, global_batch=8, tied=True, layers=8))


@pytest.mark.slow
def test_parity_eight_ranks_tp2_pp2_dp2_vpp2_sp():
    for overlap in (True, False):
        assert_parity(job({"tp": 2, "pp": 2, "dp": 2, "vpp": 2, "sequence_parallel": True},
                          block="parallel", window=16, global_batch=8, overlap=overlap))


@pytest.mark.slow
def test_parity_eight_ranks_serial_blocks_all_overlap_on():
    assert_parity(job({"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True}, global_batch=8, micro=2, overlap=True))


def _initial_parameters(ctx, cfg):
    materialized = []
    eager_value = GPT.init_value

    def recorded(model, name, shape):
        materialized.append(name)
        return eager_value(model, name, shape)

    GPT.init_value = recorded  # this rank process only
    trainer = Trainer(cfg, ctx)
    return {"params": full_stage_parameters(trainer.chunks, ctx), "materialized": materialized,
            "layers": [int(i) for chunk in trainer.chunks for i in chunk.blocks]}


def test_meta_init_materialises_only_the_stage_and_matches_an_eager_model():
    """Trainer builds the GPT on the meta device: each rank creates only its stage's parameters,
    and those (TP slices gathered) equal a GPT initialised whole on one device, bit for bit."""
    cfg = job({"tp": 2, "pp": 2}, tied=True)
    eager = {name: p.detach() for name, p in GPT(cfg.model).named_parameters()}
    results = run_ranks(_initial_parameters, layout_of(cfg), cfg)
    for rank, got in enumerate(results):
        for name, value in got["params"].items():
            torch.testing.assert_close(value, eager.get(name, eager["wte.weight"]), rtol=0, atol=0,
                                       msg=f"rank {rank} {name}")
        blocks = {int(name.split(".")[1]) for name in got["materialized"] if name.startswith("blocks.")}
        assert blocks == set(got["layers"]) and len(blocks) == 2, (rank, blocks)
        assert len(got["materialized"]) == len(set(got["materialized"])), "a parameter materialised twice"
