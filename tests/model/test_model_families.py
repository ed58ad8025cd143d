"""`model.arch` and grouped-query attention: what a config may ask for, and what the model builds."""
from __future__ import annotations

import pytest
import torch

from megascale.config import ConfigError, ModelConfig, from_dict
from megascale.kernels import RMSNorm
from megascale.model.gpt import GPT, MLP, SwiGLU


def _config(model: dict, parallelism: dict | None = None):
    return from_dict({"model": {"hidden": 64, "heads": 8, **model}, "parallelism": parallelism or {}})


@pytest.mark.parametrize("model, parallelism, message", [
    ({"arch": "llama", "kv_heads": 2}, {"tp": 4}, "parallelism.tp=4 does not divide model.kv_heads=2"),
    ({"arch": "llama", "kv_heads": 3}, {}, "model.kv_heads=3 does not divide model.heads=8"),
    ({"arch": "llama", "kv_heads": 0}, {}, "model.kv_heads=0: must be > 0"),
    ({"arch": "mamba"}, {}, "model.arch='mamba': must be one of gpt, llama"),
    ({"arch": "llama", "norm_eps": 0}, {}, "model.norm_eps=0.0: must be > 0"),
])
def test_model_config_refusals_are_one_line_naming_the_fields(model, parallelism, message):
    with pytest.raises(ConfigError) as error:
        _config(model, parallelism)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_kv_heads_split_over_tp_when_tp_divides_them():
    cfg = _config({"arch": "llama", "kv_heads": 2}, {"tp": 2})
    assert (cfg.model.num_kv_heads, cfg.model.tied_embeddings) == (2, False)
    assert _config({}).model.num_kv_heads == 8  # unset: one k/v head per query head


def test_gpt_is_unchanged_by_default_and_llama_swaps_norm_and_mlp():
    gpt, llama = GPT(ModelConfig()), GPT(ModelConfig(arch="llama", kv_heads=2))
    assert ModelConfig().arch == "gpt"
    assert isinstance(gpt.blocks["0"].ln_1, torch.nn.LayerNorm) and type(gpt.blocks["0"].mlp) is MLP
    assert isinstance(llama.blocks["0"].ln_1, RMSNorm) and type(llama.blocks["0"].mlp) is SwiGLU
    assert not [name for name, p in llama.named_parameters() if name.endswith("bias")]
    assert llama.lm_head.weight is not llama.wte.weight  # untied
    assert llama.blocks["0"].attn.qkv.sections == (128, 64, 64)  # q, then k and v with half the heads


@pytest.mark.parametrize("arch, kv_heads", [("gpt", None), ("llama", 2)])
def test_flops_per_token_count_every_weight_matrix(arch, kv_heads):
    cfg = ModelConfig(arch=arch, kv_heads=kv_heads)
    model = GPT(cfg)
    matrices = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and name != "wte.weight")
    attention = 2 * 2 * cfg.layers * cfg.hidden * cfg.seq  # QK^T and AV
    assert model.num_flops_per_token() == 3 * (2 * matrices + attention)
