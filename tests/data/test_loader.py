"""The node loader through real shared memory: coverage, TP/DP/PP roles, masking, resume, errors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from megascale.data import DataError
from megascale.data.dataset import Dataset


def step(ranks):
    return [r.next_sample() for r in ranks]


def test_one_epoch_covers_every_token_once_tp_identical_dp_disjoint(dataset, sources):
    tp, dp, seq = 2, 2, 16
    ranks = sources(dataset, tp=tp, dp=dp, seq=seq)
    ds = Dataset(dataset)
    per_step = dp * 4 * seq  # tokens per step: dp * rows * seq
    steps = ds.tokens // per_step + 2  # a little past one epoch
    seen = []  # (document id, position) of every input token, in global sample order
    for _ in range(steps):
        batches = step(ranks)
        for d in range(dp):
            a, b = batches[d * tp], batches[d * tp + 1]  # the two TP ranks of DP rank d
            for x, y in zip(a, b):
                assert torch.equal(x, y)
            seen += list(zip(a.document_ids.flatten().tolist(), a.position_ids.flatten().tolist()))
    epoch = [s for s in seen[: ds.tokens // seq * seq]]
    assert len(set(epoch)) == len(epoch)  # nothing duplicated, across DP ranks and steps
    assert all(doc < ds.documents for doc, _ in epoch)  # all from epoch 0 ...
    assert len(epoch) > ds.tokens - seq  # ... and only the last partial sequence missing
    assert any(doc >= ds.documents for doc, _ in seen)  # the stream ran on into epoch 1
    states = {json.dumps(r.state_dict()) for r in ranks}
    assert len(states) == 1 and json.loads(states.pop())["epoch"] == 1


def test_labels_and_masking_information(dataset, sources):
    (rank,) = sources(dataset, seq=64, micro=4, microbatches=1)
    eot = Dataset(dataset).eot_id
    for _ in range(5):
        b = rank.next_sample()
        assert b.input_ids.shape == b.labels.shape == b.position_ids.shape == (4, 64)
        assert b.input_ids.dtype == b.labels.dtype == torch.int64
        crosses = b.document_ids[:, 1:] != b.document_ids[:, :-1]
        assert torch.equal(b.labels[:, :-1] == -100, crosses)
        assert torch.all(b.input_ids[:, :-1][crosses] == eot)  # a document ends with end-of-text ...
        assert torch.all(b.position_ids[:, 1:][crosses] == 0)  # ... and the next one starts at 0
        assert torch.equal(b.labels[:, :-1][~crosses], b.input_ids[:, 1:][~crosses])


def test_pipeline_stages_and_nodes(dataset, sources):
    # tp=1 dp=2 pp=3, 3 ranks per node: node 0 = ranks 0,1 (stage 0) + 2 (middle), node 1 = 3 (middle) + 4,5 (last)
    ranks = sources(dataset, dp=2, pp=3, ranks_per_node=3)
    pids = {r.loader_pid for r in ranks if r.loader_pid}
    assert len(pids) == 2  # one loader per node
    for _ in range(3):
        b = step(ranks)
        assert b[2].input_ids.shape == b[3].input_ids.shape == (0, 16)  # middle stages copy nothing
        assert torch.equal(b[0].input_ids, b[4].input_ids) and torch.equal(b[1].labels, b[5].labels)
        assert not torch.equal(b[0].input_ids, b[1].input_ids)
    assert len({json.dumps(r.state_dict()) for r in ranks}) == 1


def test_resume_continues_with_the_next_sample(dataset, sources, tmp_path):
    run = sources(dataset, dp=2, run_dir=tmp_path / "a")
    saved, reference = None, []
    for i in range(8):
        reference.append(step(run))
        if i == 2:
            saved = run[0].state_dict()
    same_seed = sources(dataset, dp=2, run_dir=tmp_path / "b")
    assert all(torch.equal(x, y) for x, y in zip(step(same_seed)[1], reference[0][1]))  # deterministic
    other_seed = sources(dataset, dp=2, seed=8, run_dir=tmp_path / "c")
    assert not torch.equal(step(other_seed)[0].input_ids, reference[0][0].input_ids)

    resumed = sources(dataset, dp=2, run_dir=tmp_path / "d")
    for r in resumed:
        r.load_state_dict(json.loads(json.dumps(saved)))  # as a checkpoint round-trips it
    for i in range(3, 8):
        for got, want in zip(step(resumed), reference[i]):
            assert all(torch.equal(x, y) for x, y in zip(got, want))

    for r in run:  # rewinding a running loader works too
        r.load_state_dict(saved)
    assert all(torch.equal(x, y) for x, y in zip(step(run)[0], reference[3][0]))

    # Elastic: one DP rank with twice the rows continues the same global sample order.
    (single,) = sources(dataset, dp=1, microbatches=4, run_dir=tmp_path / "e")
    single.load_state_dict(saved)
    b = single.next_sample()
    assert torch.equal(b.input_ids, torch.cat([reference[3][0].input_ids, reference[3][1].input_ids]))


def test_text_source_prepares_once_into_run_dir(corpus, sources, tmp_path):
    ranks = sources(corpus, source="text", tp=2, run_dir=tmp_path / "run", vocab=512)
    a, b = step(ranks)
    assert torch.equal(a.input_ids, b.input_ids) and a.input_ids.max() < 257  # TP ranks, byte tokens
    cached = list((tmp_path / "run" / "data").glob("text-*/manifest.json"))
    assert len(cached) == 1
    again = sources(corpus, source="text", run_dir=tmp_path / "run", vocab=512)
    assert again[0].ds.root == cached[0].parent  # reused, not re-tokenized
    with pytest.raises(DataError, match="vocab_size=257 exceeds model.vocab=200"):
        sources(corpus, source="text", run_dir=tmp_path / "run", vocab=200)


def test_bad_data_errors(dataset, sources, tmp_path):
    with pytest.raises(DataError, match="a sequence needs 100001 tokens"):
        sources(dataset, seq=100_000)
    with pytest.raises(DataError, match="one global batch of 2048 sequences"):
        sources(dataset, dp=8, micro=16, microbatches=16, seq=16)
    with pytest.raises(DataError, match="no manifest"):
        sources(tmp_path / "missing")

    broken = tmp_path / "broken"
    shutil.copytree(dataset, broken)
    shard = broken / "shard-00000.arrow"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    ranks = sources(broken, tp=2, shuffle_window=100)  # one window: the first batch reads every shard
    for r in ranks:  # the loader finds it and every rank of the node gets the error
        with pytest.raises(DataError, match="shard-00000.arrow: corrupt shard: checksum"):
            r.next_batch()

    from types import SimpleNamespace

    from megascale.data import make_batch_source

    def rank(r: int, seed: int):
        cfg = SimpleNamespace(source="shards", path=str(dataset), seed=seed)
        return make_batch_source(cfg, seq=16, micro=1, microbatches=1, dp_rank=0, dp_size=1, tp_rank=r, tp_size=2,
                                 pp_rank=0, pp_size=1, global_rank=r, run_dir=tmp_path / "mixed")

    # TP peers must agree, or they would train on different data.
    with rank(0, seed=1), pytest.raises(DataError, match="rank 1 has a different data configuration"):
        rank(1, seed=2)

    (good,) = sources(dataset, run_dir=tmp_path / "ok")
    state = good.state_dict()
    with pytest.raises(DataError, match="manifest mismatch"):
        good.load_state_dict({**state, "dataset": "0123456789abcdef"})
    with pytest.raises(DataError, match="seq=32"):
        good.load_state_dict({**state, "seq": 32})
    with pytest.raises(DataError, match="not a megascale data loader state"):
        good.load_state_dict({})


def test_shuffle_is_pinned():
    # The sample order is part of every checkpoint's meaning: changing it breaks resume of old runs.
    from megascale.data.stream import permutation

    assert permutation(10, 7, 0, 0).tolist() == [1, 7, 6, 0, 4, 2, 8, 9, 3, 5]
    assert sorted(permutation(1000, 3, 1, 2).tolist()) == list(range(1000))
