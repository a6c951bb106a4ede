"""The GPU's static row buckets through the CPU implementation (backends/device_batch.py):
the real tiny `--batch` graph, bound by pointer to prefixes of one device cache per layer,
one captured graph per (graph, bucket) under the CPU capture emulation (which refuses a
replay whose addresses moved), padding rows, and row moves on the device. No GPU has run
this; what it shows is that the bucketed engine gives every request the tokens it gets alone.
"""
from __future__ import annotations

import pytest

from specrt.errors import BackendError, ConfigError
from specrt.runtime.backends.device_batch import bucket_for, bucket_plan
from specrt.runtime.backends.gpu_errors import CudaUnavailableError
from specrt.runtime.backends.lifecycle import CAPTURED, EAGER_ONLY
from specrt.runtime.batch.generator import open_batch

# three short prompts fill three rows, then long ones (several 16-token prefill chunks) are
# prefilled in the fourth row while three rows decode in bucket 4: the prompt being
# prefilled sits in a padding row between its chunks
PROMPTS = ["hello there", "the quick brown fox", "to be or not to be",
           "a b c d e f g h i j k l m n o p q r s t u v w",
           "x", "one two three four five six seven eight nine", "a"]
NEW = 24


def test_bucket_plan_and_the_bucket_of_a_step():
    assert bucket_plan(16) == (1, 2, 4, 8, 16)
    assert bucket_plan(6) == (1, 2, 4, 6)
    assert bucket_plan(3, (4, 1)) == (1, 3)
    plan = bucket_plan(6)
    assert [bucket_for(n, plan) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    assert bucket_for(1, plan, min_rows=2) == 2          # a one-row kernel path is never run
    with pytest.raises(BackendError):
        bucket_for(7, plan)
    with pytest.raises(ConfigError):
        bucket_plan(4, (0, 2))


@pytest.fixture(scope="module")
def alone(tiny_batch_same_engines):
    with open_batch(tiny_batch_same_engines, max_num_seqs=1) as g:
        return [g.generate(p, max_new_tokens=NEW).tokens for p in PROMPTS]


def test_bucketed_rows_equal_each_request_alone_and_each_shape_is_captured_once(tiny_batch_same_engines, alone):
    with open_batch(tiny_batch_same_engines, max_num_seqs=4, buckets=(1, 2, 4), execution="cpu") as g:
        got = [c.tokens for c in g.generate_batch(PROMPTS, max_new_tokens=NEW)]
        model, st = g.engine.target, g.engine.stats
        stats = model.graph_stats()
        assert got == alone
        assert st.row_steps / st.steps > 2.0                         # rows really shared steps
        decode = {k: v for k, v in stats.items() if k.startswith("decode")}
        assert set(decode) == {"decode[1x1]", "decode[2x1]", "decode[4x1]"}   # 3 rows ran in bucket 4
        for name, s in decode.items():                                 # one capture per bucket, then replays
            assert (s.phase, s.captures, s.invalidations, s.fallback) == (CAPTURED, 1, 0, None), (name, s)
            assert s.eager_runs == model.lifecycle.warmup, (name, s)
        assert decode["decode[4x1]"].replays > 0
        assert sum(s.eager_runs + s.captures + s.replays for s in decode.values()) == st.steps
        prefill = {k: v for k, v in stats.items() if k.startswith("prefill")}
        assert prefill and all(s.phase == EAGER_ONLY and s.captures == 0 for s in prefill.values())
        assert sum(s.eager_runs for s in prefill.values()) == st.prefill_chunks
        assert len(model.device.graphs) == 3                           # the emulation recorded 3 graphs


def test_execution_must_be_known_and_cuda_needs_the_cuda_provider(tiny_batch_same_engines):
    with pytest.raises(ConfigError, match="execution"):
        open_batch(tiny_batch_same_engines, max_num_seqs=2, buckets=(1, 2), execution="gpu")
    with pytest.raises(CudaUnavailableError):        # this machine's onnxruntime has no CUDA provider
        open_batch(tiny_batch_same_engines, max_num_seqs=2, buckets=(1, 2), execution="cuda")


def test_on_cuda_the_cpu_batched_graph_is_refused_before_any_device_memory(tiny_batch_same_engines):
    """A CUDA provider (pretended): the CPU build's batched graph has an fp32 cache and a
    computed total_sequence_length; both are refused, naming why, before a device exists."""
    import types

    from specrt import manifest as mf
    from specrt.errors import ManifestError
    from specrt.runtime.backends.device_batch import DeviceBatchModel
    man = mf.load(tiny_batch_same_engines)
    cuda = types.SimpleNamespace(__version__="1.31.1", get_available_providers=lambda: ["CUDAExecutionProvider"])
    with pytest.raises(ManifestError, match="fp16 only"):
        DeviceBatchModel(tiny_batch_same_engines, man.batch, man.shapes, rows=2, ort=cuda)
    fp16 = mf.ModelEntry(**{**vars(man.batch), "io": {**man.batch.io, "dtypes": {**man.batch.io.get("dtypes", {}),
                                                                                 "kv": "float16"}}})
    with pytest.raises(ManifestError, match="total_sequence_length.*CPU-only"):
        DeviceBatchModel(tiny_batch_same_engines, fp16, man.shapes, rows=2, ort=cuda, cuda_graphs=False)
