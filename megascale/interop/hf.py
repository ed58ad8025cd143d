"""megascale <-> Hugging Face transformers: which transformers class computes what a `model` section
computes, its config.json both ways, and the weights' names and layouts between that class and the
1-rank GPT (`GPT.state_dict()` names).

Only exact equivalents: llama serial = LlamaForCausalLM, llama with a window = MistralForCausalLM,
gpt serial or parallel = GPTNeoXForCausalLM (use_parallel_residual is a PTB when its two norms hold
the same weights; its linear biases are zeros). Anything else is refused in one line naming the field.

Plain JSON and tensors: transformers is not imported (it is a test dependency only).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from megascale.config import ConfigError, ModelConfig

LLAMA_TYPES = ("llama", "mistral")
NEOX_TYPE = "gpt_neox"
# GPT-NeoX's tanh GeLU (megascale's) under its two transformers names; "gelu" is the exact erf one.
NEOX_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
# Buffers some transformers versions saved beside the weights; nothing of the model's math.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")


def hf_class(m: ModelConfig) -> str:
    """The transformers class with exactly `m`'s math, or ConfigError naming the field that has none."""
    if m.arch == "llama":
        if m.block == "parallel":
            raise ConfigError("model.block=parallel: no transformers class has llama's parallel block "
                              "(one RMSNorm feeding attention and SwiGLU); export llama with model.block: serial")
        return "LlamaForCausalLM" if m.window is None else "MistralForCausalLM"
    if m.window is not None:
        raise ConfigError(f"model.window={m.window}: GPTNeoXForCausalLM (transformers' class for model.arch=gpt) "
                          "has no sliding window")
    if m.num_kv_heads != m.heads:
        raise ConfigError(f"model.kv_heads={m.kv_heads}: GPTNeoXForCausalLM (transformers' class for "
                          f"model.arch=gpt) has no grouped-query attention (kv_heads must equal heads={m.heads})")
    return "GPTNeoXForCausalLM"


def to_hf_config(m: ModelConfig, eos_id: int | None = None, bos_id: int | None = None) -> dict[str, Any]:
    """config.json for `hf_class(m)`. Rotary settings are written in both the current form
    (rope_parameters) and the older top-level keys, so older transformers versions read them too."""
    cls = hf_class(m)
    rope = {"rope_type": "default", "rope_theta": m.rotary_base}
    config: dict[str, Any] = {
        "architectures": [cls], "vocab_size": m.vocab, "hidden_size": m.hidden, "intermediate_size": m.ffn,
        "num_hidden_layers": m.layers, "num_attention_heads": m.heads, "max_position_embeddings": m.seq,
        "tie_word_embeddings": m.tied_embeddings, "torch_dtype": "float32", "bos_token_id": bos_id,
        "eos_token_id": eos_id, "rope_theta": m.rotary_base,
    }
    if cls == "GPTNeoXForCausalLM":
        return config | {
            "model_type": NEOX_TYPE, "hidden_act": NEOX_ACTIVATIONS[0], "layer_norm_eps": m.norm_eps,
            "use_parallel_residual": m.block == "parallel", "attention_bias": True,
            "rope_parameters": rope | {"partial_rotary_factor": 1.0}, "rotary_pct": 1.0,
            "rotary_emb_base": m.rotary_base,
        }
    config |= {"model_type": "llama" if m.window is None else "mistral", "hidden_act": "silu",
               "rms_norm_eps": m.norm_eps, "num_key_value_heads": m.num_kv_heads, "head_dim": m.hidden // m.heads,
               "attention_bias": False, "mlp_bias": False, "rope_parameters": rope}
    return config | ({"sliding_window": m.window} if m.window is not None else {})


# ---- config.json -> model fields ---------------------------------------------------------------


