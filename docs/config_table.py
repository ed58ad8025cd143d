"""The field table of docs/config.md, generated from the job config's dataclasses (megascale/config.py).

    python docs/config_table.py           rewrite the table: field, type and default from the code
    python docs/config_table.py --check   exit 1 if the table and the code disagree

Field names, types and defaults come from the code, so they cannot drift; the meaning column is
prose, kept from the current table by field name. A field without a meaning fails either way.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Iterator, Literal

from megascale.config import JobConfig

PAGE = Path(__file__).with_name("config.md")
START, END = "<!-- config-table:start -->", "<!-- config-table:end -->"
HEADER = ["| field | type | default | meaning |", "|---|---|---|---|"]


def fields(cls: type, defaults: dict, prefix: str = "") -> Iterator[tuple[str, str, str]]:
    """(YAML path, type, default) of every leaf field. `defaults` is the YAML form of a default
    instance (`JobConfig().to_dict()`): its keys are the YAML names, in field order."""
    hints = typing.get_type_hints(cls)
    for f, (key, value) in zip(dataclasses.fields(cls), defaults.items()):
        path = f"{prefix}{key}"
        if dataclasses.is_dataclass(hints[f.name]):
            yield from fields(hints[f.name], value, path + ".")
        else:
            yield path, type_name(hints[f.name]), default_text(value)


def type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):  # Optional[X], X | None
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is dict:
        return "mapping of names to strings"
    if hint is tuple or origin is tuple:  # YAML writes a tuple as a list
        count = "" if not args or args[-1] is Ellipsis else f"{len(args)} "
        return f"list of {count}numbers"
    return hint.__name__


def default_text(value: Any) -> str:
    if value in ("", None):
        return "`null`" if value is None else '`""`'
    return f"`{value}`" if isinstance(value, str) else f"`{json.dumps(value)}`"


def current_meanings(page: str) -> dict[str, str]:
    """Meaning by field from the table now in the page (rows: | `field` | type | default | meaning |)."""
    body = page.split(START, 1)[1].split(END, 1)[0]
    meanings = {}
    for line in body.strip().splitlines()[len(HEADER):]:
        field, _, _, meaning = line.strip().strip("|").split("|", 3)
        meanings[field.strip().strip("`")] = meaning.strip()
    return meanings


def table(meanings: dict[str, str]) -> tuple[str, list[str]]:
    """The generated table, and the fields that have no meaning yet."""
    rows, missing = list(HEADER), []
    for path, kind, default in fields(JobConfig, JobConfig().to_dict()):
        if not meanings.get(path):
            missing.append(path)
        rows.append(f"| `{path}` | {kind} | {default} | {meanings.get(path, '')} |")
    return "\n".join(rows), missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the page is out of date")
    args = parser.parse_args()
    page = PAGE.read_text()
    before, rest = page.split(START, 1)
    old, after = rest.split(END, 1)
    meanings = current_meanings(page)
    new, missing = table(meanings)
    gone = sorted(set(meanings) - {path for path, _, _ in fields(JobConfig, JobConfig().to_dict())})
    updated = f"{before}{START}\n{new}\n{END}{after}"
    if missing:
        print(f"{PAGE}: write a meaning for: {', '.join(missing)}", file=sys.stderr)
    if gone:
        print(f"{PAGE}: no longer in the code, dropped: {', '.join(gone)}", file=sys.stderr)
    if args.check:
        if updated != page:
            print(f"{PAGE}: the table differs from megascale/config.py; run python docs/config_table.py",
                  file=sys.stderr)
        return int(updated != page or bool(missing))
    PAGE.write_text(updated)
    return int(bool(missing))


if __name__ == "__main__":
    sys.exit(main())
