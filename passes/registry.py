"""The registry of named passes and the parser that turns a default pipeline plus CLI
choices (`--passes`, `--disable-pass`, `--pass-option`) into configured pass objects."""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, Iterable

from llmc.errors import PassError

if TYPE_CHECKING:
    from llmc.passes.base import Pass

PASSES: dict[str, type[Pass]] = {}

# Modules of this package that hold infrastructure rather than passes.
_INFRASTRUCTURE = {"base", "registry"}


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator: make a pass reachable by its `name`."""
    name = getattr(cls, "name", "")
    if not name:
        raise TypeError(f"pass class {cls.__qualname__} has no name")
    if name in PASSES and PASSES[name] is not cls:
        raise TypeError(f"pass name {name!r} is registered twice "
                        f"({PASSES[name].__module__} and {cls.__module__})")
    PASSES[name] = cls
    return cls


_loaded = False


def load_builtin_passes() -> None:
    """Import every pass module of llmc.passes so its passes register themselves."""
    global _loaded
    if _loaded:
        return
    import llmc.passes as package

    for info in pkgutil.iter_modules(package.__path__):
        if info.name not in _INFRASTRUCTURE and not info.name.startswith("_"):
            importlib.import_module(f"llmc.passes.{info.name}")
    _loaded = True


def valid_pass_names() -> list[str]:
    load_builtin_passes()
    return sorted(PASSES)


def check_pass_name(name: str, what: str = "pass") -> None:
    if name not in valid_pass_names():
        raise PassError(f"unknown {what} {name!r}; valid passes: {', '.join(valid_pass_names())}")


def get_pass(name: str, **options) -> Pass:
    """A configured instance of the pass registered as `name`."""
    check_pass_name(name)
    return PASSES[name](**options)


def parse_pass_spec(spec: str) -> tuple[str, dict[str, str]]:
    """`"name:key=val:key2=val2"` -> ("name", {"key": "val", "key2": "val2"}); a part without
    `=` after a key=value part continues its value (`prune_sparse:pattern=2:4`)."""
    name, *pairs = (part.strip() for part in spec.split(":"))
    options: dict[str, str] = {}
    last = None
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep and last is not None and pair:
            options[last] += f":{pair}"
            continue
        if not sep or not key.strip():
            raise PassError(f"pass entry {spec!r}: option {pair!r} is not key=value; "
                            f"write it as name:key=value:key2=value2")
        last = key.strip()
        options[last] = value.strip()
    return name, options


def parse_pass_options(items: Iterable[str]) -> dict[str, dict[str, str]]:
    """`["dce.key=value", ...]` (from `--pass-option`) -> {"dce": {"key": "value"}}."""
    options: dict[str, dict[str, str]] = {}
    for item in items:
        target, sep, value = item.partition("=")
        name, dot, key = target.strip().partition(".")
        if not sep or not dot or not name or not key:
            raise PassError(f"pass option {item!r} is not of the form pass.key=value "
                            f"(e.g. fold_constants.max_growth=4)")
        options.setdefault(name, {})[key.strip()] = value.strip()
    return options


def build_pipeline(default: list[str], passes: str | None = None, disable: Iterable[str] = (),
                   options: dict[str, dict] | None = None) -> list[Pass]:
    """Configured passes: `passes` (a comma list) replaces `default`, `disable` drops names,
    `options` maps a pass name to option values applied to every instance of that pass."""
    entries = default if passes is None else [e for e in passes.split(",") if e.strip()]
    specs = [parse_pass_spec(e) for e in entries]
    for name, _ in specs:
        check_pass_name(name)
    dropped = set()
    for name in disable:
        check_pass_name(name, "pass to disable")
        dropped.add(name)
    specs = [(name, opts) for name, opts in specs if name not in dropped]
    chosen = [name for name, _ in specs]
    for name in options or {}:
        check_pass_name(name, "pass in --pass-option")
        if name not in chosen:
            raise PassError(f"options given for pass {name!r}, which is not in the pipeline "
                            f"({', '.join(chosen) or 'empty'}); add it with --passes or drop the option")
    return [get_pass(name, **{**opts, **(options or {}).get(name, {})}) for name, opts in specs]


__all__ = ["PASSES", "register_pass", "get_pass", "load_builtin_passes", "valid_pass_names",
           "parse_pass_spec", "parse_pass_options", "build_pipeline"]
