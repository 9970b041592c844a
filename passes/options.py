"""Typed pass options: a pass declares a frozen dataclass of its options (type, default, help,
allowed values). Values arrive as Python values (from the API) or strings (from `--pass-option`
and `--passes name:key=value`); they are coerced and validated here, once, when the pass is
configured, with errors naming the pass, the option and what is allowed."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, ClassVar

from llmc.errors import PassError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"none", "null"}


def option(default: Any, help: str, *, choices: tuple | None = None, low: float | None = None,
           high: float | None = None, strict: bool = False) -> Any:
    """A dataclass field of a PassOptions class: `choices` lists the allowed values; `low`/`high`
    bound numbers (exclusive bounds with `strict`)."""
    meta = {"help": help, "choices": choices, "low": low, "high": high, "strict": strict}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class PassOptions:
    """Base of every pass's options class; `pass_name` is set when the pass registers."""
    pass_name: ClassVar[str] = "?"

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = coerce(self.pass_name, f.name, getattr(self, f.name), hints[f.name])
            check_bounds(self.pass_name, f, value)
            object.__setattr__(self, f.name, value)
        self.validate()

    def validate(self) -> None:
        """Checks across options; subclasses raise self.invalid(...)."""

    def invalid(self, message: str) -> PassError:
        return PassError(f"pass {self.pass_name!r}: {message}")

    @classmethod
    def build(cls, values: dict[str, Any]) -> PassOptions:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise PassError(f"pass {cls.pass_name!r} has no option {unknown[0]!r}; valid options: "
                            f"{', '.join(sorted(names)) or 'none'}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **values) -> PassOptions:
        return type(self).build({**self.to_dict(), **values})

    @classmethod
    def describe(cls) -> list[dict]:
        """One entry per option: name, type, default, help, and its choices or bounds."""
        hints = typing.get_type_hints(cls)
        out = []
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            entry = {"name": f.name, "type": type_name(hints[f.name]), "default": default,
                     "description": f.metadata.get("help", "")}
            entry.update({k: f.metadata[k] for k in ("choices", "low", "high") if f.metadata.get(k) is not None})
            out.append(entry)
        return out


def type_name(hint) -> str:
    args = typing.get_args(hint)
    if is_optional(hint):
        return f"{type_name(next(a for a in args if a is not type(None)))} | None"
    if typing.get_origin(hint) is list:
        return f"list[{args[0].__name__}]"
    return hint.__name__


def is_optional(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def coerce(pass_name: str, key: str, value: Any, hint) -> Any:
    """`value` as the declared type: strings are parsed, other values type-checked."""
    def bad(why: str = "") -> PassError:
        return PassError(f"pass {pass_name!r}: option {key}={value!r} is not a valid {type_name(hint)}{why}")

    if is_optional(hint):
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE):
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is list:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
            raise bad()
        return [x.strip() for x in items if x.strip()]
    text = value.strip() if isinstance(value, str) else None
    if hint is bool:
        if isinstance(value, bool):
            return value
        if text is None or text.lower() not in _TRUE | _FALSE:
            raise bad(" (true or false)")
        return text.lower() in _TRUE
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return int(text)
        except (TypeError, ValueError):
            raise bad() from None
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        else:
            try:
                number = float(text)
            except (TypeError, ValueError):
                raise bad() from None
        if not math.isfinite(number):
            raise bad(" (a finite number)")
        return number
    if hint is str:
        if not isinstance(value, str):
            raise bad()
        return text
    raise TypeError(f"pass {pass_name!r}: option {key} has unsupported type {hint!r}")


def check_bounds(pass_name: str, f: dataclasses.Field, value: Any) -> None:
    meta = f.metadata
    if value is None:
        return
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise PassError(f"pass {pass_name!r}: option {f.name}={value!r} is unknown; choose one of "
                        f"{', '.join(map(str, meta['choices']))}")
    low, high, strict = meta.get("low"), meta.get("high"), meta.get("strict")
    below = low is not None and (value <= low if strict else value < low)
    above = high is not None and (value >= high if strict else value > high)
    if below or above:
        raise PassError(f"pass {pass_name!r}: option {f.name}={value!r} {bounds_text(low, high, strict)}")


def bounds_text(low, high, strict: bool) -> str:
    if low is not None and high is not None:
        return f"must lie strictly between {low:g} and {high:g}" if strict else f"is outside [{low:g}, {high:g}]"
    if low is not None:
        return f"must be {'above' if strict else 'at least'} {low:g}"
    return f"must be {'below' if strict else 'at most'} {high:g}"


__all__ = ["PassOptions", "option", "coerce"]
