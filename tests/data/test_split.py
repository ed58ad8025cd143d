"""eval.split: held-out documents are chosen by document, training never reads them, validation reads only them."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from megascale.data import DataError, make_batch_source
from megascale.data.dataset import Dataset
from megascale.data.heldout import make_held_out_source
from megascale.data.prepare import prepare
from megascale.data.stream import Stream, held_out_documents

SPLIT = 0.2


def data_cfg(path) -> SimpleNamespace:
    return SimpleNamespace(source="shards", path=str(path), seed=7, prefetch=3, shuffle_window=3, tokenizer="byte")


def _epoch_documents(stream: Stream) -> tuple[set[int], np.ndarray, np.ndarray]:
    """(manifest numbers of the documents, tokens, document ids) of one epoch of `stream`."""
    tokens, docs, _ = stream.read(0, stream.epoch_tokens)
    return set((docs % stream.ds.documents).tolist()), tokens, docs


def test_training_and_validation_documents_are_disjoint_and_cover_the_dataset(dataset):
    ds = Dataset(dataset)
    train, train_tokens, train_docs = _epoch_documents(Stream(ds, 7, 3, holdout=SPLIT))
    held, held_tokens, _ = _epoch_documents(Stream(ds, 7, 3, holdout=SPLIT, read_held_out=True))
    assert not train & held
    assert train | held == set(range(ds.documents))
    assert len(held) == int(np.ceil(SPLIT * ds.documents))
    assert len(train_tokens) + len(held_tokens) == ds.tokens  # whole documents on each side
    # Each training document arrives whole and unchanged.
    lengths = ds.document_tokens()
    for d in list(train)[:5]:
        assert (train_docs == d).sum() == lengths[d]
    # The held-out set is the dataset's alone: another shuffle seed keeps it.
    assert _epoch_documents(Stream(ds, 99, 1, holdout=SPLIT, read_held_out=True))[0] == held
    assert set(np.flatnonzero(held_out_documents(ds.documents, SPLIT)).tolist()) == held


def test_the_node_loader_trains_on_the_stream_without_held_out_documents(dataset, tmp_path):
    cfg = data_cfg(dataset)
    held = held_out_documents(Dataset(dataset).documents, SPLIT)
    expected = Stream(Dataset(dataset), cfg.seed, cfg.shuffle_window, holdout=SPLIT)
    with make_batch_source(cfg, seq=16, micro=2, microbatches=2, dp_rank=0, dp_size=1, tp_rank=0, tp_size=1,
                           pp_rank=0, pp_size=1, global_rank=0, run_dir=tmp_path, holdout=SPLIT) as source:
        for step in range(8):
            batch = source.next_sample()
            tokens, _, _ = expected.read_sequences(step * 4, 4, 16)
            assert batch.input_ids.tolist() == tokens[:, :-1].tolist()
            assert not held[batch.document_ids.numpy() % len(held)].any()


def test_validation_batches_hold_only_held_out_documents_split_over_dp(dataset, tmp_path):
    held = held_out_documents(Dataset(dataset).documents, SPLIT)
    eval_cfg = SimpleNamespace(split=SPLIT, data=None)
    per_dp = [make_held_out_source(data_cfg(dataset), eval_cfg, seq=16, rows=2, dp_rank=d,
                                   dp_size=2, pp_rank=0, pp_size=1, run_dir=tmp_path) for d in range(2)]
    batches = [s.batch(i) for i in range(3) for s in per_dp]
    for b in batches:
        assert held[b.document_ids.numpy() % len(held)].all()
    rows = [tuple(r) for b in batches for r in b.input_ids.tolist()]
    assert len(set(rows)) == len(rows)  # DP ranks and batches read different sequences
    assert per_dp[0].batch(1).input_ids.tolist() == batches[2].input_ids.tolist()  # the same batches every time
    middle = make_held_out_source(data_cfg(dataset), eval_cfg, seq=16, rows=2, dp_rank=0,
                                  dp_size=1, pp_rank=1, pp_size=3, run_dir=tmp_path)
    assert middle.batch(0).input_ids.numel() == 0  # a middle pipeline stage reads no tokens


def test_a_split_that_leaves_either_side_empty_is_refused(dataset):
    with pytest.raises(DataError, match=r"eval.split=0.999: holds out 60 of the dataset's 60 documents"):
        Stream(Dataset(dataset), 7, 3, holdout=0.999)


def test_a_held_out_dataset_is_read_whole_and_must_share_the_tokenizer(dataset, corpus, tmp_path):
    other = tmp_path / "other"
    prepare([corpus / "doc000.txt", corpus / "doc001.txt", corpus / "doc002.txt"], other)
    eval_cfg = SimpleNamespace(split=0.0, data=str(other))
    source = make_held_out_source(data_cfg(dataset), eval_cfg, seq=16, rows=2, dp_rank=0, dp_size=1, pp_rank=0,
                                  pp_size=1, run_dir=tmp_path)
    expected, _, _ = Stream(Dataset(other), 7, 3).read_sequences(0, 2, 16)
    assert source.batch(0).input_ids.tolist() == expected[:, :-1].tolist()
    bpe = tmp_path / "bpe"
    prepare([corpus / "doc000.txt", corpus / "doc001.txt"], bpe, tokenizer="bpe", vocab=300)
    with pytest.raises(DataError, match=r"eval.data=.*bpe: prepared with another tokenizer than data.path="):
        make_held_out_source(data_cfg(dataset), SimpleNamespace(split=0.0, data=str(bpe)), seq=16, rows=2,
                             dp_rank=0, dp_size=1, pp_rank=0, pp_size=1, run_dir=tmp_path)


def test_a_checkpointed_position_does_not_resume_under_another_split(dataset, tmp_path):
    def source(holdout, run):
        return make_batch_source(data_cfg(dataset), seq=16, micro=2, microbatches=1, dp_rank=0, dp_size=1, tp_rank=0,
                                 tp_size=1, pp_rank=0, pp_size=1, global_rank=0, run_dir=tmp_path / run,
                                 holdout=holdout)
    with source(SPLIT, "a") as first:
        first.next_sample()
        state = first.state_dict()
    with source(0.0, "b") as other, pytest.raises(DataError, match=r"data state has eval.split=0.2, the job has "
                                                                    r"eval.split=0.0"):
        other.load_state_dict(state)
