"""The shared reader of dataclasses: what each set of rules accepts, where a refusal points, the inverse
writer, and a schema that admits exactly what the reader takes."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal, Optional

import jsonschema
import pytest

from megascale.common import typed


class Color(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass
class Inner:
    count: int
    ratio: float = 1.0
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Outer:
    name: str
    inner: Inner
    items: list[Inner] = field(default_factory=list)
    color: Color = Color.RED
    mode: Literal["a", "b"] = "a"
    pair: tuple[float, float] = (0.0, 1.0)
    tags: Optional[tuple[str, ...]] = None
    global_: int = 0


GOOD = {"name": "x", "inner": {"count": 2, "ratio": 3, "env": {"A": 22, "B": "b"}},
        "items": [{"count": 1}], "color": "blue", "mode": "b", "pair": [0.5, 2], "tags": ["t"], "global": 7}


def test_reads_nested_types_and_writes_them_back():
    obj = typed.read(Outer, GOOD)
    assert obj == Outer("x", Inner(2, 3.0, {"A": "22", "B": "b"}), [Inner(1)], Color.BLUE, "b", (0.5, 2.0), ("t",), 7)
    assert typed.read(Outer, typed.to_plain(obj)) == obj
    assert typed.to_plain(obj)["global"] == 7 and list(typed.hints(Outer))[-1] == "global"


@pytest.mark.parametrize("change, where, message", [
    ({"inner": {"count": True}}, "inner.count", "inner.count=True: must be an integer"),
    ({"inner": {"count": 1, "ratio": "x"}}, "inner.ratio", "inner.ratio='x': must be a number"),
    ({"items": [{"count": 1}, {"count": "2"}]}, "items[1].count", "items[1].count='2': must be an integer"),
    ({"items": [{}]}, "items[0]", "items[0]: missing field 'count'"),
    ({"color": "green"}, "color", "color='green': must be one of red, blue"),
    ({"mode": ["a"]}, "mode", "mode=['a']: must be one of a, b"),
    ({"pair": [1.0]}, "pair", "pair=[1.0]: must be a list of 2 numbers"),
    ({"inner": {"count": 1, "env": {"A": [1]}}}, "inner.env", "inner.env: must be a mapping of names to strings"),
    ({"inner": []}, "inner", "inner: expected a mapping, got list"),
])
def test_a_refusal_names_the_field_in_one_line(change, where, message):
    with pytest.raises(typed.Invalid) as e:
        typed.read(Outer, {**GOOD, **change})
    assert e.value.at() == where and message in str(e.value) and "\n" not in str(e.value)


def test_unknown_fields_are_ignored_or_refused_by_the_rules():
    assert typed.read(Inner, {"count": 1, "newer": 2}) == Inner(1)
    with pytest.raises(typed.Invalid, match=r"^zz: unknown field \(known: count, env, ratio\)$"):
        typed.read(Inner, {"count": 1, "zz": 2, "zzz": 3}, typed.Rules(forbid_unknown=True))


def test_none_is_the_defaults_only_when_the_rules_say_so():
    assert typed.read(Optional[Inner], None) is None
    with pytest.raises(typed.Invalid):
        typed.read(Inner, None)
    with pytest.raises(typed.Invalid, match="missing field 'count'"):  # the defaults still need `count`
        typed.read(Inner, None, typed.Rules(none_is_default=True))


def test_command_line_text():
    text = typed.Rules(text=True)
    assert typed.read(int, "3", text) == 3 and typed.read(float, "0.5", text) == 0.5
    assert typed.read(bool, "Yes", text) is True and typed.read(bool, "off", text) is False
    assert typed.read(Optional[tuple[str, ...]], " a, b,", text) == ("a", "b")
    assert typed.read(Optional[float], "none", text) is None and typed.read(str, 2024, text) == "2024"
    for hint, value in ((int, "3"), (bool, "yes"), (str, 2024)):  # none of it outside text
        with pytest.raises(typed.Invalid):
            typed.read(hint, value)
    with pytest.raises(typed.Invalid, match=r"^value='2.5': must be an integer$"):
        typed.read(int, "2.5", text)


def test_the_schema_admits_what_the_reader_reads_and_refuses_the_rest():
    schema = typed.schema(Outer)
    assert schema["required"] == ["name", "inner"] and schema["properties"]["tags"]["nullable"] is True
    del schema["properties"]["tags"]  # `nullable` is OpenAPI's: jsonschema would refuse the None it allows
    jsonschema.validate(GOOD, schema)
    for bad in ({"color": "green"}, {"pair": [1.0]}, {"inner": {"count": "1"}}, {"items": [{"ratio": 1.0}]}):
        with pytest.raises(typed.Invalid):
            typed.read(Outer, {**GOOD, **bad})
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**GOOD, **bad}, schema)
