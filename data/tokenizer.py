"""Tokenizers, never downloaded: raw UTF-8 bytes, a byte-level BPE trained here on the corpus, or a
pretrained one read from local files (a Hugging Face tokenizer.json, or GPT-2 vocab.json + merges.txt).

Every document carries a separator token, so a model learns where documents stop: end-of-text after
it, or, for a pretrained tokenizer with a begin-of-text token only, that token before it.
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
NAMES = ("byte", "bpe")  # data.tokenizer values that are not paths
HF_FILE = "tokenizer.json"
GPT2_FILES = ("vocab.json", "merges.txt")
# Where no tokenizer_config.json names them: the spellings of the common model families.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")


class Tokenizer(Protocol):
    kind: str
    vocab_size: int  # token ids are < this
    eot_id: int  # the document separator

    def encode_documents(self, texts: list[str]) -> list[np.ndarray]: ...
    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """Token = UTF-8 byte; nothing to train, nothing to store, vocab 257."""

    kind = "byte"
    vocab_size = BYTE_VOCAB
    eot_id = 256

    def encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        return [np.append(np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64), self.eot_id)
                for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` library tokenizer: kind "bpe" (trained here) or "pretrained" (loaded from files).

    `file_bytes` is what a prepared dataset stores as tokenizer.json: a pretrained tokenizer.json
    verbatim, so its checksum names the user's file.
    """

    def __init__(self, tok, kind: str, eot_token: str, *, eot_first: bool = False,
                 file_bytes: bytes | None = None, source: str | None = None) -> None:
        # Documents are packed into sequences by the loader: a file's own truncation or padding
        # would silently cut or pad them.
        tok.no_truncation()
        tok.no_padding()
        self._tok, self.kind = tok, kind
        self.eot_token, self.eot_first = eot_token, eot_first
        self.eot_id = tok.token_to_id(eot_token)
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1  # ids may have gaps
        self.file_bytes = file_bytes if file_bytes is not None else tok.to_str().encode()
        self.source = source  # the path it was loaded from, recorded in a dataset's manifest

    @classmethod
    def train(cls, texts: Iterable[str], vocab: int) -> HFTokenizer:
        """Byte-level BPE with GPT-2 pre-tokenization and end-of-text `EOT`."""
        if vocab < MIN_BPE_VOCAB:
            raise DataError(f"--vocab {vocab}: byte-level BPE needs at least {MIN_BPE_VOCAB}")
        from tokenizers import Tokenizer as Tok
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = Tok(models.BPE())
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
        return cls(tok, "bpe", EOT)

    def encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        out = []
        for e in self._tok.encode_batch(texts):
            ids = e.ids  # with the file's own special tokens (e.g. a post-processor's BOS)
            if self.eot_first and ids[:1] != [self.eot_id]:
                ids = [self.eot_id, *ids]
            elif not self.eot_first and ids[-1:] != [self.eot_id]:
                ids = [*ids, self.eot_id]
            out.append(np.asarray(ids, dtype=np.int64))
        return out

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def manifest_entry(self) -> dict:
        return {"eot_token": self.eot_token, "eot_first": self.eot_first,
                **({"source": self.source} if self.source else {})}


def load_pretrained(path: str | Path) -> HFTokenizer:
    """A tokenizer.json, a folder holding one, or a folder holding GPT-2 vocab.json + merges.txt."""
    from tokenizers import Tokenizer as Tok

    path = Path(path).expanduser()
    folder = path if path.is_dir() else path.parent
    if path.is_dir() and (path / HF_FILE).is_file():
        path = path / HF_FILE
    if path.is_file():
        data = path.read_bytes()
        try:
            tok = Tok.from_str(data.decode("utf-8"))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises bare Exceptions on bad files
            hint = " (a GPT-2 vocab.json needs its merges.txt: give the folder holding both)" \
                if path.name == GPT2_FILES[0] else f" ({str(e).splitlines()[0][:120]})"
            raise DataError(f"{path}: not a tokenizer file{hint}") from None
        eot, first = _separator(tok, folder, path)
        return HFTokenizer(tok, "pretrained", eot, eot_first=first, file_bytes=data, source=str(path.resolve()))
    if path.is_dir() and all((path / f).is_file() for f in GPT2_FILES):
        tok = _gpt2(path)
        eot, first = _separator(tok, folder, path)
        return HFTokenizer(tok, "pretrained", eot, eot_first=first, source=str(path.resolve()))
    if path.is_dir():
        raise DataError(f"{path}: holds neither {HF_FILE} nor GPT-2 {' + '.join(GPT2_FILES)}")
    raise DataError(f"{path}: not found")


