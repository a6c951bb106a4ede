"""The runtime: a propose/verify/accept loop over preallocated KV buffers.

Imports neither torch, transformers nor the exporter: it learns everything from the
manifest the build wrote. Install `specrt` with its runtime dependencies only
(numpy, onnxruntime, onnx, tokenizers, jinja2) to embed it in a service.
"""
from specrt.runtime.backends.ort_cpu import MEMORY_MODES
from specrt.runtime.batch.generator import BatchGenerator, Handle, open_batch
from specrt.runtime.generator import Chunk, Completion, SpeculativeGenerator
from specrt.runtime.metrics import Metrics
from specrt.runtime.sampling import SamplingParams

__all__ = ["SpeculativeGenerator", "open_batch", "BatchGenerator", "Handle", "SamplingParams", "Metrics", "Chunk",
           "Completion", "MEMORY_MODES"]
