"""The ort-cuda runner on CPU (execution="cpu": CPUExecutionProvider, CPU OrtValues, the CPU
capture emulation) over the real tiny fp16 GroupQueryAttention graphs with a constant
total_sequence_length: the ModelRunner protocol, parity with the ort-cpu backend on the
fp32 graphs, the batched engine over the one-row runners (runtime/batch/one_row.py, as a
one-row folder runs: greedy speculative == plain, with a draft model and with a self-draft
over the target's cache), rewinding, in-place updates, the graph lifecycle on real graphs,
and the refusals. The CUDA provider itself has not run.

Tolerance: fp16 vs fp32 logits within precision.FP16_ATOL + FP16_RTOL * max|logit| (the
fp16 export's own gate), and identical greedy tokens on the tiny model."""
from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
from one_row_drive import drive, engine, run

from specrt import manifest as mf
from specrt.errors import ManifestError
from specrt.runtime.backends import Cache, ModelRunner, backend_for
from specrt.runtime.backends import ort_cuda
from specrt.runtime.backends.gpu_errors import CaptureError, CudaUnavailableError
from specrt.runtime.backends.ort_cpu import OrtModel
from specrt.runtime.batch.one_row import prefill

SHAPES = mf.Shapes(batch=1, max_context=48, prefill_chunk=16, k=3)
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]   # two prefill chunks
SHORT = [30, 6, 41, 8]      # a later request: its rows end where PROMPT's request left K/V
NEW = 16


def _entry(role, part, subdir, kv_dtype, family):
    graphs = {g: mf.GraphEntry(file=f"{subdir}/{e['file']}", tokens=e["tokens"], sha256=e["sha256"])
              for g, e in part["graphs"].items()}
    io = {**mf.IO_NAMES, "dtypes": {"input_ids": "int64", "past_len": "int64", "logits": "float32", "kv": kv_dtype}}
    return mf.ModelEntry(role=role, family=family, precision="fp16" if kv_dtype == "float16" else "fp32",
                         dims=part["dims"], graphs=graphs, weights={**part["weights"],
                                                                    "file": f"{subdir}/{part['weights']['file']}"},
                         source={}, kv={"dtype": kv_dtype, "update": part["kv_update"], "shares_cache_with": None},
                         io=io)


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_pair):
    """root with t16/ (target fp16, gqa, static total), t32/ (target fp32 gqa), d16/ (draft fp16)."""
    from specrt.export import onnx_export, sources
    root = tmp_path_factory.mktemp("ortcuda")
    target, draft = (sources.load_source(str(p)) for p in tiny_pair)
    fam = target.spec.family
    t16 = onnx_export.export_model(target, SHAPES, root / "t16", attention="gqa", precision="fp16", static_total=True)
    t32 = onnx_export.export_model(target, SHAPES, root / "t32", attention="gqa")
    d16 = onnx_export.export_model(draft, SHAPES, root / "d16", graphs=("prefill", "decode"), attention="gqa",
                                   precision="fp16", static_total=True)
    return types.SimpleNamespace(root=root, target=_entry("target", t16, "t16", "float16", fam),
                                 target32=_entry("target", t32, "t32", "float32", fam),
                                 draft=_entry("draft", d16, "d16", "float16", fam))


def _model(b, entry=None, **kw):
    return ort_cuda.OrtCudaModel(b.root, entry or b.target, SHAPES, execution="cpu", **kw).activate()


def _plain(model, n=NEW, prompt=PROMPT):
    """Greedy plain decoding on the engine: the prompt through the prefill graph, then one
    decode step a token."""
    return drive(model, prompt, n, SHAPES)[0]


def _speculative(target, draft, shared=False):
    """Greedy fixed-k rounds on the engine (k draft steps, one verify pass) for PROMPT, then a
    request for SHORT on the same engine: (PROMPT's tokens, its metrics, SHORT's tokens)."""
    assert draft.shares_cache == shared
    eng = engine(target, SHAPES, draft)
    tokens, flags, m = run(eng, PROMPT, NEW)
    assert sum(flags) == m.accepted                  # the tokens marked as the draft's are the accepted ones
    return tokens, m, run(eng, SHORT, NEW)[0]


