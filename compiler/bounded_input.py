"""Reading what users and artifacts hand llmc within bounds: a text input (a prompts file, stdin,
--prompt-file, --calib, --text) or a JSON document (manifest.json, plan.json, tokenizer.json, ...)
is refused in one line as soon as it passes its size cap, which is checked while reading, never
after reading everything (/dev/zero is refused, not read until memory runs out); JSON nesting is
bounded too (json's parser recurses once a level: 100,000 levels are a RecursionError).

The caps, and the environment variables that raise them:
- text inputs: 64 MiB each (LLMC_MAX_INPUT_BYTES);
- JSON documents: 128 MiB each (LLMC_MAX_JSON_BYTES), nested at most 64 levels deep."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import BinaryIO

from llmc.errors import LlmcError

INPUT_BYTES_ENV = "LLMC_MAX_INPUT_BYTES"
DEFAULT_INPUT_BYTES = 64 << 20
JSON_BYTES_ENV = "LLMC_MAX_JSON_BYTES"
DEFAULT_JSON_BYTES = 128 << 20
MAX_JSON_DEPTH = 64


def byte_limit(env: str, default: int) -> int:
    """The cap `env` sets (a positive number of bytes), else `default`."""
    value = os.environ.get(env)
    if value is None or value == "":
        return default
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if limit < 1:
        raise LlmcError(f"{env}={value!r} is not a positive number of bytes; unset it or give one, e.g. "
                        f"{env}={default}")
    return limit


def input_limit() -> int:
    return byte_limit(INPUT_BYTES_ENV, DEFAULT_INPUT_BYTES)


def json_limit() -> int:
    return byte_limit(JSON_BYTES_ENV, DEFAULT_JSON_BYTES)


def read_stream(stream: BinaryIO, what: str, limit: int, env: str, error: type[LlmcError] = LlmcError) -> bytes:
    """At most `limit` bytes of `stream`; refused (`error`) when it holds more."""
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise error(f"{what} is larger than {_size(limit)}; pass a smaller one, or set {env} (bytes) to "
                    f"raise the limit")
    return data


def read_input(path: str | Path, what: str, error: type[LlmcError] = LlmcError) -> bytes:
    """A text input file's bytes, within the input cap. OSError is the caller's to word."""
    with open(path, "rb") as f:
        return read_stream(f, what, input_limit(), INPUT_BYTES_ENV, error)


def read_json_bytes(path: str | Path, what: str, error: type[LlmcError] = LlmcError) -> bytes:
    """A JSON document's bytes, within the JSON cap. OSError is the caller's to word."""
    with open(path, "rb") as f:
        return read_stream(f, what, json_limit(), JSON_BYTES_ENV, error)


def parse_json(text: str | bytes, what: str, error: type[LlmcError] = LlmcError, hint: str = ""):
    """The JSON value of `text`, nested at most MAX_JSON_DEPTH deep; `error` names `what` otherwise."""
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
        deep = True
    except ValueError as e:   # JSONDecodeError and UnicodeDecodeError
        raise error(f"{what} is not valid JSON ({str(e).splitlines()[0][:200]}){hint}") from None
    else:
        deep = json_depth(value) > MAX_JSON_DEPTH
    if deep:
        raise error(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep (no genuine one nests so deep){hint}")
    return value


def json_depth(value, stop: int = MAX_JSON_DEPTH) -> int:
    """How deep arrays and objects nest in `value` (a scalar: 0), counted without recursion, up to
    just past `stop`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if deepest > stop:
            break
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def file_kind(path: Path) -> str:
    """What is at `path`, in words: "a file", "a directory", "a device", ..., or "no such file or
    directory" (for messages about a path that is not what was asked for)."""
    try:
        mode = Path(path).stat().st_mode
    except FileNotFoundError:
        return "no such file or directory"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    kinds = ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a device"),
             (stat.S_ISBLK, "a device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "a special file")


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 and limit % (1 << 20) == 0 else f"{limit} bytes"


__all__ = ["DEFAULT_INPUT_BYTES", "DEFAULT_JSON_BYTES", "INPUT_BYTES_ENV", "JSON_BYTES_ENV", "MAX_JSON_DEPTH",
           "file_kind", "input_limit", "json_depth", "json_limit", "parse_json", "read_input", "read_json_bytes",
           "read_stream"]
