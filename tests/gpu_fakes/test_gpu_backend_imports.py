"""Import hygiene of the GPU backends: importing the runtime registers ort-cuda and tensorrt
without importing their modules, and importing those modules pulls in neither tensorrt,
cuda-python, torch, transformers, nor the build side (export, engines, calibration, build, the
graph driver, the tools, the CLI)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED = ("torch", "transformers", "tensorrt", "cuda")
BUILD = ("specrt.export", "specrt.engines", "specrt.calibration", "specrt.builder", "specrt.driver", "specrt.tools",
         "specrt.cli")


def _run(body: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import sys, importlib.abc
        BLOCKED, BUILD = {BLOCKED!r}, {BUILD!r}
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in BLOCKED or name.startswith(BUILD):
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_runtime_registers_the_gpu_backends_without_importing_them():
    r = _run("""
        from specrt.runtime import SpeculativeGenerator
        from specrt.runtime.backends import registered
        assert [b.name for b in registered()] == ["ort-cpu", "ort-cuda", "tensorrt"], registered()
        lazy = [m for m in sys.modules if m.endswith(("backends.ort_cuda", "backends.trt_runtime", "cuda_device"))]
        assert not lazy, lazy
        print("OK")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr[-3000:]


def test_the_gpu_backend_modules_import_without_tensorrt_cuda_torch_or_the_build():
    r = _run("""
        import specrt.runtime.backends.ort_cuda, specrt.runtime.backends.trt_runtime
        import specrt.runtime.backends.cuda_device, specrt.runtime.backends.lifecycle, specrt.runtime.backends.trt_compat
        bad = [m for m in sys.modules if m.split('.')[0] in BLOCKED or m.startswith(BUILD)]
        assert not bad, bad
        print("OK")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr[-3000:]
