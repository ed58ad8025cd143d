"""Our tensor/sequence-parallel layers against PyTorch's own TP (DTensor) on 2 gloo ranks.

The same single-device module is sharded once with our plan (`megascale.parallel.parallelize`
styles, vocab-parallel embedding / cross-entropy) and once with
`torch.distributed.tensor.parallel`; both get the same input and output gradient.
Outputs, input gradients and full (unsharded) weight gradients must agree within
1e-5 absolute (fp32, tiny shapes). All cases run in one 2-rank job (a module fixture),
so the file costs one fork + process-group start.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megascale.config import ModelConfig
from megascale.launch import run_ranks
from megascale.model.gpt import MLP
from megascale.parallel.parallelize import SERIAL_BLOCK_PLAN
from megascale.parallel.tensor_parallel import (
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    shard_out_features,
    unshard,
)
from megascale.parallel.topology import Layout

TP = 2
ATOL = 1e-5
BATCH, SEQ, HIDDEN, FFN, VOCAB = 2, 8, 16, 32, 24


def _gather(t: torch.Tensor, ctx) -> list[torch.Tensor]:
    shards = [torch.empty_like(t) for _ in range(ctx.tp.size)]
    dist.all_gather(shards, t.contiguous(), group=ctx.tp.pg)
    return shards


def _waited(t: torch.Tensor) -> torch.Tensor:
    """A plain copy of a DTensor-side result: its local outputs are AsyncCollectiveTensors,
    which `detach()` alone does not wait on (torch.save would store unfilled memory)."""
    return t.detach().clone()


def _mlp_case(ctx, mesh, sequence_parallel: bool, overlap_chunks: int = 0) -> dict:
    """One `SerialBlock.mlp` (fc -> tanh-GeLU -> proj, no bias) through our plan and through DTensor."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    reference = MLP(ModelConfig(hidden=HIDDEN, ffn=FFN))
    x_full = torch.randn(BATCH, SEQ, HIDDEN)
    grad_full = torch.randn(BATCH, SEQ, HIDDEN)
    if sequence_parallel:  # activations [batch, seq, hidden] sharded along seq
        x_in = x_full.chunk(TP, dim=1)[ctx.tp.rank]
        grad_out = grad_full.chunk(TP, dim=1)[ctx.tp.rank]
    else:
        x_in, grad_out = x_full, grad_full

    ours = MLP(ModelConfig(hidden=HIDDEN, ffn=FFN))
    ours.load_state_dict(reference.state_dict())
    plan_ctx = dataclasses.replace(ctx, sequence_parallel=sequence_parallel)  # the styles read ctx's flag
    ours.fc = SERIAL_BLOCK_PLAN["mlp.fc"](ours.fc, plan_ctx, overlap_chunks)
    ours.proj = SERIAL_BLOCK_PLAN["mlp.proj"](ours.proj, plan_ctx, overlap_chunks)
    x_ours = x_in.clone().requires_grad_()
    y_ours = ours(x_ours)
    y_ours.backward(grad_out)

    theirs = MLP(ModelConfig(hidden=HIDDEN, ffn=FFN))
    theirs.load_state_dict(reference.state_dict())
    if sequence_parallel:
        plan = {"fc": ColwiseParallel(input_layouts=Shard(1)), "proj": RowwiseParallel(output_layouts=Shard(1))}
    else:
        plan = {"fc": ColwiseParallel(), "proj": RowwiseParallel()}
    parallelize_module(theirs, mesh, plan)
    x_theirs = x_in.clone().requires_grad_()
    y_theirs = theirs(x_theirs)
    y_theirs.backward(grad_out)

    return {
        "y": (y_ours.detach(), _waited(y_theirs)),
        "x_grad": (x_ours.grad, _waited(x_theirs.grad)),
        "fc_grad": (unshard(_gather(ours.fc.weight.grad, ctx), dim=0), theirs.fc.weight.grad.full_tensor()),
        "proj_grad": (unshard(_gather(ours.proj.weight.grad, ctx), dim=1), theirs.proj.weight.grad.full_tensor()),
    }


