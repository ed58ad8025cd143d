"""Tokenizers built here, never downloaded: raw UTF-8 bytes, or a byte-level BPE trained on the corpus.

Every document ends with an end-of-text token, so a model learns where documents stop.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import numpy as np
from megascale.data import DataError

EOT = "<|endoftext|>"
BYTE_VOCAB = 257  # 256 byte values + end-of-text
MIN_BPE_VOCAB = 258  # the 256-symbol byte alphabet, end-of-text, and at least one merge


class Tokenizer(Protocol):
    kind: str
    vocab_size: int
    eot_id: int

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...
    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """Token = UTF-8 byte; nothing to train, nothing to store, vocab 257."""

    kind = "byte"
    vocab_size = BYTE_VOCAB
    eot_id = 256

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization) from the `tokenizers` library."""

    kind = "bpe"

    def __init__(self, tok) -> None:
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eot_id = tok.token_to_id(EOT)

    @classmethod
    def train(cls, texts: Iterable[str], vocab: int) -> BPETokenizer:
        if vocab < MIN_BPE_VOCAB:
            raise DataError(f"--vocab {vocab}: byte-level BPE needs at least {MIN_BPE_VOCAB}")
        _require_tokenizers()
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte stays encodable
            show_progress=False,
        )
        # Training is deterministic for a given input order (checked across processes in the tests).
        tok.train_from_iterator(texts, trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: Path) -> BPETokenizer:
        _require_tokenizers()
        from tokenizers import Tokenizer as HFTokenizer

        try:
            return cls(HFTokenizer.from_str(path.read_text()))
        except FileNotFoundError:
            raise DataError(f"{path}: tokenizer file missing") from None
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises bare Exceptions on bad JSON
            raise DataError(f"{path}: not a valid tokenizer file ({str(e).splitlines()[0]})") from None

    def to_str(self) -> str:
        return self._tok.to_str()

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in self._tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _require_tokenizers() -> None:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise DataError("the bpe tokenizer needs the `tokenizers` package (pip install tokenizers)") from None


def make_tokenizer(kind: str, texts: Iterable[str] | None = None, vocab: int | None = None) -> Tokenizer:
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        if vocab is None:
            raise DataError("--tokenizer bpe needs --vocab N")
        return BPETokenizer.train(texts or [], vocab)
    raise DataError(f"tokenizer {kind!r}: must be byte or bpe")


def load_tokenizer(dataset_dir: str | Path) -> Tokenizer:
    """The tokenizer a prepared dataset was made with (for sampling and inspection)."""
    root = Path(dataset_dir)
    try:
        spec = json.loads((root / "manifest.json").read_text())["tokenizer"]
    except (OSError, ValueError, KeyError):
        raise DataError(f"{root}: no readable manifest.json with a tokenizer entry") from None
    if spec["kind"] == "byte":
        return ByteTokenizer()
    return BPETokenizer.load(root / spec["file"])
