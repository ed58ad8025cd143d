"""Plain data (JSON, YAML, command-line text) read into dataclasses by their type hints, and the OpenAPI
schema of what is read: the one reader behind the job config, the wire messages, the diagnostics config,
the driver's records and the TrainingJob CRD.

Hand-written, not pydantic: the dataclasses stay plain objects that everything builds, compares and copies,
and each caller keeps its one-line errors (`model.layers='four': must be an integer`, `heartbeat.seq='3':
expected int`). Pydantic would rewrite every message ("1 validation error for ... Input should be a valid
integer") and coerce what is refused today (its lax mode takes "3" for an int on the wire); translating
both back for every caller would take more code than this module.

Read: dataclasses, field by field (a Python keyword's trailing "_" is dropped: `global_` is "global");
X | None; Literal; Enum (by value); bool, int, float (an int is taken), str; list[X]; tuple[X, ...] and
tuple[X, Y]; dict; dict[str, X]. A bool is never a number. The values of dict[str, str] may be numbers
or booleans, read as text: environment-style mappings, where YAML's `NCCL_IB_TIMEOUT: 22` means "22".
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import itertools
import keyword
import math
import types
import typing
from typing import Any, Callable, Literal, TypeVar, Union

T = TypeVar("T")
_Convert = Callable[[Any], Any]

_TRUE, _FALSE, _NONE = ("1", "true", "yes", "on"), ("0", "false", "no", "off"), ("", "none", "null")


@dataclasses.dataclass(frozen=True)
class Rules:
    """How lenient a reader is, by who wrote the data. The default suits records one program writes for
    another: fields it does not know are ignored (a newer writer), and types must be exact."""

    forbid_unknown: bool = False  # a field the class lacks is an error: a typo, in a file people write
    none_is_default: bool = False  # a dataclass given None gets its defaults (YAML's empty `model:`)
    text: bool = False  # command-line text: "3", "0.5", "yes", "a,b" for a tuple, "none" for None


class Invalid(ValueError):
    """Data that does not fit its type. `describe` says why in one line naming the field; callers with
    a voice of their own (the wire messages) build theirs from the attributes."""

    def __init__(self, problem: Literal["type", "unknown", "missing"], value: Any = None, expected: Any = None,
                 name: str = "", known: tuple[str, ...] = ()):
        super().__init__(problem)
        self.problem, self.value, self.expected = problem, value, expected  # expected: the type hint refused
        self.name, self.known = name, known  # unknown or missing: the field, and the fields there are
        self.path: tuple[str | int, ...] = ()  # field names and list indices down to where it happened

    def at(self, root: str = "") -> str:
        """Where it happened, e.g. `model.layers` or (root "heartbeat") `heartbeat.ranks[0].state`."""
        where = root
        for part in self.path:
            where = f"{where}[{part}]" if isinstance(part, int) else f"{where}.{part}" if where else part
        return where

    def describe(self, root: str = "value") -> str:
        """One line; `root` names the whole value when that is what was refused."""
        where = self.at()
        if self.problem == "unknown":
            return f"{where + '.' if where else ''}{self.name}: unknown field (known: {', '.join(self.known)})"
        where = where or root
        if self.problem == "missing":
            return f"{where}: missing field {self.name!r}"
        if dataclasses.is_dataclass(self.expected):
            return f"{where}: expected a mapping, got {type(self.value).__name__}"
        if _origin(self.expected) is dict:  # the whole mapping, however long, is not repeated
            return f"{where}: must be {expected_words(self.expected)}"
        return f"{where}={self.value!r}: must be {expected_words(self.expected)}"

    def __str__(self) -> str:
        return self.describe()


def read(hint: type[T], value: Any, rules: Rules = Rules()) -> T:
    """`value` as an instance of `hint` (a dataclass, or any type listed above); raises Invalid."""
    return _converter(hint, rules)(value)


def hints(cls: type) -> dict[str, Any]:
    """A dataclass's fields as they are read and written (external name -> type hint), in order."""
    return {name: hint for name, _, hint, _ in _fields(cls)}


def external_name(attribute: str) -> str:
    return attribute[:-1] if attribute.endswith("_") and keyword.iskeyword(attribute[:-1]) else attribute


