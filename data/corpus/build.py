"""Rebuilds python_docs.jsonl from the running Python's standard library (offline, deterministic).

    python data/corpus/build.py            # writes data/corpus/python_docs.jsonl

Two kinds of documents, one JSON line each ({"id": ..., "text": ...}):
  reference:<topic>  the Language Reference sections that `help()` shows (pydoc_data.topics)
  module:<name>      a public top-level stdlib module's docstrings: the module's own, then its
                     classes' and functions' in source order, capped at MODULE_CHARS
"""
from __future__ import annotations

import ast
import json
import sys
import sysconfig
from pathlib import Path

MODULE_CHARS = 3000  # keeps the corpus under ~1 MB while covering every module
SKIP = {"this", "antigravity", "__future__", "__hello__"}  # jokes and stubs, not prose


def reference() -> list[dict]:
    from pydoc_data.topics import topics

    return [{"id": f"reference:{k}", "text": topics[k].strip()} for k in sorted(topics)]


def module_docs(stdlib: Path) -> list[dict]:
    docs = []
    for path in sorted(stdlib.glob("*.py")):
        name = path.stem
        if name.startswith("_") or name in SKIP:
            continue
        tree = ast.parse(path.read_text("utf-8"))
        parts = [f"Module {name}"]
        if ast.get_docstring(tree):
            parts.append(ast.get_docstring(tree).strip())
        for node, qual in _walk(tree.body, ""):
            doc = ast.get_docstring(node)
            if doc and not qual.split(".")[-1].startswith("_"):
                parts.append(f"{qual}:\n{doc.strip()}")
        text, size = [], 0
        for part in parts:
            if size + len(part) > MODULE_CHARS and len(text) > 1:
                break
            text.append(part)
            size += len(part) + 2
        if len(text) > 1:
            docs.append({"id": f"module:{name}", "text": "\n\n".join(text)})
    return docs


def _walk(body: list[ast.stmt], prefix: str):
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            qual = prefix + node.name
            yield node, qual
            if isinstance(node, ast.ClassDef):
                yield from _walk(node.body, qual + ".")


def main() -> int:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = Path(__file__).with_name("python_docs.jsonl")
    docs = reference() + module_docs(stdlib)
    with open(out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)
    print(f"{out}: {len(docs)} documents, {out.stat().st_size} bytes from Python {sys.version.split()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
