"""Which device an artifact runs on: a GPU-target artifact runs its Triton kernels on CUDA, or,
when asked for "cpu", through Triton's interpreter (slow; for tests and debugging); a CPU-target
artifact runs its torch kernels on the CPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from llmc.errors import RuntimeLlmcError

DEVICE_CHOICES = ("cpu", "cuda")
INTERPRET_ENV = "TRITON_INTERPRET"


def artifact_device(manifest: dict) -> str:
    """The device the artifact's target compiles for: "cuda" for GPU targets, else "cpu"."""
    return (manifest.get("target") or {}).get("device", "cpu")


def resolve_device(manifest: dict, requested: str | None, path: str | Path) -> torch.device:
    """The device to run the artifact at `path` on, given the user's choice (None: its target's)."""
    if requested not in (None, *DEVICE_CHOICES):
        raise RuntimeLlmcError(f"device {requested!r} is not one of {', '.join(DEVICE_CHOICES)}")
    target = (manifest.get("target") or {}).get("name", "?")
    if artifact_device(manifest) == "cpu":
        if requested == "cuda":
            # its qlinear kernels are torch's CPU-only packed GEMMs
            raise RuntimeLlmcError(f"artifact '{path}' was compiled for target {target}, whose kernels run on "
                                   f"the CPU only; drop device='cuda' (--device cuda), or recompile it for "
                                   f"a GPU target such as h100-bf16")
        return torch.device("cpu")
    if requested == "cpu":
        use_triton_interpreter()
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeLlmcError(f"artifact '{path}' targets {target} (a GPU) but this machine has no CUDA GPU; "
                               f"pass device='cpu' (--device cpu) to run its Triton kernels through the "
                               f"interpreter (slow)")
    return torch.device("cuda")


def use_triton_interpreter() -> None:
    """Make Triton interpret kernels on the CPU. Triton builds its language helpers when first
    imported, choosing the interpreter only if TRITON_INTERPRET=1 was set by then."""
    if "triton.language" not in sys.modules:
        os.environ[INTERPRET_ENV] = "1"
        return
    import triton.language as tl  # triton: ~0.2 s; loaded at the top, it would build before TRITON_INTERPRET is set
    from triton.runtime.interpreter import InterpretedFunction  # the same

    if not isinstance(tl.zeros, InterpretedFunction):
        raise RuntimeLlmcError(f"running a GPU artifact on the CPU needs Triton's interpreter, but triton was "
                               f"imported before {INTERPRET_ENV}=1 was set; set {INTERPRET_ENV}=1 in the "
                               f"environment before starting Python")
    os.environ[INTERPRET_ENV] = "1"


__all__ = ["DEVICE_CHOICES", "artifact_device", "resolve_device", "use_triton_interpreter"]