def to_plain(value: Any) -> Any:
    """The inverse of `read`: dataclasses as dicts by external name, tuples as lists, enums by value."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {external_name(f.name): to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def expected_words(hint: Any) -> str:
    """What a value of `hint` must be, as the end of "x=…: must be …"."""
    origin, args = _origin(hint), typing.get_args(hint)
    if hint in _WORDS:
        return _WORDS[hint]
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if _is_enum(hint):
        return "one of " + ", ".join(str(m.value) for m in hint)
    if origin is dict and args:
        return "a mapping of names to " + ("strings or numbers" if args[1] is str else _PLURALS.get(args[1], "values"))
    if origin in (list, tuple) and args:
        count = "" if origin is list or args[-1] is Ellipsis else f"{len(args)} "
        return f"a list of {count}{_PLURALS.get(args[0], 'values')}"
    return {dict: "a mapping", list: "a list"}.get(origin or hint, str(hint))


_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_PLURALS = {bool: "true or false values", int: "integers", float: "numbers", str: "strings"}


# -- readers, compiled once per (type, rules): the wire messages are read for every heartbeat ------------

def _origin(hint: Any) -> Any:
    origin = typing.get_origin(hint)
    return Union if origin is types.UnionType else origin


def _is_enum(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, enum.Enum)


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, str, Any, bool], ...]:
    """(external name, attribute, hint, required) per field of a dataclass."""
    resolved = typing.get_type_hints(cls)
    return tuple((external_name(f.name), f.name, resolved[f.name],
                  f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for f in dataclasses.fields(cls) if f.init)


def _refuse(value: Any, hint: Any) -> Invalid:
    return Invalid("type", value, hint)


@functools.cache
def _converter(hint: Any, rules: Rules) -> _Convert:
    origin, args = _origin(hint), typing.get_args(hint)
    if origin is Union:
        return _optional(hint, rules)
    if dataclasses.is_dataclass(hint):
        return _dataclass(hint, rules)
    if origin is Literal or _is_enum(hint):
        return _choice(hint)
    if hint in _WORDS:  # bool, int, float, str
        return _scalar(hint, rules)
    if hint in (dict, list):
        def exact(value: Any) -> Any:
            if type(value) is hint:
                return value
            raise _refuse(value, hint)
        return exact
    if origin is list and args:
        return _list(hint, _converter(args[0], rules))
    if origin is tuple and args:
        return _tuple(hint, rules)
    if origin is dict and args:
        return _dict(hint, rules)
    raise TypeError(f"typed: no reader for {hint}")  # a new field type: teach this module


def _optional(hint: Any, rules: Rules) -> _Convert:
    inner = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(inner) != 1:
        raise TypeError(f"typed: no reader for {hint} (only X | None)")
    convert = _converter(inner[0], rules)

    def optional(value: Any) -> Any:
        if value is None or (rules.text and type(value) is str and value.strip().lower() in _NONE):
            return None
        return convert(value)
    return optional


def _unchanged(hint: Any, rules: Rules) -> frozenset[type]:
    """Value types a field of `hint` takes as they are: the build loop skips its converter for them (most
    fields of a heartbeat are such scalars; the call per field was most of the driver's decode time)."""
    if hint in _WORDS:
        return frozenset({hint})  # an int for a float is converted; a bool is never an int here (exact type)
    if _origin(hint) is Union:
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        kept = _unchanged(inner[0], rules) if len(inner) == 1 else frozenset()
        return (kept - {str} if rules.text else kept) | {type(None)}  # text mode reads "none" as None
    return frozenset()


def _words(hint: Any) -> frozenset[str]:
    """The values of a Literal of strings, which the build loop takes as they are (like `_unchanged`)."""
    args = typing.get_args(hint) if _origin(hint) is Literal else ()
    return frozenset(args) if args and all(type(a) is str for a in args) else frozenset()


def _dataclass(cls: type, rules: Rules) -> _Convert:
    fields = [(name, attribute, _converter(hint, rules), required, _unchanged(hint, rules), _words(hint))
              for name, attribute, hint, required in _fields(cls)]
    names = frozenset(name for name, *_ in fields)

    def build(value: Any) -> Any:
        if type(value) is not dict:
            if value is not None or not rules.none_is_default:
                raise _refuse(value, cls)
            value = {}
        if rules.forbid_unknown and not names.issuperset(value):
            raise Invalid("unknown", name=str(min(set(value) - names, key=str)), known=tuple(sorted(names)))
        kwargs = {}
        for name, attribute, convert, required, unchanged, words in fields:
            if name in value:
                given = value[name]
                if type(given) in unchanged or (type(given) is str and given in words):
                    kwargs[attribute] = given
                    continue
                try:
                    kwargs[attribute] = convert(given)
                except Invalid as e:
                    e.path = (name, *e.path)
                    raise
            elif required:
                raise Invalid("missing", name=name)
        return cls(**kwargs)
    return build


def _choice(hint: Any) -> _Convert:
    if _is_enum(hint):
        def member(value: Any) -> Any:
            try:
                return hint(value)
            except (ValueError, TypeError):
                raise _refuse(value, hint) from None
        return member
    allowed = frozenset(typing.get_args(hint))
    kinds = frozenset(type(a) for a in allowed)

    def choice(value: Any) -> Any:
        if type(value) in kinds and value in allowed:
            return value
        raise _refuse(value, hint)
    return choice


def _scalar(kind: type, rules: Rules) -> _Convert:
    taken = (float, int) if kind is float else (kind,)  # an int is a number; a bool is never one
    parse = _from_text(kind) if rules.text else None

    def scalar(value: Any) -> Any:
        if type(value) in taken:
            return kind(value)
        if parse is not None:
            try:
                return parse(value)
            except ValueError:
                pass
        raise _refuse(value, kind)
    return scalar


def _from_text(kind: type) -> _Convert:
    """Command-line text as `kind` ("3", "0.5", "yes"); for a str, a number (YAML's 2024) as text."""
    def parse(value: Any) -> Any:
        if kind is bool and str(value).strip().lower() in _TRUE + _FALSE:
            return str(value).strip().lower() in _TRUE
        if kind is str and type(value) in (int, float):
            return str(value)
        if kind in (int, float) and type(value) is str:
            return kind(value)  # ValueError for what is not one
        raise ValueError(value)
    return parse


def _list(hint: Any, item: _Convert) -> _Convert:
    def items(value: Any) -> list:
        if type(value) is not list:
            raise _refuse(value, hint)
        out = []
        for index, v in enumerate(value):
            try:
                out.append(item(v))
            except Invalid as e:
                e.path = (index, *e.path)
                raise
        return out
    return items


def _tuple(hint: Any, rules: Rules) -> _Convert:
    args = typing.get_args(hint)
    variadic = args[-1] is Ellipsis
    converters = [_converter(a, rules) for a in (args[:1] if variadic else args)]

    def sequence(value: Any) -> tuple:
        if rules.text and type(value) is str:
            value = [part.strip() for part in value.split(",") if part.strip()]
        if type(value) not in (list, tuple) or not (variadic or len(value) == len(converters)):
            raise _refuse(value, hint)
        try:  # the whole list is named (`optimizer.betas=[0.9, 'x']`): tuples are short
            return tuple(convert(v) for convert, v in zip(itertools.cycle(converters), value))
        except Invalid:
            raise _refuse(value, hint) from None
    return sequence


def _dict(hint: Any, rules: Rules) -> _Convert:
    key_hint, value_hint = typing.get_args(hint)
    key = _converter(key_hint, rules)
    entry = _as_text if value_hint is str else _converter(value_hint, rules)

    def mapping(value: Any) -> dict:
        if type(value) is not dict:
            raise _refuse(value, hint)
        try:
            return {key(k): entry(v) for k, v in value.items()}
        except Invalid:
            raise _refuse(value, hint) from None
    return mapping


def _as_text(value: Any) -> str:
    if type(value) in (str, int, float, bool):
        return str(value)
    raise _refuse(value, str)


# -- the schema ---------------------------------------------------------------------------------

_SCHEMA_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def schema(hint: Any) -> dict:
    """The OpenAPI 3.0 schema of what `read` accepts, e.g. for a CRD: a dataclass's properties in field
    order and its required fields; the values of dict[str, str] as `anyOf` string, number, boolean (read
    as text). Unknown fields are left to whoever applies it (Kubernetes refuses them when strict)."""
    origin, args = _origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        found: dict = {"type": "object", "properties": {name: schema(h) for name, h in hints(hint).items()}}
        required = [name for name, _, _, needed in _fields(hint) if needed]
        return {**found, "required": required} if required else found
    if origin is Union:
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"typed: no schema for {hint} (only X | None)")
        return {**schema(inner[0]), "nullable": True}
    if origin is Literal or _is_enum(hint):
        values = list(args) if origin is Literal else [m.value for m in hint]
        return {"type": _SCHEMA_TYPES[type(values[0])], "enum": values}
    if hint in _SCHEMA_TYPES:
        return {"type": _SCHEMA_TYPES[hint]}
    if origin is dict and args:
        text = {"anyOf": [{"type": t} for t in ("string", "number", "boolean")]}
        return {"type": "object", "additionalProperties": text if args[1] is str else schema(args[1])}
    if origin in (list, tuple) and args:
        fixed = origin is tuple and args[-1] is not Ellipsis
        if fixed and len(set(args)) != 1:
            raise TypeError(f"typed: no schema for {hint} (OpenAPI 3.0 has no mixed tuples)")
        found = {"type": "array", "items": schema(args[0])}
        return {**found, "minItems": len(args), "maxItems": len(args)} if fixed else found
    raise TypeError(f"typed: no schema for {hint}")  # a new field type: teach this module


def _finite_number(text: str, zero_allowed: bool, words: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 <= value if zero_allowed else 0 < value) or value == math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not {words}")
    return value


def positive_number(text: str) -> float:
    """An argparse type: a finite number above 0 (`nan` and `inf` would reach tc's rate as garbage)."""
    return _finite_number(text, False, "a positive number")


def non_negative_number(text: str) -> float:
    """An argparse type: a finite number, 0 or more (where 0 means a default: `nan` must not pass as one)."""
    return _finite_number(text, True, "a number >= 0")
