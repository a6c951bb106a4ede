"""The batched engine's model on ONNX Runtime's CPU provider: the ort-cpu backend's
`open_batch` (registered in backends/__init__.py; this module imports ort_cpu through
ort_batch, so ort_cpu cannot name it)."""
from __future__ import annotations

from specrt.runtime.backends.device_batch import DeviceBatchModel
from specrt.runtime.backends.ort_batch import OrtBatchModel


def open_batch(root, entry, shapes, *, rows: int, threads: int, graphs=None, cache=None, serves: str = "step",
               min_rows: int | None = None, buckets=None, execution: str = "cpu"):
    """OrtBatchModel (ort_batch.py), or with `buckets` the static row buckets of device_batch.py
    (execution "cpu" emulates their capture here; "cuda" is GPU-only and has never run on a GPU)."""
    if buckets is not None:
        return DeviceBatchModel(root, entry, shapes, rows=rows, buckets=tuple(buckets), execution=execution,
                                threads=threads)
    return OrtBatchModel(root, entry, shapes, rows=rows, graphs=graphs, cache=cache, threads=threads,
                         min_rows=min_rows, serves=serves)
