"""The target's precision as a build choice (int8 / int4 MatMulNBits, int8row: int8 per
channel through ONNX Runtime's int8 GEMM), on tiny random models: greedy speculative output is token-for-token plain decoding *of the same
target*, the manifest says how the weights were made, and a build whose decode and
verify graphs pick different tokens is refused with the fix named."""
from __future__ import annotations

import json

import pytest

from specrt.runtime import SpeculativeGenerator

PROMPTS = [[5, 6, 7], [40, 50, 60, 70, 80, 90, 100], list(range(10, 40)), [1, 99], [3, 60, 61, 62, 4, 3]]


@pytest.fixture(scope="module")
def int8_engines(tmp_path_factory, tiny_pair):
    from conftest import build_tiny
    return build_tiny(tmp_path_factory.mktemp("prec") / "int8", tiny_pair[0], "int8", precision="int8")


@pytest.fixture(scope="module")
def int4_engines(tiny_int4_engines):
    return tiny_int4_engines


@pytest.fixture(scope="module")
def int8row_engines(tmp_path_factory, tiny_pair):
    from conftest import build_tiny
    return build_tiny(tmp_path_factory.mktemp("prec") / "int8row", tiny_pair[0], "int8", precision="int8row",
                      batch=True)


def _tokens(g, ids, n, method):
    return [e.token for e in g.tokens(ids, max_new_tokens=n, method=method)]


@pytest.mark.parametrize("which", ["int8_engines", "int4_engines", "int8row_engines"])
def test_greedy_speculative_equals_plain_decoding_of_the_same_quantized_target(request, which):
    # the one-row graphs (the int8row folder also has a batched model, which a batch of one would
    # run, plainly here: these builds measure no step costs)
    g = SpeculativeGenerator(request.getfixturevalue(which), engine="one-row")
    accepted = 0
    for prompt in PROMPTS:
        plain = _tokens(g, prompt, 40, "plain")
        assert _tokens(g, prompt, 40, "speculative") == plain, prompt
        accepted += g.last_metrics.accepted
    assert accepted > 0    # the draft was used, not just the bonus tokens


@pytest.mark.parametrize("which,bits,block", [("int8_engines", 8, 32), ("int4_engines", 4, 16)])
def test_manifest_records_precision_and_how_it_was_made(request, which, bits, block):
    man = json.loads((request.getfixturevalue(which) / "manifest.json").read_text())
    t = man["models"]["target"]
    assert t["precision"] == which.split("_")[0]
    q = t["source"]["quantization"]
    assert q["method"] == "onnxruntime MatMulNBits" and q["bits"] == bits and q["block_size"] == block
    assert q["accuracy_level"] in (0, 1, 2, 3, 4) and isinstance(q["lm_head_quantized"], bool)
    ident = t["parity"]["identity"]
    assert ident["argmax_flips"] == 0 and ident["rows"] > 0 and "plain_decoding" in ident
    if q["accuracy_level"] == 4:   # plain decoding runs the verify pass's kernels: bit for bit
        assert ident["bitwise_equal"] and ident["max_abs_logit_delta"] == 0.0, ident
        assert "T=2" in q["decode_graph"]
        assert t["graphs"]["decode"]["tokens"] == 2     # a plain step pads a row; a pair round fills it
        assert "pair rounds" in ident["how"]            # the identity check replayed two-token windows too
    assert "graphs" in t["parity"]["fp32_export"] and "graphs" not in t["parity"]   # export parity, kept apart
    agree = t["parity"]["agreement_with_fp32"]
    assert 0 < agree["top1_agreement"] <= 1 and agree["positions"] > 0 and agree["mean_kl"] >= 0
    assert man["build"]["config"]["precision"] == which.split("_")[0]
    assert set(t["graphs"]) == {"prefill", "decode", "verify"}
    assert man["models"]["draft"]["source"]["quantization"]["bits"] == 8


def test_an_int8row_target_is_int8_per_channel_everywhere_with_a_two_row_decode_and_batch_invariant(
        int8row_engines):
    """--precision int8row: every target graph (and the batched step graph) runs ONNX Runtime's
    int8 GEMM (MatMulIntegerToFloat), no MatMulNBits; plain decoding runs the verify pass's
    kernels bit for bit (a two-row decode graph); the batched rows equal each row alone."""
    import onnx
    man = json.loads((int8row_engines / "manifest.json").read_text())
    t, b = man["models"]["target"], man["models"]["batch"]
    assert t["precision"] == "int8row" and t["source"]["quantization"]["method"].startswith("rowwise int8")
    assert "per channel" in t["source"]["derived"]
    for g in ("prefill", "decode", "verify"):
        ops = {n.op_type for n in onnx.load(str(int8row_engines / t["graphs"][g]["file"]),
                                            load_external_data=False).graph.node}
        assert "MatMulIntegerToFloat" in ops and "MatMulNBits" not in ops, (g, ops)
    assert t["graphs"]["decode"]["tokens"] == 2
    ident = t["parity"]["identity"]
    assert ident["bitwise_equal"] and ident["argmax_flips"] == 0
    assert b["parity"]["batch_invariance"]["equal"]
    assert 0 < t["parity"]["agreement_with_fp32"]["top1_agreement"] <= 1


