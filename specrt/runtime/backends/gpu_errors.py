"""Typed errors of the GPU backends (ort-cuda, tensorrt), defined on the runtime side so a
service that installs only the runtime can catch them. Each message says what to do.

    CudaUnavailableError       no NVIDIA GPU / no CUDA execution provider here (a ManifestError:
                               the engines were built for a device this machine is not)
    TensorRTUnavailableError   `tensorrt` or `cuda.bindings` cannot be imported (also an ImportError)
    EngineMismatchError        a TensorRT plan built for another TensorRT version or GPU
    CaptureError               a CUDA graph could not be captured or replayed; the lifecycle
                               catches it and runs that shape eagerly (never seen by callers)
    StaleGraphError            a captured graph would replay with buffers that were re-bound
                               since capture (a bug in a runner; raised by the CPU device)
"""
from __future__ import annotations

from specrt.errors import BackendError, ManifestError

INSTALL_CUDA = ("`pip install specrt[cuda]` on a machine with an NVIDIA GPU (CUDA 13), or rebuild with "
                "`specrt build` on this machine (`--backend ort-cpu`)")


class CudaUnavailableError(ManifestError, BackendError):
    """These engines need an NVIDIA GPU (or ONNX Runtime's CUDA provider) this machine lacks."""


class TensorRTUnavailableError(CudaUnavailableError, ImportError):
    """TensorRT or the CUDA runtime bindings (`cuda.bindings`) cannot be imported here."""


class EngineMismatchError(ManifestError):
    """A TensorRT engine was built for another TensorRT version or GPU architecture."""


class CaptureError(BackendError):
    """A CUDA graph could not be captured (or its first replays failed)."""


class StaleGraphError(BackendError):
    """A captured graph was about to replay over buffers re-bound since its capture."""
