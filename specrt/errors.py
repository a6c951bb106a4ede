"""Typed errors. Each message says what went wrong and what to do about it.

Every error a user can provoke with bad input derives from `SpecrtError`, so a
service can catch one class; `assert` is kept for internal invariants only.
"""


class SpecrtError(Exception):
    """Base class for every error specrt raises on purpose."""


class ModelSourceError(SpecrtError):
    """The model directory or GGUF file cannot be read, or its architecture is unsupported."""


class ExportError(SpecrtError):
    """torch -> ONNX export failed."""


class ParityError(SpecrtError):
    """An exported graph disagrees with its reference beyond the stated tolerance."""


class ManifestError(SpecrtError):
    """A manifest is missing, corrupt, from another version/device, or does not match the request."""


class Int8KernelsError(ManifestError):
    """Quantized engines built on a CPU whose int8 kernels round differently from this CPU's:
    the build's exactness gates do not hold here; rebuild the engines on this machine."""


class GatesNotMeasuredError(ManifestError):
    """A CPU folder whose exactness gates were measured on other kernels (another instruction
    set or onnxruntime version) than this machine runs: `specrt retime` measures them here."""


class GraphFileError(ManifestError):
    """A graph or weight file named by the manifest is missing or corrupt."""


class TokenizerMismatchError(SpecrtError):
    """Draft and target do not share a vocabulary / tokenizer."""


class ContextLengthError(SpecrtError):
    """A prompt does not fit in the engine's static maximum context."""


class SamplingParamsError(SpecrtError, ValueError):
    """Sampling parameters outside their valid range."""


class ConcurrentUseError(SpecrtError, RuntimeError):
    """One `SpeculativeGenerator` was asked for a second generation while one is open."""


class PromptError(SpecrtError, TypeError):
    """A prompt that is neither text nor a sequence of token ids (or not valid UTF-8)."""


class ConfigError(SpecrtError, ValueError):
    """A runtime or build setting that cannot be honoured (threads, output folder, ...)."""


class BuildOutputError(ConfigError):
    """`specrt build --out` names a place the build must not or cannot write to."""


class BackendError(SpecrtError, RuntimeError):
    """The inference backend rejected an intact artifact (version, memory, unsupported op)."""


class ChatTemplateError(ManifestError):
    """The manifest's chat template does not compile (a template problem, not a damaged file)."""


class OverloadedError(SpecrtError, RuntimeError):
    """The batched engine's queue is full: retry later (a server answers 429)."""
