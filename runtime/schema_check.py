"""A small JSON Schema checker for the subset our profile schema uses (no extra dependency).

Supports: type (incl. lists and "null"), properties, required, additionalProperties (bool),
items, enum, const, minimum, exclusiveMinimum, maximum, minItems, maxItems. Errors carry the
field path (``cost_model.t_ar_ms``) so messages can name the field.
"""

from __future__ import annotations

import math
from typing import Any

_TYPES = {
    "object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
    "integer": int, "number": (int, float),
}


class SchemaViolation(ValueError):
    def __init__(self, path: str, message: str):
        super().__init__(f"{path or '(top level)'}: {message}")
        self.path, self.message = path, message


def _is(value: Any, kind: str) -> bool:
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    if kind == "number" and isinstance(value, float) and not math.isfinite(value):
        return False  # JSON readers accept NaN and Infinity; no profile field may hold them
    return isinstance(value, _TYPES[kind])


def check(value: Any, schema: dict, path: str = "") -> None:
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_is(value, k) for k in kinds):
            got = f"{value}" if isinstance(value, float) else f"{type(value).__name__} {value!r:.40}"
            raise SchemaViolation(path, f"expected a finite {' or '.join(kinds)}, got {got}" if "number" in kinds
                                  else f"expected {' or '.join(kinds)}, got {got}")
    if "const" in schema and value != schema["const"]:
        raise SchemaViolation(path, f"must be {schema['const']!r}, got {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        raise SchemaViolation(path, f"must be one of {schema['enum']}, got {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            raise SchemaViolation(path, f"must be >= {schema['minimum']}, got {value}")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            raise SchemaViolation(path, f"must be > {schema['exclusiveMinimum']}, got {value}")
        if "maximum" in schema and value > schema["maximum"]:
            raise SchemaViolation(path, f"must be <= {schema['maximum']}, got {value}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                raise SchemaViolation(f"{path}.{name}" if path else name, "missing required field")
        for name, item in value.items():
            sub = f"{path}.{name}" if path else name
            if name in props:
                check(item, props[name], sub)
            elif schema.get("additionalProperties") is False:
                raise SchemaViolation(sub, "unknown field")
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            raise SchemaViolation(path, f"needs at least {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            raise SchemaViolation(path, f"holds at most {schema['maxItems']} items")
        if "items" in schema:
            for i, item in enumerate(value):
                check(item, schema["items"], f"{path}[{i}]")