def test_int8row_refuses_the_matmulnbits_options():
    from specrt.builder.config import BuildConfig
    from specrt.errors import ConfigError
    for kw in ({"block_size": 64}, {"accuracy_level": 1}, {"batch": True, "batch_block_size": 64}):
        with pytest.raises(ConfigError, match="MatMulNBits options"):
            BuildConfig(target="x", out="y", draft="none", precision="int8row", **kw)
    with pytest.raises(ConfigError, match="already row-wise"):
        BuildConfig(target="x", out="y", draft="none", precision="int8row", batch=True, batch_prefill="rowwise")
    cfg = BuildConfig(target="x", out="y", draft="none", precision="int8row", batch=True)
    assert cfg.batch_prefill_graph == "same"


def test_int4_weights_are_smaller_than_int8_weights(int8_engines, int4_engines):
    size = {p: json.loads((p / "manifest.json").read_text())["models"]["target"]["weights"]["bytes"]
            for p in (int8_engines, int4_engines)}
    assert size[int4_engines] < size[int8_engines]


def test_fp32_build_records_decode_verify_identity(tiny_self_engines):
    t = json.loads((tiny_self_engines / "manifest.json").read_text())["models"]["target"]
    assert t["precision"] == "fp32" and t["parity"]["identity"]["argmax_flips"] == 0


def test_build_refuses_a_target_whose_verify_graph_picks_other_tokens(tmp_path, tiny_pair, monkeypatch):
    """A verify graph rounded unlike the decode graph (here: deliberately 4-bit against an
    8-bit decode graph) is refused before anything is written."""
    from conftest import build_tiny
    from dataclasses import replace

    from specrt.calibration import quantize
    from specrt.errors import ParityError

    real = quantize.quantize_graph

    def mismatched(src, dst, spec, vocab):
        if src.name == "verify.onnx":
            spec = replace(spec, bits=4, block_size=16, accuracy_level=4)
        real(src, dst, spec, vocab)

    monkeypatch.setattr(quantize, "quantize_graph", mismatched)
    out = tmp_path / "broken"
    with pytest.raises(ParityError, match=r"verify graph .* picks another token .*--accuracy-level 4"):
        build_tiny(out, tiny_pair[0], "none", precision="int8", accuracy_level=1)
    assert not out.exists()


def test_config_refuses_unknown_precision_and_bad_block_size():
    from specrt.builder.config import BuildConfig
    from specrt.errors import SpecrtError
    with pytest.raises(SpecrtError, match="precision"):
        BuildConfig(target="x", out="y", draft="none", precision="int3")
    with pytest.raises(SpecrtError, match="block_size"):
        BuildConfig(target="x", out="y", draft="none", precision="int4", block_size=24)
    q = BuildConfig(target="x", out="y", draft="none", precision="int4", block_size=64,
                    quantize_lm_head=False).target_quantization
    assert q["bits"] == 4 and q["block_size"] == 64 and q["lm_head"] is False
    assert BuildConfig(target="x", out="y", draft="none").target_quantization is None


def test_one_token_interface_keeps_row_zero_of_a_two_row_graph(tmp_path, tiny_pair):
    """The wrapped T=2 graph takes [1,1] ids and returns row 0 of the T=2 graph, bit for bit."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from specrt.builder.gates.rows import one_token_interface
    from specrt.export import onnx_export, sources
    from specrt.runtime.backends.ort_cpu import session_options

    lm = sources.load_source(str(tiny_pair[0]))
    onnx_export.export_graph(onnx_export.build_module(lm, 2, 40, attention="gqa"), tmp_path / "t2.onnx")
    model = onnx.load(str(tmp_path / "t2.onnx"))
    wrapped = one_token_interface(onnx.load(str(tmp_path / "t2.onnx")))
    onnx.checker.check_model(wrapped)
    d = lm.dims
    cache = [np.random.default_rng(i).standard_normal((1, d.kv_heads, 40, d.head_dim)).astype(np.float32)
             for i in range(2 * d.layers)]
    names = [f"past_{kv}_{i}" for i in range(d.layers) for kv in ("k", "v")]

    def run(m, ids):
        s = ort.InferenceSession(m.SerializeToString(), session_options(2), providers=["CPUExecutionProvider"])
        return s.run(["logits"], {"input_ids": np.array([ids], np.int64), "past_len": np.array([7], np.int64),
                                  **{n: c.copy() for n, c in zip(names, cache)}})[0]

    one = run(wrapped, [42])
    assert one.shape == (1, 1, d.vocab)
    np.testing.assert_array_equal(one[0, 0], run(model, [42, 0])[0, 0])


def test_a_quantized_target_builds_without_a_draft_and_decodes_plainly(tmp_path, tiny_pair):
    from conftest import build_tiny
    out = build_tiny(tmp_path / "int4-plain", tiny_pair[0], "none", precision="int4", block_size=16)
    man = json.loads((out / "manifest.json").read_text())
    assert "draft" not in man["models"] and man["models"]["target"]["precision"] == "int4"
    g = SpeculativeGenerator(out)
    assert len(_tokens(g, PROMPTS[1], 20, "plain")) == 20


def test_inspect_shows_how_a_quantized_target_was_made_and_its_identity(int4_engines, capsys):
    from specrt import cli
    assert cli.main(["inspect", str(int4_engines)]) == 0
    out = capsys.readouterr().out
    assert "[target] llama int4" in out and "4-bit, block" in out
    assert "parity   fp32 export decode" in out
    assert "identity decode vs verify: 0 argmax flips" in out and "vs fp32  top-1 agreement" in out
