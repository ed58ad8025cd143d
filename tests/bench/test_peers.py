"""`megascale bench peers`: megascale's weights mapped into torch-native's module and megatron-core's GPTModel
give megascale's step-0 loss (the oracle: the other tools' own code computing the same function); the report has
every key, and a `why` for each cell that cannot run or computes other math."""
import argparse
import dataclasses
import os
import sys

import pytest
import torch

from megascale.bench import peers
from megascale.common import netemu
from megascale.launch import run_ranks
from megascale.model.gpt import GPT
from megascale.parallel.topology import Layout, single_device_context


def tiny_job():
    cfg = peers.peer_job({}, quick=True)
    model = dataclasses.replace(cfg.model, layers=2, hidden=64, ffn=256, vocab=128, seq=16)
    return dataclasses.replace(cfg, model=model, batch=dataclasses.replace(cfg.batch, micro=2, global_=4))


def megascale_step0_loss(cfg) -> float:
    tokens, labels = peers.source_of(cfg, single_device_context()).next_batch()
    with torch.no_grad():
        return float(GPT(cfg.model)(tokens, labels))


def test_torch_native_mapping_gives_megascale_step0_loss():
    from megascale.bench.peers_torch import train_torch_native

    cfg = tiny_job()
    result = train_torch_native(single_device_context(), cfg, steps=1)
    assert result["losses"][0] == pytest.approx(megascale_step0_loss(cfg), abs=1e-5)


def test_megatron_mapping_gives_megascale_step0_loss():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[peers]')")
    from megascale.bench.peers_megatron import train_megatron

    cfg = tiny_job()
    # A rank process of its own: the CPU shim patches torch.cuda, which this test process must keep.
    (result,) = run_ranks(train_megatron, Layout(), cfg, 1, backend="gloo")
    assert result["losses"][0] == pytest.approx(megascale_step0_loss(cfg), abs=1e-5)


def test_report_says_why_when_megatron_is_missing_or_math_differs(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "megatron", None)  # `import megatron.core` raises ImportError
    monkeypatch.setattr(peers, "CONFIGS", {"1rank": {}, "dp2": {"dp": 2}})

    monkeypatch.setattr(peers, "emulated", lambda *a, **k: {"not_run": "stubbed"})

    def fake_measure(impl, cfg, steps, place=None):
        if impl == "torch_native" and cfg.parallelism.dp == 2:
            return {"tokens_per_s": 50.0, "step0_loss": 7.0 + 2 * peers.STEP0_TOLERANCE}  # another function
        if impl == "megascale" and cfg.parallelism.zero == 2:
            return {"tokens_per_s": 90.0, "step0_loss": 7.0}
        return {"tokens_per_s": 100.0 if impl == "megascale" else 80.0, "step0_loss": 7.0}

    monkeypatch.setattr(peers, "measure", fake_measure)
    report = peers.run(argparse.Namespace(quick=True, link_gbit=2.0))
    assert "pip install -e '.[peers]'" in capsys.readouterr().err
    for key in ("tokens_per_s", "speedup_vs_torch_native", "speedup_vs_megatron_core", "step0_loss", "why"):
        assert key in report
    assert report["tokens_per_s"]["megatron_core"] == {"1rank": None, "dp2": None}
    assert set(report["why"]["megatron_core"]) == {"1rank", "dp2"}
    assert "'.[peers]'" in report["why"]["megatron_core"]["dp2"]
    assert report["speedup_vs_megatron_core"] == {"1rank": None, "dp2": None}
    assert report["speedup_vs_torch_native"]["1rank"] == pytest.approx(1.25)
    # The torch-native dp2 cell computed other math: no speed, a reason, its loss kept for the reader.
    assert report["tokens_per_s"]["torch_native"]["dp2"] is None
    assert report["speedup_vs_torch_native"]["dp2"] is None
    assert "invalid" in report["why"]["torch_native"]["dp2"]
    assert "1rank" not in report["why"]["torch_native"]
    # megascale runs ZeRO-1 as megatron-core's distributed optimizer does; ZeRO-2 only beside it, where there is DP.
    assert report["megascale_zero"] == 1
    assert report["megascale_zero2_tokens_per_s"] == {"dp2": 90.0}
    assert report["zero2_vs_zero1"] == {"dp2": pytest.approx(0.9)}


def test_emulated_section_runs_each_peer_on_the_two_node_network_and_judges_the_goal(monkeypatch):
    try:
        netemu.require_net_admin()
    except netemu.NetworkError as e:
        pytest.skip(str(e))
    placed = []

    def fake_measure(impl, cfg, steps, place=None):
        placed.append((impl, place is not None, sorted(os.listdir("/run/netns"))))
        return {"tokens_per_s": {"megascale": 130.0, "torch_native": 60.0, "megatron_core": 100.0}[impl],
                "step0_loss": 7.0}

    monkeypatch.setattr(peers, "measure", fake_measure)
    before = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    report = peers.emulated(quick=True, steps=2, rounds=1, missing=False)
    assert [impl for impl, _, _ in placed] == list(peers.IMPLS)
    nodes = {netemu.JobNetwork(f"bench-peers-{os.getpid()}").namespace(n) for n in ("n0", "n1")}
    assert all(on_node and nodes <= set(spaces) for _, on_node, spaces in placed)
    assert report["speedup_vs_megatron_core"] == pytest.approx(1.3) and report["goal"]["met"] is True
    assert report["tokens_per_s"]["torch_native"] == 60.0 and report["why"] == {}
    assert set(os.listdir("/run/netns")) == before  # the nodes' namespaces are gone
    missing = peers.emulated(quick=True, steps=2, rounds=1, missing=True)
    assert missing["goal"]["met"] is False and "'.[peers]'" in missing["why"]["megatron_core"]


def test_emulated_section_without_root_says_why_in_one_line(monkeypatch):
    monkeypatch.setattr(netemu, "has_net_admin", lambda: False)
    assert peers.emulated(quick=True, steps=1, rounds=1, missing=True) == {
        "not_run": "cluster.network: emulated needs root (CAP_NET_ADMIN)"}
