"""Trains tokenizer.json, the shipped pretrained tokenizer, on python_docs.jsonl (offline, deterministic).

    python data/corpus/build_tokenizer.py      # writes data/corpus/tokenizer.json

A byte-level BPE (GPT-2 pre-tokenization, end-of-text <|endoftext|>) in the Hugging Face
tokenizer.json format, so jobs and tests exercise `data.tokenizer: <path>` with nothing downloaded.
"""
from __future__ import annotations

import sys
from pathlib import Path

from megascale.data.prepare import iter_documents, list_inputs
from megascale.data.tokenizer import HFTokenizer

VOCAB = 512  # fits the example jobs' model.vocab


def main() -> int:
    from tokenizers import Tokenizer

    here = Path(__file__).parent
    texts = (text for _, text in iter_documents(list_inputs([here / "python_docs.jsonl"])))
    trained = HFTokenizer.train(texts, VOCAB)
    out = here / "tokenizer.json"
    out.write_text(Tokenizer.from_str(trained.file_bytes.decode()).to_str(pretty=True) + "\n")
    print(f"{out}: vocab {trained.vocab_size}, {out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
