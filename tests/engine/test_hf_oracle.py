"""The llama arch against transformers: a tiny megascale model's weights copied into
LlamaForCausalLM (full causal) or MistralForCausalLM (sliding window) give the same logits
within 1e-4 (fp32, 1 rank), and a llama parallel block (PTB) equals x + LlamaAttention(n(x)) +
LlamaMLP(n(x)) with one shared LlamaRMSNorm n. Norm weights are randomised so their placement counts."""
from __future__ import annotations

import pytest
import torch

from megascale.config import ModelConfig
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
    common = dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
                  num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                  num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.seq, rms_norm_eps=cfg.norm_eps,
                  rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base},
                  tie_word_embeddings=False, attn_implementation=attn_implementation)
    if cfg.window is None:
        return transformers.LlamaConfig(**common)
    return transformers.MistralConfig(sliding_window=cfg.window, **common)


def _layer_weights(block: torch.nn.Module) -> dict[str, torch.Tensor]:
    """One block's linears under transformers' names; fused q|k|v and gate|up split by their sections."""
    q, k, v = block.attn.qkv.weight.split(block.attn.qkv.sections)
    gate, up = block.mlp.fc.weight.split(block.mlp.fc.sections)
    return {"self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v,
            "self_attn.o_proj.weight": block.attn.proj.weight, "mlp.gate_proj.weight": gate,
            "mlp.up_proj.weight": up, "mlp.down_proj.weight": block.mlp.proj.weight}


def _hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": model.wte.weight, "model.norm.weight": model.ln_f.weight,
           "lm_head.weight": model.lm_head.weight}
    for i, block in model.blocks.items():
        weights = _layer_weights(block) | {"input_layernorm.weight": block.ln_1.weight,
                                           "post_attention_layernorm.weight": block.ln_2.weight}
        out |= {f"model.layers.{i}.{name}": t for name, t in weights.items()}
    return {name: t.detach().clone() for name, t in out.items()}


@pytest.mark.parametrize("window", [None, 5], ids=["llama", "mistral_window"])
def test_llama_logits_equal_transformers_with_the_same_weights(window):
    cfg = _tiny(window=window)
    ours = _megascale_model(cfg)
    config = _hf_config(cfg)
    theirs = (transformers.LlamaForCausalLM if window is None else transformers.MistralForCausalLM)(config).eval()
    missing, unexpected = theirs.load_state_dict(_hf_state_dict(ours), strict=False)
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
    config = _hf_config(cfg, attn_implementation="sdpa")  # sdpa: causal without an explicit mask
    weights = {name: t.detach() for name, t in _layer_weights(block).items()}
    attn, mlp = llama_modules.LlamaAttention(config, layer_idx=0), llama_modules.LlamaMLP(config)
    attn.load_state_dict({name.removeprefix("self_attn."): t for name, t in weights.items() if "self_attn." in name})
    mlp.load_state_dict({name.removeprefix("mlp."): t for name, t in weights.items() if "mlp." in name})
    norm = llama_modules.LlamaRMSNorm(cfg.hidden, eps=cfg.norm_eps)
    norm.load_state_dict(block.ln.state_dict())
    x = torch.randn(2, cfg.seq, cfg.hidden, generator=torch.Generator().manual_seed(2))
    cos, sin = llama_modules.LlamaRotaryEmbedding(config)(x, torch.arange(cfg.seq)[None])
    with torch.no_grad():
        h = norm(x)
        expected = x + attn(h, position_embeddings=(cos, sin), attention_mask=None)[0] + mlp(h)
        torch.testing.assert_close(block(x), expected, rtol=0, atol=1e-5)
