"""The TensorRT runtime backend against a fake `tensorrt` and a fake cudart (fake_cuda.py):
every tensor address set once, cache outputs bound to their inputs' addresses, a CUDA
graph captured after exactly one plain enqueue and replayed afterwards, prefill never
captured, the tokens of a toy model through the batched engine over the one-row runners
(runtime/batch/one_row.py, as a one-row folder runs: greedy speculative == plain, so in-place
writes and the engine's lengths are right), capture failure -> plain enqueues, and the
refusals (missing packages, no GPU, another TensorRT or GPU, bad plans). TensorRT has
not run any of this."""
from __future__ import annotations

import sys
import types
from collections import Counter

import numpy as np
import pytest
from fake_cuda import fake_cudart, fake_tensorrt
from one_row_drive import drive, engine, run

from specrt import manifest as mf
from specrt.errors import BackendError, GraphFileError, ManifestError
from specrt.runtime.backends import backend_for, trt_runtime
from specrt.runtime.backends.cuda_device import CudaDevice
from specrt.runtime.backends.gpu_errors import CudaUnavailableError, EngineMismatchError, TensorRTUnavailableError

SHAPES = mf.Shapes(batch=1, max_context=40, prefill_chunk=8, k=3)
V = 64
PROMPT = [3, 5, 7, 11, 13, 2, 4, 6, 8, 10]     # two prefill chunks
ENGINES = {"tensorrt_version": "11.1.0.106", "gpu_name": "NVIDIA H200", "compute_capability": "9.0",
           "hardware_compatibility_level": "none", "builder": {}}


def _entry(role, graphs):
    windows = SHAPES.windows
    return mf.ModelEntry(
        role=role, family="llama", precision="fp16", dims={"layers": 2, "kv_heads": 2, "head_dim": 4, "vocab": V},
        graphs={g: types.SimpleNamespace(file=f"{role}/{g}.onnx", tokens=windows[g], sha256="0",
                                         engine={"file": f"{role}/{g}.plan", "sha256": "0",
                                                 "bytes": len(f"PLAN {role} {g}")}) for g in graphs},
        weights={}, source={}, kv={"dtype": "float16", "update": "in_place", "shares_cache_with": None},
        io={**mf.IO_NAMES, "dtypes": {"input_ids": "int64", "past_len": "int64", "logits": "float32",
                                      "kv": "float16"}})


@pytest.fixture
def world(tmp_path):
    entries = {"target": _entry("target", ("prefill", "decode", "verify")), "draft": _entry("draft", ("prefill", "decode"))}
    for role, m in entries.items():
        for g in m.graphs:
            (tmp_path / role).mkdir(exist_ok=True)
            (tmp_path / role / f"{g}.plan").write_bytes(f"PLAN {role} {g}".encode())
    calls = []
    rt = fake_cudart(calls)

    def bias(role, token):   # the draft disagrees on tokens divisible by 3: some drafts rejected
        return 1 if role == "draft" and token % 3 == 0 else 0

    trt = fake_tensorrt(calls, rt, entries, SHAPES.kv_capacity, bias=bias)
    return types.SimpleNamespace(root=tmp_path, entries=entries, calls=calls, rt=rt, trt=trt)


def _open(w, role="target", rt=None, **kw):
    return trt_runtime.TrtModel(w.root, w.entries[role], SHAPES, trt=w.trt, device=CudaDevice(rt or w.rt),
                                **kw).activate()


def _engine_calls(w, label, names=("execute_async_v3", "cudaStreamBeginCapture", "cudaStreamEndCapture",
                                   "cudaGraphInstantiate", "cudaGraphLaunch")):
    return [c for c in w.calls if c[0] in names and (c[0] != "execute_async_v3" or c[1] == label)]


def _cached_tokens(w, runner, n):
    """The tokens the toy model wrote into the first n rows of the runner's cache (it keeps
    each position's input id in layer 0's keys)."""
    k = runner.cache.keys[0]
    return [int(t) for t in w.rt.view(k.address, k.shape, np.float16)[0, 0, :n, 0]]


def _expected(prompt, n, role="target"):
    """The toy model's greedy continuation, computed on the host."""
    seq = list(prompt)
    for _ in range(n):
        t, prev = seq[-1], seq[-2] if len(seq) > 1 else 0
        seq.append((t + prev + (1 if role == "draft" and t % 3 == 0 else 0)) % V)
    return seq[len(prompt):]


