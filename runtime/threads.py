"""How many CPU threads the runtime computes with: `--threads N`, else `LLMC_NUM_THREADS`, else
the machine's physical cores; applied to torch once an engine is built, and kept here for any
other kernel family (an ONNX Runtime session builder) to read."""

from __future__ import annotations

import os

import psutil
import torch

from llmc.errors import RuntimeLlmcError

ENV_VAR = "LLMC_NUM_THREADS"
_applied: int | None = None


def logical_cpus() -> int:
    return os.cpu_count() or 1


def default_threads() -> int:
    """Physical cores (hyperthreads share a core's memory port and FPU), at most the CPUs this
    process may run on."""
    physical = psutil.cpu_count(logical=False)
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical_cpus()
    return max(1, min(physical or logical_cpus(), allowed))


def resolve_threads(requested: int | str | None = None) -> int:
    """The thread count to run with: `requested` (from --threads or threads=), else the
    LLMC_NUM_THREADS variable, else default_threads(); a value outside 1..logical CPUs is an error."""
    if requested is None and os.environ.get(ENV_VAR, "").strip():
        return _checked(os.environ[ENV_VAR], f"{ENV_VAR}={os.environ[ENV_VAR]!r}")
    if requested is None:
        return default_threads()
    return _checked(requested, f"--threads {requested}" if isinstance(requested, str) else f"threads={requested!r}")


def _checked(value, where: str) -> int:
    limit = logical_cpus()
    n = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str) and value.strip().lstrip("+").isdigit():
        n = int(value)
    if n is None or not 1 <= n <= limit:
        raise RuntimeLlmcError(f"{where}: the thread count must be a whole number from 1 to {limit} "
                               f"(this machine's logical CPUs); give one in that range or leave it unset")
    return n


def apply_threads(n: int) -> None:
    """Make torch compute with `n` threads; its inter-op pool can only be sized before it
    first runs parallel work, so that part is best effort."""
    global _applied
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:
        pass
    _applied = n


def current_threads() -> int:
    """The count the runtime last applied (or would apply now); what an ORT session should use."""
    return _applied if _applied is not None else resolve_threads()
