"""Typed errors of the GPU engine builders and backend selection (each says what to do)."""
from specrt.errors import SpecrtError


class EngineError(SpecrtError):
    """Base class of the engine-building errors."""


class TensorRTMissingError(EngineError, ImportError):
    """TensorRT (or the CUDA runtime bindings it needs) cannot be imported here."""


class EngineBuildError(EngineError):
    """TensorRT could not parse a graph or build an engine from it."""


class EngineCompatError(EngineError):
    """An engine was built for another TensorRT version or GPU architecture."""


class BackendUnavailableError(EngineError):
    """The requested backend cannot run on this machine (missing package or GPU)."""
