"""Triton kernels run here through Triton's interpreter on the CPU; the interpreter must be chosen
before triton is imported."""

import importlib
import os
import sys

import pytest

os.environ["TRITON_INTERPRET"] = "1"


def interpret_triton_language() -> None:
    """Triton decorates its language library's @jit helpers (tl.zeros, tl.maximum, ...) when first
    imported. In a whole-suite run something imports triton before this file (transformers does,
    through llmc.compiler.frontends), so re-run those modules now that the interpreter is chosen."""
    if "triton.language" not in sys.modules:
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    if isinstance(tl.zeros, InterpretedFunction):
        return
    for name in ("triton.language.math", "triton.language.standard", "triton.language.random", "triton.language"):
        if name in sys.modules:
            importlib.reload(sys.modules[name])
    assert isinstance(tl.zeros, InterpretedFunction), (
        "triton was imported before TRITON_INTERPRET=1 was set; set it in the environment to run these tests")


interpret_triton_language()


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path_factory, monkeypatch):
    # Rendered kernel sources go to a session-wide temporary cache, not the user's.
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path_factory.getbasetemp() / "llmc-cache"))

