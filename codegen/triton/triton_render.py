"""Render llmc's jinja2 Triton templates with the constants of one target and shape family into
kernel source, and load that source as a callable kernel. Triton's @jit needs a real source file,
so the text is written to the user cache under its sha256 and imported from there."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import jinja2

from llmc.cache import cache_root
from llmc.codegen.native_cache import private_directory

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"

_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR), undefined=jinja2.StrictUndefined,
                          trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                          autoescape=False)
_LOADED: dict[str, object] = {}   # sha256 -> the kernel imported from that source
_RECORDERS: list[list] = []       # the open record_loads() blocks' logs


@dataclass(frozen=True)
class RenderedKernel:
    template: str            # file name under codegen/triton/templates
    name: str                # the @triton.jit function the source defines
    constants: tuple         # sorted (name, value) pairs it was rendered with
    source: str

    @functools.cached_property   # load_kernel reads it at every launch
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()


def render_kernel(template: str, name: str, constants: dict) -> RenderedKernel:
    """Render `template` with `constants` (plus KERNEL_NAME and a header line listing them)."""
    items = tuple(sorted(constants.items()))
    line = ", ".join(f"{k}={v!r}" for k, v in items)
    source = _ENV.get_template(template).render(KERNEL_NAME=name, constants_line=line, **constants)
    return RenderedKernel(template, name, items, source)


def kernel_cache_dir() -> Path:
    """<cache>/triton, a private directory (codegen/native_cache.py): the sources in it are imported."""
    return private_directory(cache_root() / "triton")


def load_kernel(kernel: RenderedKernel):
    """The @triton.jit function of `kernel`, imported from <cache>/triton/<sha256>.py."""
    for log in _RECORDERS:
        log.append(kernel)
    digest = kernel.sha256
    if digest not in _LOADED:
        path = _write_source(kernel.source, digest)
        spec = importlib.util.spec_from_file_location(f"llmc_triton_{digest[:16]}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _LOADED[digest] = getattr(module, kernel.name)
    return _LOADED[digest]


@contextmanager
def record_loads() -> Iterator[list[RenderedKernel]]:
    """Log every kernel load_kernel hands out inside the block; launchers load their kernel at each
    launch, so this is what the block launched (the runtime's debug check of its plan)."""
    log: list[RenderedKernel] = []
    _RECORDERS.append(log)
    try:
        yield log
    finally:
        _RECORDERS.remove(log)


def _write_source(source: str, digest: str) -> Path:
    """Write the file unless one with exactly this text is there (a stale or edited one is
    replaced); written to a temporary file and renamed so concurrent compiles never see half."""
    directory = kernel_cache_dir()
    path = directory / f"{digest}.py"
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == digest:
        return path
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
        f.write(source)
    os.replace(tmp, path)
    return path


__all__ = ["TEMPLATE_DIR", "RenderedKernel", "render_kernel", "kernel_cache_dir", "load_kernel", "record_loads"]
