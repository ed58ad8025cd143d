"""train.recompute: `selective` and `full` give the losses and gradients of `none` (within 1e-6), on
one device (both archs, serial and parallel blocks, sliding window, document mask, dropout) and
through the Trainer at tp2 with sequence parallelism (parallel block with chunked TP overlap; serial
block without, where the gathered norm output is freed and gathered again), and at pp2 vpp2.
Dropout is on throughout, so recomputation must draw the masks forward drew."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megascale.config import from_dict
from megascale.launch import run_ranks
from megascale.model.gpt import GPT
from megascale.parallel.recompute import apply_recompute, discarded_output_modules, recomputed_modules
from megascale.train import Trainer, layout_of
from parity_support import job

MODES = ("none", "selective", "full")
DOCUMENT_IDS = torch.tensor([[0] * 10 + [1] * 22, [1] * 5 + [2] * 27])


def one_device_run(model_fields: dict, mode: str, documents: bool) -> tuple[torch.Tensor, dict]:
    cfg = from_dict({"model": {"layers": 2, "hidden": 32, "heads": 4, "ffn": 64, "vocab": 64, "seq": 32,
                               "dropout": 0.2, **model_fields}}).model
    model = GPT(cfg)
    apply_recompute([model], mode)
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(7)  # the dropout masks
    loss = model(tokens, torch.roll(tokens, -1, 1), DOCUMENT_IDS if documents else None)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("model_fields, documents", [
    ({"arch": "gpt", "block": "serial", "window": 8}, True),
    ({"arch": "llama", "block": "parallel", "kv_heads": 2}, False),
])
def test_recompute_matches_none_on_one_device(model_fields, documents):
    loss, grads = one_device_run(model_fields, "none", documents)
    for mode in ("selective", "full"):
        got_loss, got_grads = one_device_run(model_fields, mode, documents)
        torch.testing.assert_close(got_loss, loss, rtol=0, atol=1e-6)
        assert got_grads.keys() == grads.keys()  # parameter names unchanged
        for name, grad in grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=1e-6, msg=f"{mode} {name}")
    # The masks were drawn: without dropout the loss differs.
    assert one_device_run({**model_fields, "dropout": 0.0}, "none", documents)[0] != loss


def test_recompute_targets_the_blocks_or_their_attention_cores_norms_and_activations():
    model = GPT(from_dict({"model": {"layers": 2, "hidden": 32, "heads": 4, "ffn": 64, "vocab": 64, "seq": 8}}).model)
    assert recomputed_modules([model], "full") == list(model.blocks.values())
    assert recomputed_modules([model], "selective") == [
        m for b in model.blocks.values() for m in (b.attn.core, b.ln_1, b.ln_2, b.mlp.act)]
    assert recomputed_modules([model], "none") == []


@pytest.mark.parametrize("model_fields", [{"arch": "gpt"}, {"arch": "llama", "block": "parallel"}])
def test_selective_frees_norm_and_activation_outputs_until_backward(model_fields):
    cfg = from_dict({"model": {"layers": 2, "hidden": 32, "heads": 4, "ffn": 64, "vocab": 64, "seq": 8,
                               **model_fields}}).model
    model = GPT(cfg)
    apply_recompute([model], "selective")
    outputs = []
    for block in model.blocks.values():
        for module in discarded_output_modules(block):
            module.register_forward_hook(lambda _m, _a, out: outputs.append(out))
    loss = model(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
    assert len(outputs) == 2 * len(discarded_output_modules(model.blocks["0"]))
    assert all(out.untyped_storage().nbytes() == 0 for out in outputs)  # what the GEMMs saved holds no bytes
    loss.backward()
    assert all(out.untyped_storage().nbytes() == out.numel() * 4 for out in outputs)  # rebuilt for backward
    with torch.no_grad():  # validation: nothing is freed
        outputs.clear()
        model(torch.randint(0, 64, (2, 8)))
        assert all(out.untyped_storage().nbytes() > 0 for out in outputs)


def _losses_and_grads(ctx, cfgs):
    """Each config trained two steps from the same seed: losses and the reduced gradient shard of each step."""
    out = []
    for cfg in cfgs:
        torch.manual_seed(11 + ctx.rank)
        trainer = Trainer(cfg, ctx)
        grads, sync = [], trainer.optimizer.finish_grad_sync

        def recorded(sync=sync, grads=grads, optimizer=trainer.optimizer):
            sync()
            grads.append(optimizer.grad_shard.clone())
        trainer.optimizer.finish_grad_sync = recorded
        losses = [trainer.step().loss for _ in range(2)]
        trainer.finish()
        trainer.close()
        out.append((losses, grads))
    return out


@pytest.mark.parametrize("parallelism, model", [
    ({"tp": 2, "sequence_parallel": True, "overlap": {"tp": True}}, {"block": "parallel", "window": 8}),
    ({"tp": 2, "sequence_parallel": True}, {"arch": "llama"}),
    ({"pp": 2, "vpp": 2}, {"arch": "llama", "global_batch": 4}),
])
def test_recompute_matches_none_under_tp_sp_and_interleaved_pp(parallelism, model):
    base = job(parallelism, **model)
    base = dataclasses.replace(base, model=dataclasses.replace(base.model, dropout=0.1))
    cfgs = [dataclasses.replace(base, train=dataclasses.replace(base.train, recompute=mode)) for mode in MODES]
    for rank, runs in enumerate(run_ranks(_losses_and_grads, layout_of(base), cfgs,
                                          sequence_parallel=base.parallelism.sequence_parallel)):
        (losses, grads), *others = runs
        for mode, (got_losses, got_grads) in zip(MODES[1:], others):
            torch.testing.assert_close(got_losses, losses, rtol=0, atol=1e-6, msg=f"rank {rank} {mode} loss")
            for step, (got, expected) in enumerate(zip(got_grads, grads)):
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-6, msg=f"rank {rank} {mode} step {step}")
