"""`megascale export --to hf`: a tiny model trained 3 steps here, its checkpoint exported, loads with
transformers' AutoModelForCausalLM and gives the logits of the trained megascale model within 1e-4,
for every arch x block x window with a transformers equivalent, from 1 rank and from tp2*pp2."""
from __future__ import annotations

import json

import pytest
import torch
from hf_support import ATOL, hf_logits, job, megascale_model, tokens, train_and_checkpoint

from megascale.cli import main
from megascale.model.gpt import GPT

CASES = {  # id: (model fields, parallelism, the class transformers loads)
    "llama": ({"arch": "llama", "kv_heads": 2}, {}, "LlamaForCausalLM"),
    "llama_window_tied": ({"arch": "llama", "kv_heads": 2, "window": 8, "tied_embeddings": True}, {},
                          "MistralForCausalLM"),
    "gpt": ({"arch": "gpt"}, {}, "GPTNeoXForCausalLM"),
    "gpt_ptb_tied_from_tp2_pp2": ({"arch": "gpt", "block": "parallel", "tied_embeddings": True},
                                  {"tp": 2, "pp": 2}, "GPTNeoXForCausalLM"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_exported_model_gives_the_trained_models_logits_in_transformers(case, tmp_path, capsys):
    model, parallelism, cls = CASES[case]
    cfg = job(str(tmp_path / "ckpt"), parallelism, **model)
    weights = train_and_checkpoint(cfg)
    out = tmp_path / "hf"
    assert main(["export", cfg.checkpoint.uri, "--to", "hf", str(out)]) == 0
    assert cls in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["architectures"] == [cls]
    ids = tokens(cfg)
    with torch.no_grad():
        expected = megascale_model(cfg, weights)(ids)
        untrained = GPT(cfg.model).eval()(ids)
    torch.testing.assert_close(hf_logits(out, ids), expected, rtol=0, atol=ATOL)
    assert not torch.allclose(untrained, expected, atol=ATOL)  # what was exported is the trained model


def test_export_shards_past_the_size_limit_with_an_index_transformers_reads(tmp_path):
    cfg = job(str(tmp_path / "ckpt"), steps=1, arch="llama")
    weights = train_and_checkpoint(cfg)
    out = tmp_path / "hf"
    assert main(["export", cfg.checkpoint.uri, "--to", "hf", str(out), "--max-shard-size", "40000"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    assert all((out / name).stat().st_size <= 40000 + 1000 for name in shards)  # + each file's header
    ids = tokens(cfg)
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(out, ids), megascale_model(cfg, weights)(ids), rtol=0, atol=ATOL)


def test_export_refuses_a_model_without_a_transformers_equivalent_in_one_line(tmp_path, capsys):
    cfg = job(str(tmp_path / "ckpt"), steps=1, arch="llama", block="parallel")
    train_and_checkpoint(cfg)
    assert main(["export", cfg.checkpoint.uri, "--to", "hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ConfigError: model.block=parallel: no transformers class") and "\n" not in err
    assert not (tmp_path / "hf").exists()