def _cross_entropy_case(ctx, mesh) -> dict:
    """Vocab-sharded logits [batch, seq, vocab/tp]; some labels are -100 (ignored)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    torch.manual_seed(1)
    logits = torch.randn(BATCH, SEQ, VOCAB) * 3
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels[0, :3] = -100
    labels[1, -1] = -100
    vocab_local = VOCAB // TP
    vocab_start = ctx.tp.rank * vocab_local

    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(full.flatten(0, 1), labels.flatten(), ignore_index=-100)
    expected.backward()
    expected_grad = full.grad[..., vocab_start:vocab_start + vocab_local]

    local = logits[..., vocab_start:vocab_start + vocab_local].clone().requires_grad_()
    loss = VocabParallelCrossEntropy(ctx.tp, vocab_start)(local, labels)
    loss.backward()

    # DTensor's loss_parallel as a second oracle on the same shards.
    dt_local = logits[..., vocab_start:vocab_start + vocab_local].clone().requires_grad_()
    with loss_parallel():
        dt = DTensor.from_local(dt_local, mesh, [Shard(2)])
        dt_loss = F.cross_entropy(dt.flatten(0, 1), labels.flatten(), ignore_index=-100)
        dt_loss.backward()
    return {
        "loss": (loss.detach(), expected.detach(), dt_loss.full_tensor().detach()),
        "grad": (local.grad, expected_grad, _waited(dt_local.grad)),
    }


def _embedding_case(ctx, sequence_parallel: bool) -> dict:
    torch.manual_seed(2)
    reference = nn.Embedding(VOCAB, HIDDEN)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    tokens[0, 0], tokens[0, 1] = 0, VOCAB - 1  # both ends of the vocabulary
    grad_full = torch.randn(BATCH, SEQ, HIDDEN)
    y_ref = reference(tokens)
    y_ref.backward(grad_full)

    ours = VocabParallelEmbedding(shard_out_features(reference.weight.detach(), ctx.tp), ctx.tp, sequence_parallel)
    y = ours(tokens)
    grad_out = grad_full.chunk(TP, dim=1)[ctx.tp.rank] if sequence_parallel else grad_full
    y.backward(grad_out)
    y_expected = y_ref.detach().chunk(TP, dim=1)[ctx.tp.rank] if sequence_parallel else y_ref.detach()
    return {
        "y": (y.detach(), y_expected),
        "weight_grad": (unshard(_gather(ours.weight.grad, ctx), dim=0), reference.weight.grad),
    }


def _all_cases(ctx) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (TP,))  # over run_ranks' default (gloo) process group
    return {
        "mlp_tp": _mlp_case(ctx, mesh, sequence_parallel=False),
        "mlp_sp": _mlp_case(ctx, mesh, sequence_parallel=True),
        "mlp_sp_overlap": _mlp_case(ctx, mesh, sequence_parallel=True, overlap_chunks=2),
        "cross_entropy": _cross_entropy_case(ctx, mesh),
        "embedding_tp": _embedding_case(ctx, sequence_parallel=False),
        "embedding_sp": _embedding_case(ctx, sequence_parallel=True),
    }


@pytest.fixture(scope="module")
def results():
    # Each case sets sequence parallelism itself, so one job covers TP and SP.
    return run_ranks(_all_cases, Layout(tp=TP))


def _assert_pairs(results, case: str):
    for rank, r in enumerate(results):
        for key, (ours, *oracles) in r[case].items():
            for oracle in oracles:
                torch.testing.assert_close(ours, oracle, rtol=0, atol=ATOL, msg=f"rank {rank} {case} {key}")


def test_column_row_parallel_mlp_matches_dtensor_colwise_rowwise(results):
    _assert_pairs(results, "mlp_tp")


def test_sequence_parallel_mlp_matches_dtensor_with_seq_sharded_input_and_output(results):
    _assert_pairs(results, "mlp_sp")
    # Each rank holds a different sequence slice (the comparison is not of identical copies).
    assert not torch.equal(results[0]["mlp_sp"]["y"][0], results[1]["mlp_sp"]["y"][0])


def test_sequence_parallel_mlp_with_pipelined_gather_and_reduce_scatter_matches_dtensor(results):
    _assert_pairs(results, "mlp_sp_overlap")


def test_vocab_parallel_cross_entropy_matches_full_logits_cross_entropy_with_ignored_labels(results):
    _assert_pairs(results, "cross_entropy")


def test_vocab_parallel_embedding_matches_nn_embedding(results):
    _assert_pairs(results, "embedding_tp")


def test_vocab_parallel_embedding_under_sequence_parallel_returns_this_ranks_sequence_slice(results):
    _assert_pairs(results, "embedding_sp")
