"""Tiny jobs trained here and tiny transformers models made from configs, for the export/import tests."""
from __future__ import annotations

import torch

from megascale.checkpoint import Checkpointer, shutdown_keeper
from megascale.config import JobConfig, from_dict
from megascale.launch import run_ranks
from megascale.model.gpt import GPT
from megascale.parallel.state import full_stage_parameters
from megascale.parallel.topology import single_device_context
from megascale.train import Trainer, checkpoint_parts, layout_of

transformers = __import__("pytest").importorskip("transformers")

ATOL = 1e-4
STEPS = 3


def job(uri: str | None = None, parallelism: dict | None = None, steps: int = STEPS, **model) -> JobConfig:
    return from_dict({
        "model": {"layers": 2, "hidden": 64, "heads": 4, "ffn": 96, "vocab": 128, "seq": 32, **model},
        "parallelism": parallelism or {},
        "batch": {"micro": 1, "global": 4},
        "optimizer": {"name": "adamw", "lr": 0.02, "schedule": {"kind": "constant"}},
        "checkpoint": {"uri": uri, "every": steps if uri else 0, "keeper_idle_s": 60},
        "train": {"steps": steps},
    })


def _train_and_save(ctx, cfg: JobConfig) -> dict[str, torch.Tensor]:
    trainer = Trainer(cfg, ctx)
    checkpointer = Checkpointer(cfg, ctx, checkpoint_parts(trainer))
    try:
        for _ in range(cfg.train.steps):
            trainer.step()
            checkpointer.after_step(trainer.step_index)
        assert checkpointer.flush() == cfg.train.steps
        trainer.finish()
        return full_stage_parameters(trainer.chunks, ctx)
    finally:
        checkpointer.close()
        trainer.close()


def train_and_checkpoint(cfg: JobConfig) -> dict[str, torch.Tensor]:
    """Trains `cfg` at its layout, committing a checkpoint at its last step; the trained weights by name.
    One rank trains in this process: a rank forked after this process ran multi-threaded torch ops hangs
    in OpenMP once init_rank gives it more than one thread."""
    try:
        if layout_of(cfg).world_size == 1:
            return _train_and_save(single_device_context(), cfg)
        stages = run_ranks(_train_and_save, layout_of(cfg), cfg, sequence_parallel=cfg.parallelism.sequence_parallel)
    finally:
        shutdown_keeper(cfg.checkpoint.uri)
    return {name: t for stage in stages for name, t in stage.items()}


def megascale_model(cfg: JobConfig, weights: dict[str, torch.Tensor]) -> GPT:
    model = GPT(cfg.model).eval()
    state = {name: weights.get(name, weights.get("wte.weight")) for name in model.state_dict()}  # tied copy
    model.load_state_dict(state)
    return model


def tokens(cfg: JobConfig, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, cfg.model.vocab, (batch, cfg.model.seq), generator=torch.Generator().manual_seed(5))


def hf_logits(directory, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def tiny_hf_model(kind: str, *, parallel: bool = False, tied: bool = False, window: int | None = None, seed: int = 0):
    """A randomly initialised transformers model (hidden 64, 2 layers) whose norms are random too, so
    their placement counts; a GPT-NeoX one has zero linear biases (megascale has none), and with
    `parallel` its two norms per layer hold the same weights (a PTB)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=32, tie_word_embeddings=tied)
    if kind == "gpt_neox":
        config = transformers.GPTNeoXConfig(**common, hidden_act="gelu_new", use_parallel_residual=parallel,
                                            layer_norm_eps=1e-5, rotary_pct=1.0, rotary_emb_base=5000)
    elif window is None:
        config = transformers.LlamaConfig(**common, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=5000.0)
    else:
        config = transformers.MistralConfig(**common, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=5000.0,
                                            sliding_window=window)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
            elif name.endswith("bias"):
                p.zero_()
        if parallel:
            for layer in model.gpt_neox.layers:
                layer.post_attention_layernorm.load_state_dict(layer.input_layernorm.state_dict())
    return model


def model_section(kind: str, *, parallel: bool = False, tied: bool = False, window: int | None = None) -> dict:
    """The `model` fields matching `tiny_hf_model(kind, ...)`."""
    if kind == "gpt_neox":
        return {"arch": "gpt", "block": "parallel" if parallel else "serial", "tied_embeddings": tied,
                "rotary_base": 5000.0, "norm_eps": 1e-5}
    return {"arch": "llama", "kv_heads": 2, "window": window, "tied_embeddings": tied, "rotary_base": 5000.0,
            "norm_eps": 1e-6}