def model_fields(config: Mapping[str, Any], where: str) -> dict[str, tuple[str, Any]]:
    """The `model` fields a transformers config.json fixes: {field: ("its key=its value", field value)}.
    ConfigError (one line, naming `where`'s key) for a model megascale cannot compute exactly."""
    model_type = config.get("model_type")
    if model_type not in (*LLAMA_TYPES, NEOX_TYPE):
        raise ConfigError(f"{where} model_type={model_type}: megascale imports llama, mistral (model.arch: llama) "
                          "and gpt_neox (model.arch: gpt)")
    llama = model_type in LLAMA_TYPES
    theta, partial = _rope(config, where, default_partial=1.0 if llama else 0.25)
    if partial != 1.0:
        raise ConfigError(f"{where} partial_rotary_factor={partial}: megascale rotates every head dimension (1.0)")

    def key(name: str, default: Any = None) -> tuple[str, Any]:
        value = config.get(name, default)
        return f"{name}={value}", value

    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    fields = {"arch": (f"model_type={model_type}", "llama" if llama else "gpt"), "layers": key("num_hidden_layers"),
              "hidden": key("hidden_size"), "heads": key("num_attention_heads"), "ffn": key("intermediate_size"),
              "vocab": key("vocab_size"), "tied_embeddings": key("tie_word_embeddings", False),
              "rotary_base": (f"rope_theta={theta}", theta)}
    if llama:
        _require(config, where, "hidden_act", "silu", "silu")
        for name in ("attention_bias", "mlp_bias"):
            _require(config, where, name, False, "no linear biases")
        head_dim = config.get("head_dim")
        if head_dim is not None and heads and hidden and head_dim != hidden // heads:
            raise ConfigError(f"{where} head_dim={head_dim}: megascale's head width is hidden_size/"
                              f"num_attention_heads={hidden // heads}")
        window = key("sliding_window") if model_type == "mistral" else (f"model_type={model_type}", None)
        return fields | {"kv_heads": key("num_key_value_heads", heads), "window": window,
                         "block": (f"model_type={model_type}", "serial"), "norm_eps": key("rms_norm_eps", 1e-6)}
    if config.get("hidden_act", "gelu") not in NEOX_ACTIVATIONS:
        raise ConfigError(f"{where} hidden_act={config.get('hidden_act', 'gelu')}: megascale's gpt uses the tanh "
                          f"GeLU ({' or '.join(NEOX_ACTIVATIONS)})")
    described, parallel = key("use_parallel_residual", True)
    return fields | {"kv_heads": key("num_attention_heads"), "window": (f"model_type={model_type}", None),
                     "block": (described, "parallel" if parallel else "serial"),
                     "norm_eps": key("layer_norm_eps", 1e-5)}


def _require(config: Mapping[str, Any], where: str, key: str, value: Any, meaning: str) -> None:
    if config.get(key, value) != value:
        raise ConfigError(f"{where} {key}={config[key]}: megascale's llama has {meaning}")


def _rope(config: Mapping[str, Any], where: str, default_partial: float) -> tuple[float, float]:
    """(rotary base, share of each head rotated): from rope_parameters (transformers 5), else the
    older top-level keys (rope_theta, rotary_emb_base, rotary_pct) and rope_scaling."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ConfigError(f"{where} rope_type={kind}: megascale's rotary positions are unscaled (default)")
    theta = params.get("rope_theta", config.get("rope_theta", config.get("rotary_emb_base", 10000.0)))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor",
                                                             config.get("rotary_pct", default_partial)))
    return float(theta), float(partial)


def check_fits(m: ModelConfig, config: Mapping[str, Any], where: str) -> None:
    """ConfigError `model.hidden=64 but DIR/config.json hidden_size=128` for the first field that differs."""
    for field, (described, value) in model_fields(config, where).items():
        ours = m.num_kv_heads if field == "kv_heads" else getattr(m, field)
        if ours != value:
            raise ConfigError(f"model.{field}={ours} but {where} {described}")


# ---- weights ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One megascale weight and the transformers weights it is made of. `kind`: "copy" (one, as is),
    "fused" (stacked along dim 0: q|k|v, gate|up), "neox_qkv" (GPT-NeoX's per-head q,k,v interleave),
    "shared" (a PTB's one norm, held twice by GPT-NeoX), or "zero" (a transformers bias megascale
    has not: zeros out, and only zeros in)."""

    ours: str | None
    theirs: tuple[str, ...]
    kind: str = "copy"


def rules(m: ModelConfig) -> list[Rule]:
    """Every weight of `hf_class(m)` and where it comes from (the lm_head rule only when untied)."""
    hf_class(m)
    return _llama_rules(m) if m.arch == "llama" else _neox_rules(m)


