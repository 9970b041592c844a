"""The registry of passes and the typed configurations a pipeline is built from: a `PassConfig`
names a registered pass, its validated options and the stage it runs in. Targets and compile
flags produce configs; `schedule` places them by stage; `--passes` lists keep the user's order."""

from __future__ import annotations

import dataclasses
import enum
import importlib
import pkgutil
from typing import TYPE_CHECKING, Iterable

import llmc.passes as package
from llmc.errors import PassError
from llmc.passes.options import PassOptions

if TYPE_CHECKING:
    from llmc.passes.base import Pass


class Stage(enum.IntEnum):
    """Where a pass runs; the pipeline builder orders passes by stage. Lowering's own steps (with
    the frontend cleanup) come first; the passes that change weights (prune, convert heads,
    quantise) see the graph as lowered; cleanup passes run after them (simplify) and after the
    fusions. The KV-cache pass comes last, so every attention it scales is final."""
    LOWER = 0
    PRUNE = 1
    CONVERT_HEADS = 2
    QUANTIZE = 3
    SIMPLIFY = 4
    SHARD = 5
    CAST = 6
    FUSE = 7
    CLEANUP = 8
    KV_CACHE = 9

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")


# What a pass may declare it needs; the driver provides each before the pipeline runs.
NEEDS = {"calibration": "calibration sequences (--calib text, or text the model generates)",
         "target": "the compile target's facts (its activation dtype)",
         "source_weights": "the quantised forms a source stores weights in (a GGUF file's blocks)"}

PASSES: dict[str, type[Pass]] = {}

# Modules of this package that hold infrastructure rather than passes.
_INFRASTRUCTURE = {"base", "registry", "options"}


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator: check a pass's declaration and make it reachable by its `name`."""
    name = getattr(cls, "name", "")
    if not name:
        raise TypeError(f"pass class {cls.__qualname__} has no name")
    if name in PASSES and PASSES[name] is not cls:
        raise TypeError(f"pass name {name!r} is registered twice ({PASSES[name].__module__} and {cls.__module__})")
    if not isinstance(cls.stage, Stage) or cls.stage not in cls.allowed_stages():
        raise TypeError(f"pass {name!r}: stage {cls.stage!r} is no Stage among its stages {cls.allowed_stages()}")
    unknown = sorted(set(cls.needs) - set(NEEDS))
    if unknown:
        raise TypeError(f"pass {name!r}: needs {cls.needs} must be keys of {sorted(NEEDS)}")
    if not (isinstance(cls.Options, type) and issubclass(cls.Options, PassOptions)):
        raise TypeError(f"pass {name!r}: Options must be a PassOptions dataclass")
    PASSES[name] = cls
    return cls


_loaded = False


def load_builtin_passes() -> None:
    """Import every pass module of llmc.passes so its passes register themselves."""
    global _loaded
    if _loaded:
        return

    for info in pkgutil.iter_modules(package.__path__):
        if info.name not in _INFRASTRUCTURE and not info.name.startswith("_"):
            importlib.import_module(f"llmc.passes.{info.name}")
    _loaded = True


def valid_pass_names() -> list[str]:
    load_builtin_passes()
    return sorted(PASSES)


def pass_class(name: str, what: str = "pass") -> type[Pass]:
    if name not in valid_pass_names():
        raise PassError(f"unknown {what} {name!r}; valid passes: {', '.join(valid_pass_names())}")
    return PASSES[name]


def check_pass_name(name: str, what: str = "pass") -> None:
    pass_class(name, what)


def get_pass(name: str, **options) -> Pass:
    """A configured instance of the pass registered as `name`."""
    return pass_class(name)(**options)


@dataclasses.dataclass(frozen=True)
class PassConfig:
    """One pipeline entry: a registered pass, its validated options, its stage, and what put it
    there (a target, `--passes`, a compile flag), for error messages."""
    name: str
    options: PassOptions
    stage: Stage
    origin: str = ""

    @classmethod
    def of(cls, name: str, stage: Stage | None = None, origin: str = "", **options) -> PassConfig:
        pass_cls = pass_class(name)
        stage = pass_cls.stage if stage is None else stage
        if stage not in pass_cls.allowed_stages():
            raise PassError(f"pass {name!r} runs in stage {pass_cls.stage.label}, not {stage.label}")
        return cls(name, pass_cls.Options.build(options), stage, origin)

    def configure(self, **values) -> PassConfig:
        return dataclasses.replace(self, options=self.options.replace(**values))

    def instantiate(self) -> Pass:
        return PASSES[self.name](**self.options.to_dict())

    def spec(self) -> str:
        """`name:key=value` for each option that differs from its declared default."""
        default = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                   for f in dataclasses.fields(self.options)}
        changed = [f"{k}={_spec_value(v)}" for k, v in self.options.to_dict().items() if default[k] != v]
        return ":".join([self.name, *changed])


