"""Attribute specs of the LLM-level ops: which attrs each op takes and the JSON kind of each. The
runtime checks a plan's attrs against them at load (and the compiler before writing a plan), so a
tampered attr is refused by name instead of failing deep inside a kernel."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

MAX_COUNT = 1 << 31      # heads, features, sizes: far beyond any model, far below overflow
MAX_LIST = 4096


@dataclass(frozen=True)
class AttrKind:
    name: str                          # what the message says a value must be
    test: Callable[[Any], bool]


def _exact_in(value: Any, choices: tuple) -> bool:
    return any(type(value) is type(c) and value == c for c in choices)


INT = AttrKind("an int", lambda v: type(v) is int and abs(v) <= MAX_COUNT)
COUNT = AttrKind("a positive int", lambda v: type(v) is int and 0 < v <= MAX_COUNT)
INDEX = AttrKind("a non-negative int", lambda v: type(v) is int and 0 <= v <= MAX_COUNT)
FLOAT = AttrKind("a finite number", lambda v: type(v) in (int, float) and math.isfinite(v))
# Numbers whose absurd values run without complaint and print garbage (eps -1 or 1e38): bounded far
# beyond any real model's (eps ~1e-6, attention scales 1/sqrt(head_dim), softcaps ~30, rope factors ~64).
EPS = AttrKind("a norm epsilon in [0, 1]", lambda v: type(v) in (int, float) and 0 <= v <= 1)
SCALE = AttrKind("a positive number up to 1e6", lambda v: type(v) in (int, float) and 0 < v <= 1e6)
BOOL = AttrKind("true or false", lambda v: type(v) is bool)
STRING = AttrKind("a string", lambda v: isinstance(v, str) and len(v) <= 256)
LIST = AttrKind("a list", lambda v: isinstance(v, list))
OBJECT = AttrKind("an object", lambda v: isinstance(v, dict))


def one_of(*choices) -> AttrKind:
    return AttrKind(f"one of {', '.join(map(repr, choices))}", lambda v: _exact_in(v, choices))


def optional(kind: AttrKind) -> AttrKind:
    return AttrKind(f"null or {kind.name}", lambda v: v is None or kind.test(v))


def list_of(kind: AttrKind) -> AttrKind:
    return AttrKind(f"a non-empty list of {kind.name}",
                    lambda v: isinstance(v, list) and 0 < len(v) <= MAX_LIST and all(kind.test(x) for x in v))


def object_of(**fields: AttrKind) -> AttrKind:
    """A JSON object with exactly these keys, each of its kind."""
    shown = ", ".join(f"{k}: {f.name}" for k, f in fields.items())
    return AttrKind(f"{{{shown}}}", lambda v: isinstance(v, dict) and set(v) == set(fields)
                    and all(f.test(v[k]) for k, f in fields.items()))


@dataclass(frozen=True)
class AttrSpec:
    required: dict[str, AttrKind] = field(default_factory=dict)
    optional: dict[str, AttrKind] = field(default_factory=dict)

    def refusal(self, attrs: dict) -> str | None:
        """Why `attrs` do not fit this spec (a missing, unknown or ill-typed attr), or None."""
        for name in self.required:
            if name not in attrs:
                return f"attr {name!r} is missing"
        kinds = {**self.required, **self.optional}
        for name, value in attrs.items():
            kind = kinds.get(name)
            if kind is None:
                return f"attr {name!r} is not one this op takes ({', '.join(sorted(kinds)) or 'none'})"
            if not kind.test(value):
                shown = repr(value)
                return f"attr {name!r} is {shown if len(shown) <= 60 else shown[:57] + '...'}, not {kind.name}"
        return None


__all__ = ["AttrKind", "AttrSpec", "INT", "COUNT", "INDEX", "FLOAT", "EPS", "SCALE", "BOOL", "STRING", "LIST", "OBJECT",
           "one_of", "optional", "list_of", "object_of"]
