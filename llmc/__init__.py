"""llmc: an ahead-of-time compiler and lean runtime for large language models."""

import os as _os

# From a source checkout the stage folders sit beside this package (compiler/, passes/,
# codegen/, runtime/); installed, the build maps them inside it. Make both import alike.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "compiler")) and \
        _os.path.isdir(_os.path.join(_root, "compiler")):
    __path__.append(_root)

__version__ = "0.1.0"

# Transparent huge pages for torch's CPU tensors of 2 MiB and more (its allocator then aligns them and
# madvises MADV_HUGEPAGE): a decode step streams every weight once, and on 4 KiB pages each 4 KiB of it
# costs a TLB walk; SmolLM2 fp32 batch-1 decode measured 24.8-25.8 -> 23.3-23.8 ms a step on an Intel
# Xeon. torch reads the variable at its first allocation, so this takes effect where llmc is imported
# before torch (the CLI does). It covers only a tensor's 2 MiB-aligned interior, so the native decode program
# also collapses the weights it streams onto huge pages at load (runtime/host_memory.huge_pages).
# LLMC_HUGE_PAGES=0 turns both off; THP_MEM_ALLOC_ENABLE set beforehand is left as it is.
if _os.environ.get("LLMC_HUGE_PAGES", "1") != "0":
    _os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from llmc.errors import (  # noqa: E402
    ArtifactError,
    IRError,
    LlmcError,
    ModelLoadError,
    PassError,
    RuntimeLlmcError,
    TargetError,
    UnsupportedModelError,
)


def __getattr__(name):
    # Lazy: importing llmc for its CLI or errors should not pay for torch-heavy modules.
    if name in ("compile",):
        from llmc.api import compile  # llmc.api: 10-30 ms more; `import llmc` takes 2 ms
        return compile
    if name in ("load", "LLM", "evaluate", "distill", "export", "serve"):
        from llmc import api  # the same
        return getattr(api, name)
    if name in ("SamplingParams", "RequestOutput", "CompletionOutput"):
        from llmc.runtime import outputs, sampling_params  # torch: ~1 s
        return getattr(sampling_params if name == "SamplingParams" else outputs, name)
    if name == "parse_tool_calls":
        from llmc.runtime.server.tools import parse_tool_calls  # torch and pydantic
        return parse_tool_calls
    if name == "StructuredOutputsParams":
        from llmc.runtime.structured_output import StructuredOutputsParams  # torch
        return StructuredOutputsParams
    raise AttributeError(f"module 'llmc' has no attribute {name!r}")


__all__ = ["compile", "load", "LLM", "evaluate", "export", "serve", "SamplingParams", "StructuredOutputsParams",
           "parse_tool_calls", "distill",
           "RequestOutput", "CompletionOutput", "LlmcError", "ModelLoadError", "UnsupportedModelError", "IRError",
           "PassError", "TargetError", "ArtifactError", "RuntimeLlmcError", "__version__"]
