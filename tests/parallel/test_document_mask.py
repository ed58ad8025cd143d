"""data.document_mask: attention stays inside the documents packed into a sequence.

Checked against a dense masked reference (the model's attention swapped for softmax(q·k) over the
block-diagonal causal mask, written out here), against each document run on its own, through the
real loader and Trainer, and N ranks vs 1 rank (parity_support.py): tp2+SP, pp3."""
from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

import megascale.model.gpt as gpt_module
from megascale.config import ConfigError, from_dict
from megascale.data.prepare import prepare
from megascale.model.gpt import GPT
from megascale.parallel.topology import single_device_context
from megascale.train import Trainer
from parity_support import assert_parity, job

SEQ = 32
# Row 0 holds three documents, row 1 the end of one and two more.
DOCUMENT_IDS = torch.tensor([[0] * 9 + [1] * 15 + [2] * 8, [2] * 13 + [3] * 3 + [4] * 16])
FIRST_BOUNDARY = [9, 13]


def model_config(arch: str, window):
    return from_dict({"model": {"arch": arch, "layers": 2, "hidden": 32, "heads": 4,
                                "kv_heads": 2 if arch == "llama" else None, "ffn": 64, "vocab": 64, "seq": SEQ,
                                "window": window}}).model


def dense_masked_attention(document_ids):
    """Attention as a reference would write it: softmax(q·k/sqrt(d)) v, block-diagonal causal mask."""

    def attend(q, k, v, window, documents):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        i = torch.arange(q.shape[-2])
        allowed = (i[:, None] >= i[None, :]) & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
        if window is not None:
            allowed &= i[:, None] - i[None, :] < window
        return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v

    return attend


def tokens_and_labels(vocab: int, document_ids: torch.Tensor):
    tokens = torch.randint(0, vocab, document_ids.shape, generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100
    labels[:, :-1][document_ids[:, 1:] != document_ids[:, :-1]] = -100  # as the loader labels
    return tokens, labels


@pytest.mark.parametrize("arch, window", [("gpt", None), ("llama", None), ("llama", 6)])
def test_loss_and_logits_equal_the_dense_masked_reference(monkeypatch, arch, window):
    model = GPT(model_config(arch, window))
    tokens, labels = tokens_and_labels(64, DOCUMENT_IDS)
    logits = model(tokens, document_ids=DOCUMENT_IDS)
    loss = model(tokens, labels, document_ids=DOCUMENT_IDS)
    monkeypatch.setattr(gpt_module, "attention", dense_masked_attention(DOCUMENT_IDS))
    torch.testing.assert_close(logits, model(tokens), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, model(tokens, labels), atol=1e-6, rtol=1e-6)


def test_the_mask_changes_logits_exactly_after_each_rows_first_document_boundary():
    model = GPT(model_config("llama", None))
    tokens, labels = tokens_and_labels(64, DOCUMENT_IDS)
    masked, unmasked = model(tokens, document_ids=DOCUMENT_IDS), model(tokens)
    change = (masked - unmasked).abs().amax(dim=-1)  # [rows, seq]
    for row, boundary in enumerate(FIRST_BOUNDARY):
        assert change[row, :boundary].max() < 1e-6, f"row {row} changed before its first boundary"
        assert change[row, boundary:].min() > 1e-4, f"row {row}: a position after the boundary is unchanged"
    assert model(tokens, labels, document_ids=DOCUMENT_IDS) != model(tokens, labels)


def test_each_packed_document_reads_as_if_it_were_alone():
    # Rotary scores depend only on the distance between tokens, so a document's logits do not
    # depend on where in the row it was packed.
    model = GPT(model_config("gpt", None))
    tokens, _ = tokens_and_labels(64, DOCUMENT_IDS)
    packed = model(tokens, document_ids=DOCUMENT_IDS)
    for row in range(2):
        for doc in DOCUMENT_IDS[row].unique():
            where = (DOCUMENT_IDS[row] == doc).nonzero().flatten()
            alone = model(tokens[row:row + 1, where])
            torch.testing.assert_close(packed[row:row + 1, where], alone, atol=1e-5, rtol=1e-5)


def test_synthetic_data_with_a_document_mask_is_refused():
    with pytest.raises(ConfigError, match=r"^data.document_mask: needs data.source text or shards"):
        from_dict({"data": {"document_mask": True}})


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """~80 short byte-token documents, so every 32-token row holds a boundary or two."""
    rng, folder = random.Random(0), tmp_path_factory.mktemp("docs")
    words = ["alpha", "beta", "gamma", "delta", "pi", "rho", "mu"]
    for i in range(80):
        (folder / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(1, 6))))
    out = tmp_path_factory.mktemp("prepared") / "ds"
    prepare([folder], out)
    return out


def with_documents(cfg, dataset, run_dir, document_mask: bool = True):
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, vocab=258),  # byte tokens (257), divisible by tp=2
        data=dataclasses.replace(cfg.data, source="shards", path=str(dataset), document_mask=document_mask),
        train=dataclasses.replace(cfg.train, run_dir=str(run_dir)))


def test_trainer_loss_from_the_loader_equals_the_dense_masked_reference(dataset, tmp_path, monkeypatch):
    cfg = with_documents(job({}, arch="llama", kv_heads=2, global_batch=4, micro=2, layers=2), dataset, tmp_path)
    trainer = Trainer(cfg, single_device_context())
    try:
        start = trainer.source.state_dict()
        loss = trainer.step().loss  # before the update
        trainer.source.load_state_dict(start)
        batch = trainer.source.next_sample()  # the same rows again
    finally:
        trainer.close()
    assert (batch.document_ids[:, 1:] != batch.document_ids[:, :-1]).sum() >= 4  # documents do meet
    with monkeypatch.context() as patch:
        patch.setattr(gpt_module, "attention", dense_masked_attention(batch.document_ids))
        reference = GPT(cfg.model)(batch.input_ids, batch.labels)
    assert loss == pytest.approx(reference.item(), rel=1e-5)
    unmasked = Trainer(with_documents(cfg, dataset, tmp_path, document_mask=False), single_device_context())
    try:
        assert unmasked.step().loss != pytest.approx(loss, rel=1e-4)
    finally:
        unmasked.close()


@pytest.mark.parametrize("parallelism, model", [
    ({"tp": 2, "sequence_parallel": True}, {"micro": 2, "arch": "llama", "kv_heads": 2}),
    ({"pp": 3}, {"global_batch": 4, "window": 8, "layers": 3}),  # the middle stage reads no data
], ids=["tp2_sp_llama_gqa", "pp3_window"])
def test_document_mask_parity_with_single_rank(dataset, tmp_path, parallelism, model):
    assert_parity(with_documents(job(parallelism, **model), dataset, tmp_path))