def test_the_runner_implements_the_model_runner_and_cache_protocols(built):
    m = _model(built)
    assert isinstance(m, ModelRunner) and isinstance(m.cache, Cache) and not m.shares_cache
    assert m.cache.capacity == SHAPES.kv_capacity and m.cache.keys[0].handle.data_ptr() == m.cache.keys[0].address


def test_fp16_steps_match_the_ort_cpu_backend_on_fp32_graphs_and_pick_the_same_tokens(built):
    from specrt.builder.gates.precision import FP16_ATOL, FP16_RTOL
    m16, m32 = _model(built), OrtModel(built.root, built.target32, SHAPES)
    l16 = prefill(m16, SHAPES.prefill_chunk, PROMPT).copy()
    l32 = prefill(m32, SHAPES.prefill_chunk, PROMPT).copy()
    assert np.abs(l16 - l32).max() <= FP16_ATOL + FP16_RTOL * np.abs(l32).max()
    tok, pos = int(np.argmax(l32)), len(PROMPT)
    direct = [tok]
    for _ in range(NEW):
        a, b = m16.step("decode", [tok], pos), m32.step("decode", [tok], pos)
        assert np.abs(a - b).max() <= FP16_ATOL + FP16_RTOL * np.abs(b).max()
        assert int(np.argmax(a)) == int(np.argmax(b))
        tok, pos = int(np.argmax(b)), pos + 1
        direct.append(tok)
    # the engine over either runner picks what stepping the runners by hand picked (at the
    # positions the engine passes them: a shifted start changes the tokens)
    assert _plain(_model(built)) == _plain(OrtModel(built.root, built.target32, SHAPES)) == direct[:NEW]


def test_decode_and_verify_are_captured_after_the_warm_up_and_prefill_never(built):
    m = _model(built, warmup=3)
    _plain(m, n=8)                          # 7 decode steps
    m.step("verify", [1, 2, 3, 4], 30)
    m.step("verify", [1, 2, 3, 4], 30)
    st = m.graph_stats()
    assert (st["prefill"].phase, st["prefill"].captures, st["prefill"].eager_runs) == ("eager-only", 0, 2)
    assert (st["decode"].phase, st["decode"].eager_runs, st["decode"].captures, st["decode"].replays) == \
        ("captured", 3, 1, 3)
    assert (st["verify"].phase, st["verify"].eager_runs, st["verify"].captures) == ("warmup", 2, 0)
    assert [g.step.name for g in m.device.graphs] == ["decode"] and not m.eager_fallbacks


def test_greedy_speculative_decoding_on_the_engine_equals_plain(built):
    # The engine keeps each row's length itself and never rewinds the runners' caches (the old
    # loop called cache.rewind_to after every round): the K/V of rejected drafts and of an earlier
    # request stay past the row's length. A later request's tokens equal a fresh plain run's, so
    # nothing reads them.
    plain, plain_short = _plain(_model(built)), _plain(_model(built), prompt=SHORT)
    spec, metrics, short = _speculative(_model(built), _model(built, built.draft))
    assert spec == plain and metrics.iterations > 0 and metrics.drafted > 0 and short == plain_short
    target = _model(built)
    self_draft = _model(built, cache=target.cache, graphs=("decode",))   # reads and writes the target's cache
    spec, metrics, short = _speculative(target, self_draft, shared=True)
    assert self_draft.shares_cache and spec == plain and metrics.accepted == metrics.drafted > 0
    assert short == plain_short


