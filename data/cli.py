"""`megascale data prepare|verify`: make and check token shard directories."""
from __future__ import annotations

import argparse
import sys

from megascale.data import DataError


def register(subparsers: argparse._SubParsersAction) -> None:
    data = subparsers.add_parser("data", help="prepare and check training data")
    sub = data.add_subparsers(dest="data_command", required=True)

    from megascale.data.prepare import DEFAULT_SHARD_TOKENS, TEXT_SUFFIXES

    prep = sub.add_parser("prepare", help="tokenize local text into Arrow token shards with an index and a manifest")
    prep.add_argument("--input", nargs="+", action="extend", required=True, metavar="PATH",
                      help=f"text files or directories (directories contribute {', '.join(TEXT_SUFFIXES)}; "
                           ".jsonl lines are {\"text\": ...} documents, any other file is one document)")
    prep.add_argument("--output", required=True, metavar="DIR", help="dataset directory to create")
    prep.add_argument("--tokenizer", default="byte", metavar="byte|bpe|PATH",
                      help="byte: UTF-8 bytes (vocab 257); bpe: byte-level BPE trained here on the inputs; PATH: a "
                           "Hugging Face tokenizer.json, or a folder holding one or GPT-2 vocab.json + merges.txt "
                           "(copied into DIR)")
    prep.add_argument("--vocab", type=int, help="BPE vocabulary size, end-of-text included (<= model.vocab)")
    prep.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                      help=f"tokens per shard (default {DEFAULT_SHARD_TOKENS})")
    prep.add_argument("--force", action="store_true", help="replace DIR if it exists")
    prep.set_defaults(func=_prepare)

    verify = sub.add_parser("verify", help="check a dataset directory's manifest and every checksum")
    verify.add_argument("dir", metavar="DIR")
    verify.set_defaults(func=_verify)


def _prepare(args: argparse.Namespace) -> int:
    from megascale.data.prepare import prepare

    if args.vocab is not None and args.tokenizer != "bpe":
        return _fail(DataError("--vocab applies to --tokenizer bpe only (byte has 257, a pretrained one its own)"))
    try:
        m = prepare(args.input, args.output, tokenizer=args.tokenizer, vocab=args.vocab,
                    shard_tokens=args.shard_tokens, force=args.force)
    except DataError as e:
        return _fail(e)
    print(f"{args.output}: {m['documents']} documents, {m['tokens']} tokens in {len(m['shards'])} shard(s), "
          f"{m['tokenizer']['kind']} tokenizer (vocab {m['tokenizer']['vocab_size']})")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from megascale.data.dataset import verify

    try:
        ds = verify(args.dir)
    except DataError as e:
        return _fail(e)
    print(f"{args.dir}: ok ({ds.documents} documents, {ds.tokens} tokens, {len(ds.shards)} shard(s))")
    return 0


def _fail(e: DataError) -> int:
    print(f"DataError: {e}", file=sys.stderr)
    return 2