def test_every_address_is_set_once_and_cache_outputs_alias_their_inputs(world):
    m = _open(world)
    for i in range(3):
        m.step("decode", [1], i)
    sets = [c for c in world.calls if c[0] == "set_tensor_address"]
    assert Counter((c[1], c[2]) for c in sets).most_common(1)[0][1] == 1
    addr = {(c[1], c[2]): c[3] for c in sets}
    for g in ("prefill", "decode", "verify"):
        assert len([k for k in addr if k[0] == f"target/{g}"]) == 2 + 2 * 2 + 1 + 2 * 2   # every I/O tensor
        for i in range(2):
            assert addr[f"target/{g}", f"present_k_{i}"] == addr[f"target/{g}", f"past_k_{i}"] == m.cache.keys[i].address
            assert addr[f"target/{g}", f"present_v_{i}"] == addr[f"target/{g}", f"past_v_{i}"]
    assert addr["target/decode", "past_k_0"] == addr["target/verify", "past_k_0"]    # one cache for every engine
    assert [c[1] for c in world.calls if c[0] == "create_execution_context"] == \
        ["target/prefill", "target/decode", "target/verify"]


def test_decode_is_captured_after_exactly_one_plain_enqueue_and_replayed_afterwards(world):
    m = _open(world)
    for i in range(4):
        m.step("decode", [1], i)
    assert [c[:3] if c[0] == "execute_async_v3" else c[:1] for c in _engine_calls(world, "target/decode")] == [
        ("execute_async_v3", "target/decode", False),                   # the one plain enqueue
        ("cudaStreamBeginCapture",), ("execute_async_v3", "target/decode", True), ("cudaStreamEndCapture",),
        ("cudaGraphInstantiate",), ("cudaGraphLaunch",),                  # capture, then its first launch
        ("cudaGraphLaunch",), ("cudaGraphLaunch",)]                       # replays
    st = m.graph_stats()["decode"]
    assert (st.eager_runs, st.captures, st.replays) == (1, 1, 2)


def test_prefill_is_never_captured(world):
    m = _open(world)
    for i in range(3):
        m.step("prefill", PROMPT[:8], 0)
    assert [c for c in world.calls if c[0] == "execute_async_v3"] == [("execute_async_v3", "target/prefill", False)] * 3
    assert not any(c[0] == "cudaStreamBeginCapture" for c in world.calls)


def test_the_toy_model_decodes_right_and_greedy_speculative_equals_plain_on_the_engine(world):
    target = _open(world)
    plain = drive(target, PROMPT, 20, SHAPES)[0]
    seq = PROMPT + plain
    assert plain == _expected(PROMPT, 20)
    # every token but the last was written in place at its own position (the toy model reads
    # position p - 1 from the cache, so tokens alone miss a uniformly shifted start)
    assert _cached_tokens(world, target, len(seq) - 1) == seq[:-1]
    target, draft = _open(world), _open(world, "draft")
    eng = engine(target, SHAPES, draft)
    spec, flags, m = run(eng, PROMPT, 20)
    assert spec == plain and 0 < m.accepted < m.drafted     # some drafts rejected
    assert sum(flags) == m.accepted
    assert _cached_tokens(world, target, len(seq) - 1) == seq[:-1]      # the rejected drafts overwritten
    # the draft's own cache too, below where the last drafting round started (the final step, with
    # no room to draft, is plain; the round before it emitted at most k + 1 tokens), so its
    # catch-up steps wrote the accepted tokens at their positions
    drafted = len(seq) - 1 - 1 - (SHAPES.k + 1)
    assert _cached_tokens(world, draft, drafted) == seq[:drafted]
    assert target.graph_stats()["verify"].replays > 0 and draft.graph_stats()["decode"].replays > 0
    # The engine keeps each row's length itself and never rewinds the runners' caches (the old
    # loop called cache.rewind_to after every round, so the rejected drafts' rows were dropped):
    # the toy model reads the token at p - 1 from the cache, so a later request on the same
    # engine decodes right only if each step starts at the row's true length, on both caches.
    short = [9, 12, 1]
    again, _, m2 = run(eng, short, 20)
    assert again == _expected(short, 20) and 0 < m2.accepted < m2.drafted


def test_a_failed_capture_falls_back_to_plain_enqueues_and_the_tokens_do_not_change(world, caplog):
    rt = fake_cudart(world.calls, fail=("end",))
    world.trt = fake_tensorrt(world.calls, rt, world.entries, SHAPES.kv_capacity)
    m = _open(world, rt=rt)
    out = drive(m, PROMPT, 10, SHAPES)[0]
    assert out == _expected(PROMPT, 10) and set(m.eager_fallbacks) == {"decode"}
    assert not any(c[0] == "cudaGraphLaunch" for c in world.calls)
    assert "capture of the decode graph failed" in caplog.text


