"""Typed reads of a JSON config: every bad or missing field gets a message that names it.

`json.load` gives back whatever the file holds; without these checks a string where an int
belongs (`"block_size": "seven"`) surfaces much later as a `TypeError` deep inside model
construction, with nothing that points at the file or the field.
"""

from __future__ import annotations

import json
from typing import Any

_MISSING = object()


def read_json_object(path: str, what: str) -> dict[str, Any]:
    """Parses `path` and requires a JSON object; errors name the file and say what it should be."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path!r} is not valid JSON ({e}); expected the {what} as a JSON object") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{path!r} is not a UTF-8 text file; expected the {what} as a JSON object") from e
    if not isinstance(d, dict):
        raise ValueError(f"{path!r} holds a JSON {_json_type(d)}; expected the {what} as a JSON object {{...}}")
    return d


def _json_type(v) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object", type(None): "null"}.get(type(v), type(v).__name__)


class Fields:
    """Typed getters over one JSON object; `source` prefixes every message (e.g. the file)."""

    def __init__(self, d: dict[str, Any], source: str):
        self.d = d
        self.source = source

    def __contains__(self, name: str) -> bool:
        return self.d.get(name) is not None

    def _get(self, name, default):
        v = self.d.get(name)
        if v is None:
            if default is _MISSING:
                raise ValueError(f"{self.source}: required field {name!r} is missing")
            return default, True
        return v, False

    def _bad(self, name, v, want):
        return ValueError(f"{self.source}: field {name!r} must be {want}, got {json.dumps(v)} (a {_json_type(v)})")

    def int(self, name: str, default=_MISSING, *, minimum: int | None = None) -> int:
        v, dflt = self._get(name, default)
        if dflt:
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._bad(name, v, "an integer")
        if minimum is not None and v < minimum:
            raise ValueError(f"{self.source}: field {name!r} must be >= {minimum}, got {v}")
        return v

    def float(self, name: str, default=_MISSING) -> float:
        v, dflt = self._get(name, default)
        if dflt:
            return v
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self._bad(name, v, "a number")
        return float(v)

    def bool(self, name: str, default=_MISSING) -> bool:
        v, dflt = self._get(name, default)
        if dflt:
            return v
        if not isinstance(v, bool):
            raise self._bad(name, v, "true or false")
        return v

    def str(self, name: str, default=_MISSING) -> str:
        v, dflt = self._get(name, default)
        if dflt:
            return v
        if not isinstance(v, str):
            raise self._bad(name, v, "a string")
        return v

    def int_list(self, name: str, default=_MISSING) -> tuple[int, ...]:
        v, dflt = self._get(name, default)
        if dflt:
            return v
        if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
            raise self._bad(name, v, "a list of integers")
        return tuple(v)

    def float_list(self, name: str, default=_MISSING) -> tuple[float, ...]:
        v, dflt = self._get(name, default)
        if dflt:
            return v
        if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int | float) for x in v):
            raise self._bad(name, v, "a list of numbers")
        return tuple(float(x) for x in v)
