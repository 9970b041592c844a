"""llmc: an ahead-of-time compiler and lean runtime for large language models."""

import os as _os

# From a source checkout the stage folders sit beside this package (compiler/, passes/,
# codegen/, runtime/); installed, the build maps them inside it. Make both import alike.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "compiler")) and \
        _os.path.isdir(_os.path.join(_root, "compiler")):
    __path__.append(_root)

__version__ = "0.1.0"

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
        from llmc.api import compile
        return compile
    if name in ("load", "LLM", "evaluate", "export", "serve"):
        from llmc import api
        return getattr(api, name)
    if name in ("SamplingParams", "RequestOutput", "CompletionOutput"):
        from llmc.runtime import outputs, sampling_params
        return getattr(sampling_params if name == "SamplingParams" else outputs, name)
    raise AttributeError(f"module 'llmc' has no attribute {name!r}")


__all__ = ["compile", "load", "LLM", "evaluate", "export", "serve", "SamplingParams", "RequestOutput",
           "CompletionOutput", "LlmcError", "ModelLoadError", "UnsupportedModelError", "IRError", "PassError",
           "TargetError", "ArtifactError", "RuntimeLlmcError", "__version__"]