def _llama_rules(m: ModelConfig) -> list[Rule]:
    out = [Rule("wte.weight", ("model.embed_tokens.weight",)), Rule("ln_f.weight", ("model.norm.weight",))]
    for i in range(m.layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        attn, mlp = f"{theirs}self_attn.", f"{theirs}mlp."
        out += [Rule(f"{ours}ln_1.weight", (f"{theirs}input_layernorm.weight",)),
                Rule(f"{ours}ln_2.weight", (f"{theirs}post_attention_layernorm.weight",)),
                Rule(f"{ours}attn.qkv.weight", tuple(f"{attn}{x}_proj.weight" for x in "qkv"), "fused"),
                Rule(f"{ours}attn.proj.weight", (f"{attn}o_proj.weight",)),
                Rule(f"{ours}mlp.fc.weight", (f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"), "fused"),
                Rule(f"{ours}mlp.proj.weight", (f"{mlp}down_proj.weight",))]
    return out + ([] if m.tied_embeddings else [Rule("lm_head.weight", ("lm_head.weight",))])


def _neox_rules(m: ModelConfig) -> list[Rule]:
    out = [Rule("wte.weight", ("gpt_neox.embed_in.weight",))]
    out += [Rule(f"ln_f.{p}", (f"gpt_neox.final_layer_norm.{p}",)) for p in ("weight", "bias")]
    for i in range(m.layers):
        ours, theirs = f"blocks.{i}.", f"gpt_neox.layers.{i}."
        for p in ("weight", "bias"):
            if m.block == "parallel":
                both = (f"{theirs}input_layernorm.{p}", f"{theirs}post_attention_layernorm.{p}")
                out.append(Rule(f"{ours}ln.{p}", both, "shared"))
            else:
                out += [Rule(f"{ours}ln_1.{p}", (f"{theirs}input_layernorm.{p}",)),
                        Rule(f"{ours}ln_2.{p}", (f"{theirs}post_attention_layernorm.{p}",))]
        out += [Rule(f"{ours}attn.qkv.weight", (f"{theirs}attention.query_key_value.weight",), "neox_qkv"),
                Rule(f"{ours}attn.proj.weight", (f"{theirs}attention.dense.weight",)),
                Rule(f"{ours}mlp.fc.weight", (f"{theirs}mlp.dense_h_to_4h.weight",)),
                Rule(f"{ours}mlp.proj.weight", (f"{theirs}mlp.dense_4h_to_h.weight",))]
        out += [Rule(None, (f"{theirs}{name}.bias",), "zero") for name in
                ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")]
    return out + ([] if m.tied_embeddings else [Rule("lm_head.weight", ("embed_out.weight",))])


def _heads(m: ModelConfig) -> tuple[int, int]:
    return m.heads, m.hidden // m.heads


def _neox_to_ours(t: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    """[heads x (q, k, v) x head_dim] rows -> [q | k | v] rows."""
    heads, head_dim = _heads(m)
    return t.reshape(heads, 3, head_dim, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _ours_to_neox(t: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    heads, head_dim = _heads(m)
    return t.reshape(3, heads, head_dim, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def fused_sections(m: ModelConfig, ours: str) -> list[int]:
    """Row counts of the transformers weights a fused megascale weight stacks."""
    if ours.endswith("attn.qkv.weight"):
        kv_width = m.num_kv_heads * (m.hidden // m.heads)
        return [m.hidden, kv_width, kv_width]
    return [m.ffn, m.ffn]


def neox_bias_shape(m: ModelConfig, name: str) -> tuple[int, ...]:
    """The shape of GPT-NeoX's linear bias `name`."""
    if name.endswith("query_key_value.bias"):
        return (3 * m.hidden,)
    return (m.ffn,) if name.endswith("dense_h_to_4h.bias") else (m.hidden,)


def to_hf(m: ModelConfig, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' state dict of `hf_class(m)` from the 1-rank GPT's `state`: fp32, each tensor its own
    contiguous copy (safetensors stores no shared memory)."""
    out: dict[str, torch.Tensor] = {}
    for rule in rules(m):
        if rule.kind == "zero":
            out[rule.theirs[0]] = torch.zeros(neox_bias_shape(m, rule.theirs[0]))
            continue
        t = state[rule.ours].detach().float().cpu()
        if rule.kind == "fused":
            out |= dict(zip(rule.theirs, t.split(fused_sections(m, rule.ours))))
        elif rule.kind == "neox_qkv":
            out[rule.theirs[0]] = _ours_to_neox(t, m)
        else:  # copy, or shared: the same norm in both places
            out |= {name: t for name in rule.theirs}
    return {name: t.clone().contiguous() for name, t in out.items()}


def from_hf(m: ModelConfig, rule: Rule, read: Callable[[str], torch.Tensor], where: str) -> torch.Tensor | None:
    """The megascale weight `rule.ours` from transformers' weights (`read(name)`, fp32); for a "zero"
    rule, None once the bias is checked to be zeros. ConfigError (one line) for weights that megascale
    would compute differently: a nonzero bias, a PTB's two norms that differ."""
    parts = [read(name) for name in rule.theirs]
    if rule.kind == "fused":
        return torch.cat(parts)
    if rule.kind == "neox_qkv":
        return _neox_to_ours(parts[0], m)
    if rule.kind == "zero" and parts[0].any():
        raise ConfigError(f"{where} {rule.theirs[0]} is not zero: megascale's gpt has no linear biases")
    if rule.kind == "shared" and not torch.equal(parts[0], parts[1]):
        raise ConfigError(f"model.block=parallel but {where} {rule.theirs[1]} differs from {rule.theirs[0]} "
                          "(a parallel block has one norm)")
    return None if rule.kind == "zero" else parts[0]
