"""The tokenizer a run was trained with goes out with its model: transformers' AutoTokenizer, reading
the exported directory, gives the token ids megascale trained on (byte, a BPE trained at prepare time,
a pretrained tokenizer.json), and names the end-of-text token. The end-to-end case is a user's: train
llama on the shipped tokenizer with `megascale train`, export the run, load both with transformers."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from hf_support import ATOL, transformers

from megascale.cli import main
from megascale.config import from_dict
from megascale.data.prepare import prepare_cached
from megascale.data.tokenizer import ByteTokenizer, load_pretrained
from megascale.interop.export import open_checkpoint, resolve_checkpoint, restore_model, run_tokenizer, write_tokenizer

SHIPPED = Path(__file__).resolve().parents[2] / "data" / "corpus"
TEXT = "def f(x):\n    return x ** 2  # naïve ✓"


def auto_tokenizer(tok, out):
    out.mkdir(exist_ok=True)
    write_tokenizer(tok, out, seq=64)
    return transformers.AutoTokenizer.from_pretrained(out)


def test_the_byte_tokenizer_exports_as_a_tokenizer_json_with_its_ids(tmp_path):
    theirs = auto_tokenizer(ByteTokenizer(), tmp_path)
    assert theirs(TEXT)["input_ids"] == list(TEXT.encode("utf-8"))
    assert theirs.eos_token == "<|endoftext|>" and theirs.eos_token_id == ByteTokenizer.eot_id
    assert theirs.decode(list(TEXT.encode("utf-8"))) == TEXT


def test_a_bpe_trained_at_prepare_time_is_read_back_from_the_prepared_dataset(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"document {i}: the quick brown fox jumps over {i} lazy dogs" for i in range(200)))
    cfg = from_dict({"model": {"vocab": 300}, "data": {"source": "text", "path": str(corpus), "tokenizer": "bpe"},
                     "train": {"run_dir": str(tmp_path / "runs")}})
    prepare_cached(corpus, cfg.train.run_dir, tokenizer="bpe", vocab=300)  # what the job did
    tok = run_tokenizer(cfg)
    ours = tok.encode_documents([TEXT])[0][:-1].tolist()  # without the end-of-text megascale appends
    assert auto_tokenizer(tok, tmp_path / "hf")(TEXT)["input_ids"] == ours


def test_a_user_trains_llama_on_the_shipped_tokenizer_exports_and_loads_it_with_transformers(tmp_path):
    config = tmp_path / "llama.yaml"
    config.write_text(yaml.safe_dump({
        "name": "llama-tiny",
        "model": {"arch": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96, "vocab": 512,
                  "seq": 64},
        "batch": {"micro": 2, "global": 4},
        "data": {"source": "text", "path": str(SHIPPED / "python_docs.jsonl"),
                 "tokenizer": str(SHIPPED / "tokenizer.json")},
        "checkpoint": {"uri": "{run_dir}/checkpoints", "every": 3},
        "train": {"steps": 3, "run_dir": str(tmp_path / "runs")},
    }))
    # A child process: ranks forked from this one (which ran multi-threaded torch ops) would hang in OpenMP.
    done = subprocess.run([sys.executable, "-m", "megascale.cli", "train", str(config), "--quiet"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = (tmp_path / "runs").glob("llama-tiny-*")  # beside runs/data, the prepared corpus
    assert main(["export", str(run), "--to", "hf", str(tmp_path / "hf")]) == 0

    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]

    assert ids[0].tolist() == load_pretrained(SHIPPED / "tokenizer.json").encode_documents([TEXT])[0][:-1].tolist()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id
    uri, filesystem, options = resolve_checkpoint(str(run))
    storage, manifest, cfg = open_checkpoint(uri, filesystem=filesystem, options=options)
    assert manifest["step"] == 3
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, restore_model(storage, manifest, cfg)(ids),
                                   rtol=0, atol=ATOL)
