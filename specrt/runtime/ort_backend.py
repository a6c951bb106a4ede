"""Moved to specrt/runtime/backends/ort_cpu.py; kept so existing imports keep working."""
from specrt.runtime.backends.ort_cpu import (  # noqa: F401
    MEMORY_MODES,
    GraphRunner,
    OrtModel,
    SharedWeights,
    check_weights_file,
    configure_threads,
    session_options,
)
