"""The llama arch against transformers: a tiny megascale model's weights copied into
LlamaForCausalLM (full causal) or MistralForCausalLM (sliding window) give the same logits
within 1e-4 (fp32, 1 rank), and a llama parallel block (PTB) equals x + LlamaAttention(n(x)) +
LlamaMLP(n(x)) with one shared LlamaRMSNorm n. Norm weights are randomised so their placement counts."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megascale.config import ModelConfig
from megascale.interop.hf import to_hf, to_hf_config
from megascale.model.gpt import GPT

transformers = pytest.importorskip("transformers")
llama_modules = pytest.importorskip("transformers.models.llama.modeling_llama")

ATOL = 1e-4


def _tiny(**overrides) -> ModelConfig:
    return ModelConfig(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=128, seq=32,
                       rotary_base=5000.0, norm_eps=1e-6, init_std=0.1, seed=7, **overrides)


def _megascale_model(cfg: ModelConfig) -> GPT:
    model = GPT(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
    return model


def _hf_config(cfg: ModelConfig, attn_implementation: str = "eager"):
    """transformers' config object for megascale.interop's config.json of `cfg`."""
    config = to_hf_config(cfg)
    return transformers.AutoConfig.for_model(config.pop("model_type"), attn_implementation=attn_implementation,
                                             **config)


def _hf_state_dict(cfg: ModelConfig, model: GPT) -> dict[str, torch.Tensor]:
    """The megascale weights under transformers' names, by megascale.interop's mapping."""
    return to_hf(cfg, model.state_dict())


@pytest.mark.parametrize("window", [None, 5], ids=["llama", "mistral_window"])
def test_llama_logits_equal_transformers_with_the_same_weights(window):
    cfg = _tiny(window=window)
    ours = _megascale_model(cfg)
    config = _hf_config(cfg)
    theirs = (transformers.LlamaForCausalLM if window is None else transformers.MistralForCausalLM)(config).eval()
    missing, unexpected = theirs.load_state_dict(_hf_state_dict(cfg, ours), strict=False)
    assert not unexpected and all("rotary" in name for name in missing), (missing, unexpected)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(input_ids=tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)
    if window is not None:  # the window changes the logits: not full causal compared twice
        with torch.no_grad():
            assert not torch.allclose(_megascale_model(_tiny())(tokens), got, atol=ATOL)


def test_llama_parallel_block_is_x_plus_llama_attention_and_mlp_of_one_shared_rmsnorm():
    cfg = _tiny(block="parallel")
    block = _megascale_model(cfg).blocks["0"]
    # transformers has no llama PTB: its weights are named through a serial twin whose two norms are the PTB's one.
    serial_cfg = dataclasses.replace(cfg, block="serial")
    twin = GPT(serial_cfg)
    linears = {f"blocks.0.{name}": t for name, t in block.state_dict().items() if not name.startswith("ln.")}
    norms = {f"blocks.0.{name}.weight": block.ln.weight for name in ("ln_1", "ln_2")}
    twin.load_state_dict({**twin.state_dict(), **linears, **norms})
    layer = "model.layers.0."
    weights = {name.removeprefix(layer): t for name, t in _hf_state_dict(serial_cfg, twin).items()
               if name.startswith(layer)}
    config = _hf_config(serial_cfg, attn_implementation="sdpa")  # sdpa: causal without an explicit mask
    attn, mlp = llama_modules.LlamaAttention(config, layer_idx=0), llama_modules.LlamaMLP(config)
    attn.load_state_dict({name.removeprefix("self_attn."): t for name, t in weights.items() if "self_attn." in name})
    mlp.load_state_dict({name.removeprefix("mlp."): t for name, t in weights.items() if name.startswith("mlp.")})
    norm = llama_modules.LlamaRMSNorm(cfg.hidden, eps=cfg.norm_eps)
    norm.load_state_dict({"weight": weights["input_layernorm.weight"]})
    x = torch.randn(2, cfg.seq, cfg.hidden, generator=torch.Generator().manual_seed(2))
    cos, sin = llama_modules.LlamaRotaryEmbedding(config)(x, torch.arange(cfg.seq)[None])
    with torch.no_grad():
        h = norm(x)
        expected = x + attn(h, position_embeddings=(cos, sin), attention_mask=None)[0] + mlp(h)
        torch.testing.assert_close(block(x), expected, rtol=0, atol=1e-5)