def _gpt2(folder: Path):
    """GPT-2's tokenizer from its two files, built as transformers' GPT-2 converter builds it."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as Tok

    vocab, merges = (str(folder / f) for f in GPT2_FILES)
    try:
        tok = Tok(models.BPE.from_file(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="",
                                       fuse_unk=False))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises bare Exceptions on bad files
        raise DataError(f"{folder}: not a GPT-2 {' + '.join(GPT2_FILES)} pair ({str(e).splitlines()[0][:120]})") \
            from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # vocab.json lists the special tokens as plain entries; transformers treats them as special
    # (never split, skipped when decoding), so do the same.
    names = _configured_tokens(folder)
    specials = [t for t in (names.get("eos_token"), names.get("bos_token"), *EOS_NAMES, *BOS_NAMES)
                if t and tok.token_to_id(t) is not None]
    tok.add_special_tokens([AddedToken(t, special=True) for t in dict.fromkeys(specials)])
    return tok


def _configured_tokens(folder: Path) -> dict[str, str]:
    """eos_token / bos_token from transformers' tokenizer_config.json or special_tokens_map.json."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        try:
            config = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        for key in ("eos_token", "bos_token"):
            value = config.get(key) if isinstance(config, dict) else None
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                found[key] = value
    return found


def _separator(tok, folder: Path, path: Path) -> tuple[str, bool]:
    """(token, goes first): the EOS after each document, else the BOS before it."""
    names = _configured_tokens(folder)
    for key in ("eos_token", "bos_token"):
        if key in names:
            if tok.token_to_id(names[key]) is None:
                raise DataError(f"{path}: {key} {names[key]!r} from {folder} is not in the vocabulary")
            return names[key], key == "bos_token"
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    for candidates, first in ((EOS_NAMES, False), (BOS_NAMES, True)):
        for name in candidates:
            if name in specials:
                return name, first
    raise DataError(f"{path}: no end-of-text or begin-of-text special token to separate documents with "
                    f"(looked for {', '.join(EOS_NAMES + BOS_NAMES)}, and eos_token/bos_token in "
                    "tokenizer_config.json)")


def make_tokenizer(spec: str, texts: Iterable[str] | None = None, vocab: int | None = None) -> Tokenizer:
    """`spec` is byte, bpe (trained on `texts` to `vocab` ids) or a path for load_pretrained."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "bpe":
        if vocab is None:
            raise DataError("--tokenizer bpe needs --vocab N")
        return HFTokenizer.train(texts or [], vocab)
    if not Path(spec).expanduser().exists():
        raise DataError(f"tokenizer {spec}: not found (byte, bpe, or a path to a {HF_FILE}, "
                        f"or to a folder with one or with {' + '.join(GPT2_FILES)})")
    return load_pretrained(spec)


def load_tokenizer(dataset_dir: str | Path) -> Tokenizer:
    """The tokenizer a prepared dataset was made with (for sampling, inspection and export)."""
    from tokenizers import Tokenizer as Tok

    root = Path(dataset_dir)
    try:
        spec = json.loads((root / "manifest.json").read_text())["tokenizer"]
    except (OSError, ValueError, KeyError):
        raise DataError(f"{root}: no readable manifest.json with a tokenizer entry") from None
    if spec["kind"] == "byte":
        return ByteTokenizer()
    file = root / spec["file"]
    try:
        data = file.read_bytes()
        tok = Tok.from_str(data.decode("utf-8"))
    except FileNotFoundError:
        raise DataError(f"{file}: tokenizer file missing") from None
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises bare Exceptions on bad JSON
        raise DataError(f"{file}: not a valid tokenizer file ({str(e).splitlines()[0]})") from None
    # Datasets prepared before pretrained tokenizers existed hold a bpe entry without eot_token.
    return HFTokenizer(tok, spec["kind"], spec.get("eot_token", EOT), eot_first=spec.get("eot_first", False),
                       file_bytes=data, source=spec.get("source"))
