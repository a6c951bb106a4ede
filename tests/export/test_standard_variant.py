"""The standard-op variant (`attention="standard"`, the graph meant for TensorRT): opset-24
`TensorScatter` + `Attention` over the whole cache. Checked here on ONNX Runtime CPU only:
parity with transformers, the cache written in place through one shared buffer, and the
same greedy output as the `gqa` graphs through the real runtime. TensorRT has not run it."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from tiny_models import make_tiny_model_dir

from specrt.export import onnx_export, parity, sources
from specrt.manifest import Shapes

SHAPES = Shapes(batch=1, max_context=64, prefill_chunk=16, k=3)
PROMPTS = [[5, 6, 7], [40, 50, 60, 70, 80, 90, 100], list(range(10, 40))]


@pytest.mark.parametrize("family,kw", [
    ("llama", {}),                                    # GQA: 4 q heads on 2 kv heads
    ("llama", {"heads": 4, "kv_heads": 4}),          # plain multi-head attention
    ("qwen2", {}),                                    # q/k/v bias
    ("gpt2", {}),                                     # learned positions, fused qkv, LayerNorm
])
def test_standard_variant_matches_transformers_at_real_cache_offsets(tmp_path, family, kw):
    src = make_tiny_model_dir(tmp_path / "model", family, layers=2, **kw)
    lm = sources.load_source(src)
    part = onnx_export.export_model(lm, SHAPES, tmp_path / "onnx", attention="standard")
    assert part["kv_update"] == "in_place"
    report = parity.check_parity(lm.model, tmp_path / "onnx", part, SHAPES, rtol=lm.spec.parity_rtol)
    graphs = report["graphs"]
    for name in ("prefill", "decode", "verify"):
        assert graphs[name]["max_abs_logit_delta"] < report["tolerance"], (name, graphs[name])
        assert graphs[name]["argmax_agreement"] == 1.0, (name, graphs[name])
    assert graphs["decode_vs_verify"]["max_abs_logit_delta"] < 1e-4


@pytest.fixture(scope="module")
def standard_llama(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("std")
    lm = sources.load_source(make_tiny_model_dir(tmp / "model", "llama", layers=2))
    part = onnx_export.export_model(lm, SHAPES, tmp / "onnx", graphs=("decode", "verify"), attention="standard")
    return tmp / "onnx", part


def test_graph_uses_only_opset_24_standard_ops_trt_can_parse(standard_llama):
    directory, part = standard_llama
    proto = onnx.load(str(directory / "verify.onnx"), load_external_data=False)
    assert {o.domain: o.version for o in proto.opset_import}.get("", 0) == 24
    ops = Counter(n.op_type for n in proto.graph.node)
    assert {n.domain for n in proto.graph.node} <= {""}, "no contrib ops: TensorRT's parser must read it"
    assert ops["TensorScatter"] == 2 * 2 and ops["Attention"] == 2
    for n in proto.graph.node:
        if n.op_type == "Attention":
            # TensorRT rejects past_key/past_value/nonpad_kv_seqlen and present_* outputs
            assert len(n.input) == 4 and all(n.input) and len([o for o in n.output if o]) == 1, n
        if n.op_type == "TensorScatter":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            assert attrs.get("axis", -2) == -2 and attrs.get("mode", b"linear") in (b"linear", "linear")
    outs = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in proto.graph.output}
    ins = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in proto.graph.input}
    assert outs["present_k_0"] == ins["past_k_0"] == [1, 2, SHAPES.kv_capacity, 16]
    onnx.checker.check_model(str(directory / "verify.onnx"))


def test_cache_is_updated_in_place_when_past_and_present_share_a_buffer(standard_llama, capfd):
    """Bound to one OrtValue, ORT's TensorScatter writes into it and never copies the cache
    (its warning "in-place optimization not activated" is absent), and stale rows past the
    window are left alone."""
    import onnxruntime as ort

    from specrt.runtime.backends.ort_cpu import session_options

    directory, part = standard_llama
    so = session_options(2)    # the runtime's (the process may already own a global thread pool)
    so.log_severity_level = 1  # let the copy warning through if it happens
    sess = ort.InferenceSession(str(directory / "verify.onnx"), so, providers=["CPUExecutionProvider"])
    d = part["dims"]
    layers, shape = int(d["layers"]), (1, int(d["kv_heads"]), SHAPES.kv_capacity, int(d["head_dim"]))
    rng = np.random.default_rng(0)
    caches = [rng.standard_normal(shape).astype(np.float32) for _ in range(2 * layers)]
    before = [c.copy() for c in caches]
    ids, past_len = np.array([[7, 8, 9, 10]], np.int64), np.array([5], np.int64)
    b = sess.io_binding()
    hold = [ort.OrtValue.ortvalue_from_numpy(a) for a in (ids, past_len, *caches)]
    b.bind_ortvalue_input("input_ids", hold[0])
    b.bind_ortvalue_input("past_len", hold[1])
    b.bind_output("logits", "cpu")
    for i in range(layers):
        for j, kv in enumerate("kv"):
            v = hold[2 + 2 * i + j]
            b.bind_ortvalue_input(f"past_{kv}_{i}", v)
            b.bind_ortvalue_output(f"present_{kv}_{i}", v)
    capfd.readouterr()
    sess.run_with_iobinding(b)
    err = capfd.readouterr().err
    assert "in-place optimization not activated" not in err, err[-500:]
    for c, old in zip(caches, before):   # the numpy arrays themselves changed: same memory
        assert not np.array_equal(c[:, :, 5:9], old[:, :, 5:9])
        np.testing.assert_array_equal(c[:, :, :5], old[:, :, :5])
        np.testing.assert_array_equal(c[:, :, 9:], old[:, :, 9:])
    # the same step on copies (no sharing) gives the same cache rows and logits
    feed = {"input_ids": ids, "past_len": past_len,
            **{f"past_{kv}_{i}": before[2 * i + j] for i in range(layers) for j, kv in enumerate("kv")}}
    ref = sess.run(None, feed)
    np.testing.assert_allclose(b.copy_outputs_to_cpu()[0], ref[0], atol=1e-6)
    for c, r in zip(caches, ref[1:]):
        np.testing.assert_array_equal(c, r)


def test_the_torch_module_runs_eagerly_and_matches_transformers(tmp_path):
    """Outside export, TensorScatter is an index_copy and Attention torch's reference op,
    so the variant can be debugged in torch."""
    import torch

    lm = sources.load_source(make_tiny_model_dir(tmp_path / "model", "llama", layers=2))
    m = onnx_export.build_module(lm, 8, SHAPES.kv_capacity, attention="standard")
    d = lm.dims
    past = [torch.zeros(1, d.kv_heads, SHAPES.kv_capacity, d.head_dim) for _ in range(2 * d.layers)]
    ids = torch.tensor([[5, 9, 11, 30, 2, 7, 8, 100]])
    with torch.no_grad():
        logits, *present = m(ids, torch.tensor([0]), *past)
        ref = lm.model(ids).logits
    assert float((logits - ref).abs().max()) < 1e-4
    assert present[0].shape == past[0].shape and float(present[0][:, :, 8:].abs().max()) == 0.0


# --- through the real runtime --------------------------------------------------------

@pytest.fixture(scope="module")
def standard_engines(tmp_path_factory, tiny_pair):
    from conftest import build_tiny
    target, draft = tiny_pair
    return build_tiny(tmp_path_factory.mktemp("eng") / "standard", target, str(draft), attention="standard")


@pytest.fixture(scope="module")
def gqa_engines(tmp_path_factory, tiny_pair):
    from conftest import build_tiny
    target, draft = tiny_pair
    return build_tiny(tmp_path_factory.mktemp("eng") / "gqa", target, str(draft), attention="gqa")


def test_manifest_marks_the_standard_cache_update_in_place(standard_engines):
    from specrt import manifest as mf
    man = mf.load(standard_engines)
    assert man.target.in_place and man.draft.in_place, (man.target.kv, man.draft.kv)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_equals_the_gqa_graphs_at_fp32(standard_engines, gqa_engines, prompt):
    from specrt.runtime import SpeculativeGenerator

    std, gqa = SpeculativeGenerator(standard_engines), SpeculativeGenerator(gqa_engines)

    def tokens(g, method):
        return [e.token for e in g.tokens(prompt, max_new_tokens=40, method=method)]

    want = tokens(gqa, "plain")
    assert tokens(std, "speculative") == want
    assert tokens(std, "plain") == want
    assert tokens(gqa, "speculative") == want


def test_build_config_and_cli_accept_the_standard_variant():
    import subprocess
    import sys

    from specrt.builder.config import BuildConfig
    assert BuildConfig(target="m", out="o", draft="none", attention="standard").attention == "standard"
    p = subprocess.run([sys.executable, "-m", "specrt.cli", "build", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert "--attention {gqa,portable,standard}" in p.stdout, p.stdout[-1000:]
