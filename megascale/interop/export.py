"""A committed megascale checkpoint, saved at any layout, as a Hugging Face model directory that
`AutoModelForCausalLM.from_pretrained` loads without custom code: config.json, safetensors weights
(sharded past `max_shard_size`, with model.safetensors.index.json) and the run's tokenizer.

No training ranks: this process restores the checkpoint into a 1-rank model (resharding reads any
saved layout). It only reads: no keeper is started, no manifest written, so a run may still be
writing checkpoints under the same uri.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import torch

from megascale.checkpoint.host_comm import HostGroups
from megascale.checkpoint.reshard import slice_sources
from megascale.checkpoint.restore_plan import SliceReader
from megascale.checkpoint.save_plan import SavePlan
from megascale.checkpoint.storage import (
    CheckpointError, check_compatible, committed_steps, open_storage, read_manifest,
)
from megascale.config import (
    ConfigError, JobConfig, ParallelismConfig, PrecisionConfig, from_dict, load_config, with_run_dir,
)
from megascale.interop.hf import hf_class, to_hf, to_hf_config
from megascale.model.gpt import GPT
from megascale.parallel.parallelize import parallelize
from megascale.parallel.topology import single_device_context

EOT = "<|endoftext|>"


def resolve_checkpoint(source: str) -> tuple[str, Optional[str], dict[str, str]]:
    """(checkpoint uri, checkpoint.filesystem, checkpoint.filesystem_options) of a run directory (its
    config.yaml's checkpoint section), or of a checkpoint uri given as is."""
    run = Path(source).expanduser()
    if not (run / "config.yaml").is_file():
        return source, None, {}
    cfg = with_run_dir(load_config(run / "config.yaml"), run.resolve())
    if not cfg.checkpoint.uri:
        raise ConfigError(f"{run}/config.yaml: checkpoint.uri is not set (the run saved no checkpoints)")
    return cfg.checkpoint.uri, cfg.checkpoint.filesystem, cfg.checkpoint.filesystem_options


def open_checkpoint(uri: str, step: Optional[int] = None, filesystem: Optional[str] = None,
                    options: Optional[dict[str, str]] = None):
    """(storage, manifest, the job config it was saved with) of committed `step`, default the newest."""
    storage = open_storage(uri, filesystem, options)
    steps = committed_steps(storage)
    if not steps:
        raise ConfigError(f"{uri}: holds no committed checkpoint")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ConfigError(f"--step {step}: not a committed checkpoint under {uri} (committed: "
                          f"{', '.join(map(str, steps))})")
    manifest = read_manifest(storage, step)
    return storage, manifest, from_dict(manifest["config"])


@torch.no_grad()
def restore_model(storage, manifest: dict, cfg: JobConfig) -> GPT:
    """The 1-rank fp32 model of `manifest`'s checkpoint: the optimizer's master weights, restored from
    whatever layout they were saved at, the way a 1-rank job resumes (minus the keeper)."""
    one = dataclasses.replace(cfg, parallelism=ParallelismConfig(), precision=PrecisionConfig(dtype="fp32"))
    ctx = single_device_context()
    with torch.device("meta"):
        model = GPT(one.model)
    chunks, optimizer = parallelize(model, ctx, one)
    parts = {"optimizer": optimizer}
    check_compatible(manifest, one.to_dict()["model"], parts)
    plan = SavePlan(parts, {})
    layout = {"tp": 1, "pp": 1, "vpp": 1, "dp": 1}
    sources = slice_sources(manifest, layout, (0, 0, 0), plan.sharded)
    assembly, error = SliceReader(storage, HostGroups(ctx), manifest, sources).load(plan, -1, None)
    if error:
        raise CheckpointError(f"checkpoint step {manifest['step']}: {error}")
    optimizer.load_state_dict(assembly.states()["optimizer"])
    return chunks[0].eval()


def byte_tokenizer_json() -> str:
    """megascale's byte tokenizer (id = UTF-8 byte, 256 = end-of-text) as a tokenizer.json: a byte-level
    BPE whose vocabulary is the 256 bytes and which has no merges, so each byte is one token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOT, special=True)])
    return tok.to_str()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the one the ByteLevel pre-tokenizer maps bytes through
    (the tokenizers library applies it but does not export it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def run_tokenizer(cfg: JobConfig):
    """The tokenizer `cfg`'s data was tokenized with, or None (synthetic data has none)."""
    from megascale.data import DataError
    from megascale.data.tokenizer import ByteTokenizer, load_pretrained, load_tokenizer

    data = cfg.data
    try:
        if data.source == "synthetic":
            return None
        if data.source == "shards":
            return load_tokenizer(data.path)
        if data.tokenizer == "byte":
            return ByteTokenizer()
        if data.tokenizer == "bpe":  # trained when the corpus was prepared: its copy is in the prepared dataset
            from megascale.data.prepare import prepare_cached

            return load_tokenizer(prepare_cached(data.path, cfg.train.run_dir, tokenizer="bpe", vocab=cfg.model.vocab))
        return load_pretrained(data.tokenizer)
    except DataError as e:
        raise ConfigError(f"data.tokenizer={data.tokenizer}: {e} (the run's tokenizer; --no-tokenizer exports the "
                          "weights alone)") from None


def write_tokenizer(tok, out: Path, seq: int) -> str:
    """tokenizer.json and tokenizer_config.json (its end-of-text or begin-of-text token named, so
    AutoTokenizer finds it); returns what was written, in words."""
    if tok.kind == "byte":
        (out / "tokenizer.json").write_text(byte_tokenizer_json())
        role, token, what = "eos_token", EOT, "byte-level: the 256 bytes, then <|endoftext|>, as megascale numbers them"
    else:
        (out / "tokenizer.json").write_bytes(tok.file_bytes)
        role, token, what = ("bos_token" if tok.eot_first else "eos_token"), tok.eot_token, f"{tok.kind}"
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", role: token, "model_max_length": seq,
        "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    return f"tokenizer.json ({what}, {tok.vocab_size} ids)"


def export_hf(source: str, out: str | Path, step: Optional[int] = None, max_shard_size: int | str = "5GB",
              tokenizer: bool = True) -> str:
    """Writes committed `step` (default: the newest) of a checkpoint uri or run directory as a Hugging
    Face model directory `out` (new or empty); returns a one-line summary."""
    from huggingface_hub import save_torch_state_dict

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty directory")
    uri, filesystem, options = resolve_checkpoint(source)
    storage, manifest, cfg = open_checkpoint(uri, step, filesystem, options)
    m = cfg.model
    cls = hf_class(m)  # refuses a model no transformers class computes, before any work
    tok = run_tokenizer(cfg) if tokenizer else None
    model = restore_model(storage, manifest, cfg)
    out.mkdir(parents=True, exist_ok=True)
    written = write_tokenizer(tok, out, m.seq) if tok is not None else "no tokenizer"
    eot = {} if tok is None else {"bos_id" if getattr(tok, "eot_first", False) else "eos_id": tok.eot_id}
    (out / "config.json").write_text(json.dumps(to_hf_config(m, **eot), indent=2) + "\n")
    save_torch_state_dict(to_hf(m, model.state_dict()), out, max_shard_size=max_shard_size)
    shards = sorted(p.name for p in out.glob("model*.safetensors"))
    return (f"step {manifest['step']} of {uri} -> {out}: {cls}, config.json, "
            f"{shards[0] if len(shards) == 1 else f'{len(shards)} safetensors shards + index'}, {written}")
