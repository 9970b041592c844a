"""The one exception family users see. Each says what was wrong, where, and what to do;
the CLI prints it as one line and exits 2."""


class LlmcError(Exception):
    """Base of every error a user can cause."""


class ModelLoadError(LlmcError):
    """A model source is missing, corrupt, or of an unsupported kind."""


class UnsupportedModelError(ModelLoadError):
    """The architecture is not one llmc compiles."""


class IRError(LlmcError):
    """The IR failed verification or could not be built."""


class PassError(LlmcError):
    """A pass name or option is wrong, or a pass failed."""


class TargetError(LlmcError):
    """An unknown target, or one that cannot compile this yet."""


class ArtifactError(LlmcError):
    """An artifact is missing, tampered with, truncated, or already exists."""


class RuntimeLlmcError(LlmcError):
    """A request the runtime cannot serve (too long for the KV cache, bad parameters)."""
