"""N ranks vs 1 rank for the gpt arch (helpers and tolerances: parity_support.py)."""
from __future__ import annotations

import pytest
import torch

from megascale.launch import run_ranks
from megascale.model.gpt import GPT
from megascale.parallel.state import full_stage_parameters
from megascale.train import Trainer, layout_of
from parity_support import assert_parity, job


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
