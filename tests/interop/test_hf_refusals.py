"""What has no exact transformers equivalent, or does not fit the job's `model` section, is refused in
one line naming the field: at export (the model) and at import (config.json, tensors, the CLI)."""
from __future__ import annotations

import json

import pytest
import torch
import yaml
from hf_support import model_section, tiny_hf_model
from safetensors.torch import load_file, save_file

from megascale.cli import main
from megascale.config import ConfigError, ModelConfig
from megascale.interop.hf import hf_class
from megascale.interop.load import check_hf_dir


@pytest.mark.parametrize("fields, message", [
    ({"arch": "llama", "block": "parallel"}, "model.block=parallel: no transformers class has llama's parallel block"),
    ({"arch": "gpt", "window": 8}, "model.window=8: GPTNeoXForCausalLM"),
    ({"arch": "gpt", "kv_heads": 2}, "model.kv_heads=2: GPTNeoXForCausalLM"),
])
def test_export_refuses_models_transformers_has_no_class_for(fields, message):
    with pytest.raises(ConfigError, match=message):
        hf_class(ModelConfig(hidden=64, heads=4, **fields))


def model(kind: str = "llama", **fields) -> ModelConfig:
    base = {"layers": 2, "hidden": 64, "heads": 4, "ffn": 96, "vocab": 128, "seq": 32}
    return ModelConfig(**{**base, **model_section(kind), **fields})


@pytest.fixture
def llama_dir(tmp_path):
    tiny_hf_model("llama").save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def edit_config(directory, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_weights(directory, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def refused(m: ModelConfig, directory) -> str:
    with pytest.raises(ConfigError) as e:
        check_hf_dir(m, directory)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_directory_that_fits_is_accepted(llama_dir):
    check_hf_dir(model(), llama_dir)


@pytest.mark.parametrize("fields, message", [
    ({"vocab": 256}, "model.vocab=256 but {d}/config.json vocab_size=128"),
    ({"hidden": 128}, "model.hidden=128 but {d}/config.json hidden_size=64"),
    ({"kv_heads": 4}, "model.kv_heads=4 but {d}/config.json num_key_value_heads=2"),
    ({"window": 8}, "model.window=8 but {d}/config.json model_type=llama"),
    ({"rotary_base": 10000.0}, "model.rotary_base=10000.0 but {d}/config.json rope_theta=5000.0"),
    ({"tied_embeddings": True}, "model.tied_embeddings=True but {d}/config.json tie_word_embeddings=False"),
    ({"arch": "gpt", "kv_heads": None}, "model.arch=gpt but {d}/config.json model_type=llama"),
])
def test_import_refuses_a_model_section_that_does_not_fit(llama_dir, fields, message):
    assert refused(model(**fields), llama_dir) == message.format(d=llama_dir)


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "qwen2"}, "model_type=qwen2: megascale imports llama, mistral"),
    ({"hidden_act": "gelu"}, "hidden_act=gelu: megascale's llama has silu"),
    ({"mlp_bias": True}, "mlp_bias=True: megascale's llama has no linear biases"),
    ({"head_dim": 32}, "head_dim=32: megascale's head width is hidden_size/num_attention_heads=16"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5000.0}}, "rope_type=llama3: megascale's rotary"),
])
def test_import_refuses_a_transformers_model_megascale_computes_differently(llama_dir, changes, message):
    edit_config(llama_dir, **changes)
    assert message in refused(model(), llama_dir)


def test_import_refuses_gpt_neox_features_megascale_lacks(tmp_path):
    directory = tmp_path / "neox"
    tiny_hf_model("gpt_neox").save_pretrained(directory)
    edit_config(directory, rope_parameters={"rope_type": "default", "rope_theta": 5000, "partial_rotary_factor": 0.25})
    assert "partial_rotary_factor=0.25: megascale rotates every head dimension" in refused(model("gpt_neox"), directory)
    edit_config(directory, rope_parameters={"rope_type": "default", "rope_theta": 5000, "partial_rotary_factor": 1.0},
                hidden_act="gelu")
    assert "hidden_act=gelu: megascale's gpt uses the tanh GeLU" in refused(model("gpt_neox"), directory)
    edit_config(directory, hidden_act="gelu_new")
    bias = "gpt_neox.layers.1.mlp.dense_h_to_4h.bias"
    edit_weights(directory, lambda t: t[bias].fill_(0.1))
    expected = f"{directory} {bias} is not zero: megascale's gpt has no linear biases"
    assert refused(model("gpt_neox"), directory) == expected


def test_import_refuses_a_gpt_neox_parallel_block_whose_two_norms_differ(tmp_path):
    directory = tmp_path / "neox"
    tiny_hf_model("gpt_neox", parallel=True).save_pretrained(directory)
    edit_weights(directory, lambda t: t["gpt_neox.layers.0.post_attention_layernorm.weight"].mul_(2))
    assert "model.block=parallel but" in refused(model("gpt_neox", block="parallel"), directory)
    assert "post_attention_layernorm.weight differs from" in refused(model("gpt_neox", block="parallel"), directory)


def test_import_refuses_missing_and_unknown_tensors(llama_dir):
    edit_weights(llama_dir, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}))
    assert refused(model(), llama_dir).endswith("holds model.layers.0.self_attn.q_norm.weight, which megascale's "
                                                "model.arch=llama has no place for")
    edit_weights(llama_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    assert refused(model(), llama_dir) == f"{llama_dir} holds no tensor model.layers.1.mlp.up_proj.weight"


def test_import_cli_refuses_before_any_rank_starts_in_one_line(llama_dir, tmp_path, capsys):
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"model": {"arch": "llama", "layers": 2, "hidden": 64, "heads": 4,
                                                "ffn": 96, "vocab": 256, "seq": 32}}))
    code = main(["import", "--from", "hf", str(llama_dir), "--config", str(config), str(tmp_path / "ckpt")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"ConfigError: model.vocab=256 but {llama_dir}/config.json vocab_size=128"
    assert not (tmp_path / "ckpt").exists()


def test_export_cli_refuses_a_missing_checkpoint_or_a_used_directory_in_one_line(tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "nothing"), "--to", "hf", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"ConfigError: {tmp_path / 'nothing'}: holds no committed checkpoint"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert main(["export", str(tmp_path / "nothing"), "--to", "hf", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"ConfigError: {out}: exists and is not an empty directory"
