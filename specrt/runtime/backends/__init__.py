"""Backends behind one interface (see base.py); importing this package registers them.

    ort-cpu    onnxruntime on cpu    ort_cpu.py     (imported here; batched models: cpu_batch.py)
    ort-cuda   onnxruntime on cuda   ort_cuda.py    (imported when a cuda manifest is opened)
    tensorrt   tensorrt on cuda      trt_runtime.py (imported when a TensorRT manifest is opened)

The GPU backends are registered by name only: their modules (and through them
onnxruntime-gpu, tensorrt, cuda-python) load on the first check_device/open_model call,
so a CPU installation never imports them. On a machine without the GPU or package they
need, check_device refuses with what to install or rebuild.
"""
import dataclasses
import importlib

from specrt.runtime.backends import ort_cpu  # noqa: F401  (registers "ort-cpu")
from specrt.runtime.backends.base import Backend, Cache, ModelRunner, backend_for, register, registered


def _lazy(module: str, attr: str):
    def call(*args, **kw):
        return getattr(importlib.import_module(module), attr)(*args, **kw)
    call.__name__ = call.__qualname__ = f"{module.rsplit('.', 1)[-1]}.{attr}"
    return call


# ort-cpu's batched models (cpu_batch.py imports ort_cpu through ort_batch: loaded on first use)
register(dataclasses.replace(ort_cpu.BACKEND, open_batch=_lazy("specrt.runtime.backends.cpu_batch", "open_batch")))

for _name, _backend, _module in (("ort-cuda", "onnxruntime", "specrt.runtime.backends.ort_cuda"),
                                 ("tensorrt", "tensorrt", "specrt.runtime.backends.trt_runtime")):
    register(Backend(name=_name, device_backend=_backend, device_kind="cuda", memory_modes=("fast",),
                     open_model=_lazy(_module, "open_model"), check_device=_lazy(_module, "check_device")))

__all__ = ["Backend", "Cache", "ModelRunner", "backend_for", "register", "registered"]
