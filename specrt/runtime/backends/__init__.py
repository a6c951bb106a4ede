"""Backends behind one interface (see base.py); importing this package registers those
this installation can run. Today: ONNX Runtime on CPU."""
from specrt.runtime.backends import ort_cpu  # noqa: F401  (registers "ort-cpu")
from specrt.runtime.backends.base import Backend, Cache, ModelRunner, backend_for, register, registered

__all__ = ["Backend", "Cache", "ModelRunner", "backend_for", "register", "registered"]
