"""What the API server does with a CRD's schema, done offline: structural-schema checks, defaulting,
validation (jsonschema), and the CEL rules through a Python stand-in.

The CEL stand-in understands the subset the CRD uses (field access on `self` and `oldSelf`, integer
arithmetic, comparisons, &&, ||, !, has()); transition rules (those naming oldSelf) run on updates only,
where the old object has the field, as the API server runs them. It checks what the rules *mean* on
examples, not that a real CEL compiler accepts them (test_crd_transitions.py compares it with cel-python).
"""
from __future__ import annotations

import copy
import re
from typing import Any, Iterator

import jsonschema

SCHEMA_KEYS = ("properties", "items", "additionalProperties")
FORBIDDEN_IN_JUNCTORS = ("type", "description", "default", "additionalProperties", "nullable")


class Invalid(ValueError):
    """A custom resource the API server would refuse (422), with the field path."""


# -- structural schema ---------------------------------------------------------------------------

def structural_errors(schema: dict, path: str = "") -> list[str]:
    """Violations of the rules for structural schemas (apiextensions.k8s.io/v1 refuses a CRD with any)."""
    errors = []
    special = schema.get("x-kubernetes-int-or-string") or schema.get("x-kubernetes-preserve-unknown-fields")
    if not schema.get("type") and not special:
        errors.append(f"{path or '.'}: no type")
    if "properties" in schema and "additionalProperties" in schema:
        errors.append(f"{path}: both properties and additionalProperties")
    for junctor in ("allOf", "anyOf", "oneOf", "not"):
        parts = schema.get(junctor)
        for part in (parts if isinstance(parts, list) else [parts] if parts else []):
            for key in FORBIDDEN_IN_JUNCTORS:
                if key in part and not (key == "type" and schema.get("x-kubernetes-int-or-string")):
                    errors.append(f"{path}.{junctor}: {key} is not allowed inside {junctor}")
            for field in part.get("required", []) + list(part.get("properties", {})):
                if field not in schema.get("properties", {}):
                    errors.append(f"{path}.{junctor}: {field} is not among the properties outside it")
    for name, sub in (schema.get("properties") or {}).items():
        errors += structural_errors(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        errors += structural_errors(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        errors += structural_errors(schema["additionalProperties"], f"{path}.*")
    return errors


# -- defaulting, validation, CEL -------------------------------------------------------------------

def apply_defaults(schema: dict, value: Any) -> Any:
    """Fills absent fields that have a default, outermost first (as the API server does on admission)."""
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
        if isinstance(schema.get("additionalProperties"), dict):
            for name in value:
                value[name] = apply_defaults(schema["additionalProperties"], value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def to_jsonschema(schema: dict, root: bool = True) -> dict:
    """OpenAPI v3 (Kubernetes flavour) as JSON Schema. Unknown fields are refused, as kubectl's default
    strict field validation does (the API server would prune them for other clients)."""
    out = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes") and k != "nullable"}
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if schema.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in schema:
        out["properties"] = {k: to_jsonschema(v, root=False) for k, v in schema["properties"].items()}
        if root and "metadata" in out["properties"]:  # it restricts only the name; labels, uid... are fine
            out["properties"]["metadata"].pop("additionalProperties", None)
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            out[key] = to_jsonschema(schema[key], root=False)
    for junctor in ("allOf", "anyOf", "oneOf"):
        if junctor in schema:
            out[junctor] = [to_jsonschema(part, root=False) if "properties" in part else part
                            for part in schema[junctor]]
    return out


def admit(schema: dict, obj: dict, old: Any = None) -> dict:
    """The object as stored: defaults applied, then validated (`old`: the stored one, on an update); raises
    Invalid naming the field."""
    obj = apply_defaults(schema, copy.deepcopy(obj))
    validator = jsonschema.Draft202012Validator(to_jsonschema(schema))
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        where = ".".join(str(p) for p in e.absolute_path) or "<root>"
        raise Invalid(f"{where}: {e.message}")
    for where, message in cel_errors(schema, obj, "", MISSING if old is None else old):
        raise Invalid(f"{where or '<root>'}: {message}")
    return obj


MISSING = object()  # no old value at this path: a create, or a field the old object lacked


def cel_errors(schema: dict, value: Any, path: str, old: Any = MISSING) -> Iterator[tuple[str, str]]:
    for rule in schema.get("x-kubernetes-validations") or []:
        if "oldSelf" in rule["rule"] and old is MISSING:
            continue
        try:
            ok = evaluate(rule["rule"], value, old)
        except (KeyError, TypeError, ZeroDivisionError) as e:
            ok, rule = False, {**rule, "message": f"{rule.get('message', rule['rule'])} ({type(e).__name__}: {e})"}
        if not ok:
            yield path, rule.get("message") or f"failed rule: {rule['rule']}"
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                yield from cel_errors(sub, value[name], f"{path}.{name}" if path else name,
                                      old.get(name, MISSING) if isinstance(old, dict) else MISSING)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from cel_errors(schema["items"], item, f"{path}[{i}]")


class _Self:
    def __init__(self, data: dict):
        self._data = data

    def __getattr__(self, name: str) -> Any:
        value = self._data[name]  # KeyError: CEL's "no such key"
        return _Self(value) if isinstance(value, dict) else value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Self) and self._data == other._data


def evaluate(rule: str, value: Any, old: Any = MISSING) -> bool:
    if not re.fullmatch(r"[\w\s.*%+\-=!<>&|()]+", rule):
        raise TypeError(f"rule outside the supported CEL subset: {rule}")
    text = rule.replace("&&", " and ").replace("||", " or ")
    text = re.sub(r"!(?!=)", " not ", text)
    text = re.sub(r"has\((self|oldSelf)\.([\w.]+)\)", lambda m: f"_has({m.group(1)}, {m.group(2)!r})", text)

    def _has(obj: _Self, dotted: str) -> bool:
        data: Any = obj._data
        for part in dotted.split("."):
            if not isinstance(data, dict) or part not in data:
                return False
            data = data[part]
        return True
    def wrap(v: Any) -> Any:
        return _Self(v) if isinstance(v, dict) else v
    return bool(eval(text, {"__builtins__": {}}, {"self": wrap(value), "oldSelf": wrap(old), "_has": _has}))
