"""Where llmc keeps what it measures, builds or fetches on this machine: $LLMC_CACHE, else
~/.cache/llmc (kernel timings, bandwidth, Triton kernels, native kernels, the sample model)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("LLMC_CACHE") or "~/.cache/llmc").expanduser()


__all__ = ["cache_root"]