def test_rewinding_then_stepping_again_equals_never_having_seen_the_rejected_tokens(built):
    a, b = _model(built), _model(built)
    P = len(PROMPT)
    prefill(a, SHAPES.prefill_chunk, PROMPT)
    prefill(b, SHAPES.prefill_chunk, PROMPT)
    a.step("verify", [3, 99, 98, 97], P)          # three of them rejected
    a.cache.rewind_to(P + 1)
    want = b.step("verify", [3, 40], P).copy()
    got = a.step("verify", [40], P + 1).copy()
    np.testing.assert_array_equal(got[0], want[1])


def test_inputs_are_written_in_place_and_the_cache_is_updated_in_place(built):
    m = _model(built, warmup=1)
    r = m.graphs["decode"]
    before = (r.ids.handle.data_ptr(), r.past_len.handle.data_ptr(), m.cache.keys[0].handle.data_ptr())
    P, C = len(PROMPT), 2 * SHAPES.prefill_chunk          # the padded second chunk wrote rows [16, 32)
    prefill(m, SHAPES.prefill_chunk, PROMPT)
    after_prefill = m.cache.keys[0].handle.numpy().copy()
    for i in range(4):
        m.step("decode", [7 + i], P + i)
        assert int(r.ids.handle.numpy()[0, 0]) == 7 + i and int(r.past_len.handle.numpy()[0]) == P + i
    assert (r.ids.handle.data_ptr(), r.past_len.handle.data_ptr(), m.cache.keys[0].handle.data_ptr()) == before
    k = m.cache.keys[0].handle.numpy()
    changed = (k != after_prefill).any(axis=(0, 1, 3))
    assert changed[P:P + 4].all() and not changed[:P].any() and not changed[P + 4:].any()
    assert after_prefill[0, :, :C].any(axis=(0, 2)).all() and not k[0, :, C:].any()


def test_rebinding_a_buffer_after_capture_invalidates_and_recaptures(built):
    m, ref = _model(built, warmup=1), _plain(_model(built))
    first = prefill(m, SHAPES.prefill_chunk, PROMPT)
    tok, pos, out = int(np.argmax(first)), len(PROMPT), []
    for i in range(NEW):
        out.append(tok)
        if i == 5:                                   # after capture: move input_ids to a new buffer
            r = m.graphs["decode"]
            new = m.device.alloc(r.ids.shape, r.ids.dtype)
            r.bind(m.entry.io["input_ids"], new)
            r.ids = new
        tok, pos = int(np.argmax(m.step("decode", [tok], pos))), pos + 1
    assert out == ref
    st = m.graph_stats()["decode"]
    assert (st.invalidations, st.captures) == (1, 2)


def test_a_failed_capture_falls_back_to_eager_and_the_tokens_do_not_change(built, monkeypatch):
    def refuse(self, step):
        raise CaptureError("operation not permitted when stream is capturing")
    monkeypatch.setattr(ort_cuda.OrtDevice, "capture", refuse)
    m = _model(built, warmup=1)
    assert _plain(m) == _plain(_model(built, cuda_graphs=False))
    assert set(m.eager_fallbacks) == {"decode"} and m.graph_stats()["decode"].phase == "fallback"


def test_deactivate_releases_graphs_and_step_afterwards_says_what_to_do(built):
    from specrt.errors import BackendError
    with _model(built, warmup=0) as m:
        m.step("decode", [1], 0)
        graph = m.device.graphs[0]
    assert graph.released and not m.active and m.cache is None
    with pytest.raises(BackendError, match="activate"):
        m.step("decode", [1], 0)


# --- refusals ----------------------------------------------------------------------------------

NO_CUDA = types.SimpleNamespace(__version__="1.32.0", get_available_providers=lambda: ["CPUExecutionProvider"])


def test_opening_without_the_cuda_provider_says_what_to_install_or_rebuild(built):
    with pytest.raises(CudaUnavailableError) as e:
        ort_cuda.OrtCudaModel(built.root, built.target, SHAPES, ort=NO_CUDA).activate()
    msg = str(e.value)
    assert "CUDAExecutionProvider" in msg and "pip install specrt[cuda]" in msg and "--backend ort-cpu" in msg
    assert "CUDA 13" in msg