def test_deactivate_frees_every_buffer_and_releases_the_graphs(world):
    with _open(world) as m:
        for i in range(3):
            m.step("decode", [1], i)
    assert not m.active
    mallocs = [c for c in world.calls if c[0] == "cudaMalloc"]
    assert len(mallocs) == 2 * 2 + 3 * 3 == len([c for c in world.calls if c[0] == "cudaFree"])   # cache + engine I/O
    assert ("cudaGraphExecDestroy",) in world.calls and not world.rt.mem
    with pytest.raises(BackendError, match="activate"):
        m.step("decode", [1], 0)


def test_an_engine_whose_cache_output_does_not_alias_its_input_is_refused(world):
    world.trt = fake_tensorrt(world.calls, world.rt, world.entries, SHAPES.kv_capacity, aliases=False)
    with pytest.raises(GraphFileError, match="present_k_0 to past_v_0"):
        _open(world)


def test_graphs_with_a_hidden_states_output_are_refused_until_the_runner_binds_it(world):
    from dataclasses import replace

    from specrt.errors import ManifestError
    e = world.entries["target"]
    world.entries["target"] = replace(e, dims={**e.dims, "hidden": 8, "hidden_layers": [0]},
                                      io={**e.io, "hidden_states": mf.HIDDEN_STATES})
    with pytest.raises(ManifestError, match="does not bind it yet"):
        _open(world)


def test_a_plan_that_does_not_deserialize_or_is_truncated_says_rebuild(world):
    (world.root / "target" / "verify.plan").write_bytes(b"BAD verify plan!!!")
    with pytest.raises(BackendError, match="could not deserialize .*rebuild"):
        _open(world)
    (world.root / "target" / "verify.plan").write_bytes(b"PLAN")
    with pytest.raises(GraphFileError, match="truncated"):
        _open(world)
    (world.root / "target" / "verify.plan").unlink()
    with pytest.raises(GraphFileError, match="missing"):
        _open(world)


# --- check_device and missing packages --------------------------------------------------------

def _manifest(**engines):
    return {"device": {**mf.gpu_device("tensorrt")}, "engines": {**ENGINES, **engines}}


def test_engines_for_this_gpu_and_tensorrt_are_accepted(world):
    trt_runtime.check_device(_manifest(), trt=world.trt, cudart=world.rt)
    assert backend_for(types.SimpleNamespace(device=_manifest()["device"])).name == "tensorrt"


@pytest.mark.parametrize("engines, cudart_kw, match", [
    ({"tensorrt_version": "10.13.0"}, {}, "built with TensorRT 10.13.0; this machine has TensorRT 11.1.0.106"),
    ({"compute_capability": "8.9", "gpu_name": "NVIDIA L4"}, {}, "compute capability 8.9 .*has 9.0"),
    ({"hardware_compatibility_level": "ampere_plus"}, {"gpu": ("Tesla T4", 7, 5)}, "Ampere or newer"),
])
def test_engines_for_another_tensorrt_or_gpu_are_refused_with_what_to_rebuild(world, engines, cudart_kw, match):
    with pytest.raises(EngineMismatchError, match=match) as e:
        trt_runtime.check_device(_manifest(**engines), trt=world.trt, cudart=fake_cudart([], **cudart_kw))
    assert "specrt build --backend tensorrt" in str(e.value)


def test_a_machine_without_a_gpu_is_refused_naming_the_gpu_the_engines_need(world):
    with pytest.raises(CudaUnavailableError, match="NVIDIA H200, compute capability 9.0.*no usable CUDA device"):
        trt_runtime.check_device(_manifest(), trt=world.trt, cudart=fake_cudart([], devices=0))


@pytest.mark.parametrize("module, named", [("tensorrt", "`tensorrt`"), ("cuda.bindings.runtime", "cuda-python")])
def test_missing_packages_are_named_at_check_and_at_open(world, monkeypatch, module, named):
    monkeypatch.setitem(sys.modules, module, None)      # import raises ImportError
    kw = {"cudart": world.rt} if module == "tensorrt" else {"trt": world.trt}
    with pytest.raises(TensorRTUnavailableError, match=named) as e:
        trt_runtime.check_device(_manifest(), **kw)
    assert isinstance(e.value, ImportError) and "--backend ort-cpu" in str(e.value)
    with pytest.raises(TensorRTUnavailableError, match=named):
        trt_runtime.TrtModel(world.root, world.entries["target"], SHAPES, trt=kw.get("trt")).activate()


def test_a_manifest_for_another_backend_or_without_engine_fields_is_refused(world):
    with pytest.raises(ManifestError, match="rebuild"):
        trt_runtime.check_device({"device": {"backend": "onnxruntime", "kind": "cuda"}}, trt=world.trt,
                                 cudart=world.rt)
    with pytest.raises(ManifestError, match="no \"engines\" section"):
        trt_runtime.check_device({"device": mf.gpu_device("tensorrt")}, trt=world.trt, cudart=world.rt)