def _spec_value(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    return ",".join(v) if isinstance(v, list) else str(v)


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


def parse_pass_list(entries: Iterable[str | PassConfig], origin: str = "--passes") -> list[PassConfig]:
    """Configs for a pass list (a target's, or a user's `--passes`), in its order. A pass allowed
    in several stages (the cleanup passes) takes the earliest of them, from its declared stage
    on, that is not before the entry ahead of it."""
    configs: list[PassConfig] = []
    for entry in entries:
        if isinstance(entry, PassConfig):
            configs.append(entry)
            continue
        name, opts = parse_pass_spec(entry)
        cls = pass_class(name)
        allowed = sorted(s for s in cls.allowed_stages() if s >= cls.stage)
        floor = configs[-1].stage if configs else cls.stage
        stage = next((s for s in allowed if s >= floor), allowed[-1])
        configs.append(PassConfig.of(name, stage, origin, **opts))
    return configs


def schedule(base: list[PassConfig], added: Iterable[PassConfig]) -> list[PassConfig]:
    """`base` in its own order, each added config placed before the first base entry of a later
    stage. A compile flag (origin starting with "--") may not add a stage `base` already fills
    from `--passes` (say one or the other)."""
    out = list(base)
    for config in added:
        clash = [b for b in base if b.stage == config.stage and b.origin == "--passes"]
        if clash and config.origin.startswith("--") and config.origin != "--add-pass":
            raise PassError(f"--passes already holds {', '.join(b.name for b in clash)} "
                            f"({config.stage.label}) and {config.origin} adds {config.name}; "
                            f"give one or the other")
        at = next((i for i, b in enumerate(out) if b.stage > config.stage), len(out))
        out.insert(at, config)
    return out


def drop_disabled(configs: list[PassConfig], disable: Iterable[str]) -> list[PassConfig]:
    dropped = set()
    for name in disable:
        if pass_class(name, "pass to disable").required:
            raise PassError(f"--disable-pass {name}: it is a lowering step every compile needs; "
                            f"it cannot be disabled")
        dropped.add(name)
    return [c for c in configs if c.name not in dropped]


def apply_options(configs: list[PassConfig], options: dict[str, dict] | None) -> list[PassConfig]:
    """`options` (pass name -> values) applied to every config of that pass."""
    chosen = [c.name for c in configs]
    for name in options or {}:
        check_pass_name(name, "pass in --pass-option")
        if name not in chosen:
            raise PassError(f"options given for pass {name!r}, which is not in the pipeline "
                            f"({', '.join(chosen) or 'empty'}); add it with --passes or --add-pass, "
                            f"or drop the option")
    return [c.configure(**options[c.name]) if c.name in (options or {}) else c for c in configs]


def build_pipeline(default: list[str | PassConfig], passes: str | None = None, disable: Iterable[str] = (),
                   options: dict[str, dict] | None = None) -> list[Pass]:
    """Configured passes: `passes` (a comma list) replaces `default`, `disable` drops names,
    `options` maps a pass name to option values applied to every instance of that pass."""
    entries = default if passes is None else [e for e in passes.split(",") if e.strip()]
    configs = apply_options(drop_disabled(parse_pass_list(entries), disable), options)
    return [c.instantiate() for c in configs]


def describe_passes() -> list[dict]:
    """Every registered pass: name, stage (and other stages), options, lossy flag, needs."""
    out = []
    for name in valid_pass_names():
        cls = PASSES[name]
        out.append({"name": name, "stage": cls.stage.label,
                    "stages": [s.label for s in cls.allowed_stages()],
                    "description": cls.description, "options": cls.Options.describe(),
                    "lossy": cls.lossy, "needs": list(cls.needs), "required": cls.required})
    return out


__all__ = ["PASSES", "PassConfig", "register_pass", "get_pass", "pass_class", "load_builtin_passes",
           "valid_pass_names", "parse_pass_spec", "parse_pass_options", "parse_pass_list", "schedule",
           "drop_disabled", "apply_options", "build_pipeline", "describe_passes"]