def _cuda_manifest(**device):
    return types.SimpleNamespace(device={"backend": "onnxruntime", "kind": "cuda", **device})


def test_check_device_refuses_a_machine_without_a_gpu_and_names_what_it_needs(monkeypatch):
    monkeypatch.setattr(ort_cuda, "_import_ort", lambda: NO_CUDA)
    backend = backend_for(_cuda_manifest())
    assert backend.name == "ort-cuda"
    with pytest.raises(CudaUnavailableError) as e:
        backend.check_device(_cuda_manifest(gpu_name="NVIDIA H200"))
    assert isinstance(e.value, ManifestError)
    assert "'cuda'" in str(e.value) and "NVIDIA H200" in str(e.value) and "pip install specrt[cuda]" in str(e.value)
    with pytest.raises(ManifestError, match="os='Plan9'"):
        backend.check_device(_cuda_manifest(os="Plan9"))


def test_the_cpu_backend_keeps_refusing_cuda_manifests():
    from specrt.runtime.backends.ort_cpu import BACKEND
    man = types.SimpleNamespace(device={**mf.this_device(), "kind": "cuda"})
    with pytest.raises(ManifestError, match="kind='cuda'"):
        BACKEND.check_device(man)


def test_cuda_execution_refuses_fp32_or_returned_kv_graphs(built):
    cuda = types.SimpleNamespace(__version__="1.32.0", get_available_providers=lambda: ["CUDAExecutionProvider"])
    with pytest.raises(ManifestError, match="fp16"):
        ort_cuda.OrtCudaModel(built.root, built.target32, SHAPES, ort=cuda).activate()
    returned = mf.ModelEntry(**{**vars(built.target), "kv": {**built.target.kv, "update": "returned"}})
    with pytest.raises(ManifestError, match="in place"):
        ort_cuda.OrtCudaModel(built.root, returned, SHAPES, ort=cuda).activate()


def test_a_graph_that_computes_total_sequence_length_is_refused_for_capture_and_on_cuda(built, tmp_path):
    """Without static_total ORT would read the length on the host once and freeze it in the graph;
    on CUDA it is refused without capture too (wrong prompt logits on an H100, ORT 1.31.1)."""
    from specrt.export import onnx_export, sources
    from tiny_models import make_tiny_model_dir
    lm = sources.load_source(make_tiny_model_dir(tmp_path / "m", "llama", layers=1))
    part = onnx_export.export_model(lm, SHAPES, tmp_path / "dyn", graphs=("decode",), attention="gqa",
                                    precision="fp16")
    entry = _entry("target", part, "dyn", "float16", "llama")
    with pytest.raises(ManifestError, match="total_sequence_length"):
        ort_cuda.OrtCudaModel(tmp_path, entry, SHAPES, execution="cpu").activate()
    cuda = types.SimpleNamespace(__version__="1.31.1", get_available_providers=lambda: ["CUDAExecutionProvider"])
    with pytest.raises(ManifestError, match="wrong prompt logits"):
        ort_cuda.OrtCudaModel(tmp_path, entry, SHAPES, ort=cuda, cuda_graphs=False).activate()
    m = ort_cuda.OrtCudaModel(tmp_path, entry, SHAPES, execution="cpu", cuda_graphs=False).activate()
    assert m.step("decode", [3], 0).shape == (1, int(part["dims"]["vocab"]))


def test_bad_arguments_are_config_errors(built):
    from specrt.errors import ConfigError
    with pytest.raises(ConfigError, match="execution"):
        ort_cuda.OrtCudaModel(built.root, built.target, SHAPES, execution="rocm")
    with pytest.raises(ConfigError, match="memory"):
        ort_cuda.OrtCudaModel(built.root, built.target, SHAPES, memory="shared")
    assert Path(built.root).is_dir()
