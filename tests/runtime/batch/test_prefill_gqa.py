"""`--batch-prefill rowwise-gqa` (the int4 `--batch` default): the batched model's prompt graph
attends with ONNX Runtime's GroupQueryAttention over the cache of a "rows" step graph.

What must hold: it computes what the rows prompt graph computes (the same weights; only the
attention kernel differs, so its K/V and logits are within rounding of the rowwise folder's);
a prompt's numbers do not depend on the cache row it is fed into or the cache length bound
(the build gate prompt_invariance, builder/gates/chunks.py); the build refuses a graph that
fails that gate, naming the flag; GroupQueryAttention's one-row limit applies to the prompt
graph only, so the rows step graph still verifies windows in many rows."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from specrt.builder.gates.chunks import _feed
from specrt.errors import BackendError, ConfigError, ParityError
from specrt.manifest import load


def _ops(path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


def _model(engines):
    from specrt.runtime.backends.ort_batch import OrtBatchModel
    man = load(engines)
    return OrtBatchModel(engines, man.batch, man.shapes, rows=3, graphs=("step", "prefill")), man


def test_the_build_exports_a_gqa_prompt_graph_beside_the_rows_step_graph_and_gates_it(tiny_batch_int4_engines):
    e = tiny_batch_int4_engines
    b = json.loads((e / "manifest.json").read_text())["models"]["batch"]
    assert set(b["graphs"]) == {"step", "prefill", "draft"}
    assert "GroupQueryAttention" in _ops(e / "batch/prefill.onnx")
    assert "GroupQueryAttention" not in _ops(e / "batch/step.onnx")
    assert "MatMulIntegerToFloat" in _ops(e / "batch/prefill.onnx") and "MatMulNBits" in _ops(e / "batch/step.onnx")
    assert b["source"]["attention"] == "rows" and b["source"]["prefill_graph"]["attention"] == "gqa"
    assert b["source"]["draft_graph"]["attention"] == "gqa"
    pi = b["parity"]["prompt_invariance"]
    assert pi["equal"] is True and pi["max_abs_kv_delta"] == 0.0
    assert pi["lengths"][0] < pi["lengths"][2]          # fed over caches of different lengths
    assert b["parity"]["chunk_invariance"]["equal"] is True
    assert b["parity"]["window_invariance"]["equal"] is True     # the step graph still verifies windows


def test_it_computes_what_the_rows_prompt_graph_computes(tiny_batch_int4_engines, tiny_batch_int4_rowwise_engines):
    """Same weights, another attention kernel: K/V and logits within rounding, the same argmax,
    and the decode step after it (the int4 rows step graph, the same in both) agrees too."""
    ids = [int(t) for t in np.random.default_rng(0).integers(5, 120, 45)]    # 3 chunks of 16, the last short
    got = []
    for e in (tiny_batch_int4_engines, tiny_batch_int4_rowwise_engines):
        model, man = _model(e)
        assert ("GroupQueryAttention" in _ops(e / "batch/prefill.onnx")) == (e == tiny_batch_int4_engines)
        last, kv = _feed(model, 0, ids, man.shapes.prefill_chunk)
        nxt = model.step("decode", np.array([[int(np.argmax(last))]]), np.array([len(ids)]), 0)[0, 0].copy()
        got.append((last, kv, nxt))
    (la, ka, na), (lb, kb, nb) = got
    assert int(np.argmax(la)) == int(np.argmax(lb)) and int(np.argmax(na)) == int(np.argmax(nb))
    assert np.max(np.abs(la - lb)) < 1e-3 * np.max(np.abs(lb)) and np.max(np.abs(na - nb)) < 1e-3 * np.max(np.abs(nb))
    for a, b in zip(ka, kb):
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)


def test_a_prompt_gives_the_same_bits_in_any_row_beside_any_cache(tiny_batch_int4_engines):
    """The engine's own calls: a prompt fed alone, then into row 2 beside a long row (its chunks
    over a cache of their own), its chunks taking turns with another prompt's in row 1 (each
    chunk starts from what its own row holds), and into row 1 bound over the whole capacity."""
    model, man = _model(tiny_batch_int4_engines)
    C, ids, other = man.shapes.prefill_chunk, list(range(7, 42)), list(range(50, 85))
    alone = _feed(model, 0, ids, C)
    _feed(model, 0, list(range(3, 3 + man.shapes.max_context - 2)), C)
    for s in range(0, len(ids), C):         # rows 2 and 1 in turns, chunk by chunk
        for row, p in ((2, ids), (1, other)):
            piece = p[s:s + C]
            last = model.step("prefill", np.array([piece]), np.array([s]), row, np.array([[len(piece) - 1]]),
                              pad_start=0)[0, -1].copy()
            if row == 2:
                got = last
    assert np.array_equal(got, alone[0])
    assert all(np.array_equal(a[2, :, :len(ids)], b) for a, b in zip(model.cache.keys + model.cache.values, alone[1]))
    last, kv = _feed(model, 1, ids, C, man.shapes.kv_capacity)
    assert np.array_equal(last, alone[0]) and all(np.array_equal(a, b) for a, b in zip(kv, alone[1]))


def test_the_one_row_limit_is_the_prompt_graphs_alone(tiny_batch_int4_engines):
    model, _ = _model(tiny_batch_int4_engines)
    assert model.multi_token_rows is None              # the rows step graph: windows in many rows
    toks, starts = np.ones((2, 3), np.int64), np.zeros(2, np.int64)
    assert model.step("verify", toks, starts, 0).shape[:2] == (2, 3)
    with pytest.raises(BackendError, match="at most 1 row"):
        model.step("prefill", toks, starts, 0)


def test_a_prompt_graph_that_depends_on_its_row_is_refused_naming_the_flag(tiny_pair, tmp_path, monkeypatch):
    """A deliberately non-invariant prompt graph: its logits perturbed in every row but the
    first. The gate sees it and the build stops with a ParityError naming --batch-prefill
    rowwise; nothing is written to --out."""
    from conftest import build_tiny
    from specrt.runtime.backends.ort_batch import OrtBatchModel
    real = OrtBatchModel.step

    def step(self, graph, tokens, starts, first_row=0, *a, **k):
        out = real(self, graph, tokens, starts, first_row, *a, **k)
        return out + 1e-3 if graph == "prefill" and first_row > 0 else out
    monkeypatch.setattr(OrtBatchModel, "step", step)
    with pytest.raises(ParityError, match="--batch-prefill rowwise"):
        build_tiny(tmp_path / "bad", tiny_pair[0], "none", precision="int4", block_size=16, batch=True,
                   ngram_tokens=0)
    assert not (tmp_path / "bad" / "manifest.json").exists()


def test_a_prompt_graph_computing_otherwise_than_the_step_graph_is_refused(tiny_pair, tmp_path, monkeypatch):
    """The fp32 check before quantization: the GroupQueryAttention prompt graph against the rows
    step graph, same prompt. Recorded on a good build (fp32 rounding apart); a prompt graph
    whose K/V were written another way (here: its logits and cache moved by 1e-2, as a rotary
    convention apart would move them far more) stops the build, naming the flag."""
    from conftest import build_tiny
    from specrt.runtime.backends.ort_batch import OrtBatchModel
    real = OrtBatchModel.step

    def step(self, graph, tokens, starts, first_row=0, *a, **k):
        out = real(self, graph, tokens, starts, first_row, *a, **k)
        if graph == "prefill" and self._file_of["prefill"].endswith("prefill.onnx") and self.entry.precision == "fp32":
            for kv in self.cache.keys:
                kv[first_row] *= 1.01
            return out + 1e-2
        return out
    monkeypatch.setattr(OrtBatchModel, "step", step)
    with pytest.raises(ParityError, match="does not compute what its step graph computes.*--batch-prefill rowwise"):
        build_tiny(tmp_path / "bad", tiny_pair[0], "none", precision="int4", block_size=16, batch=True,
                   ngram_tokens=0)


def test_the_good_build_records_the_fp32_agreement(tiny_batch_int4_engines):
    pa = json.loads((tiny_batch_int4_engines / "manifest.json").read_text())["models"]["batch"]["parity"][
        "prompt_agreement_fp32"]
    assert pa["agrees"] is True and 0 < pa["tokens"]
    assert pa["max_abs_logit_delta"] < 1e-3 and pa["max_rel_kv_delta"] < 1e-5


def test_the_choice_and_its_limits(tmp_path):
    from specrt.builder.config import BuildConfig
    from specrt.builder.gates.batch import prefill_attention
    cfg = BuildConfig(target="t", out="o", precision="int4", batch=True)
    assert cfg.batch_prefill_graph == "rowwise-gqa"
    assert prefill_attention(cfg, "rows") == "gqa"
    assert prefill_attention(cfg, "gqa") is None                 # the step graph's own attention already
    assert prefill_attention(cfg, "standard") is None            # auto: rowwise where it cannot share the cache
    with pytest.raises(ConfigError, match="--batch-attention rows"):
        prefill_attention(cfg.with_(batch_prefill="rowwise-gqa"), "standard")
    assert prefill_attention(cfg.with_(batch_prefill="rowwise"), "rows") is None
    with pytest.raises(ConfigError, match="--batch-prefill rowwise"):
        BuildConfig(target="t", out="o", precision="int4", batch=True, batch_prefill="rowwise-gqa",
                    hidden_layers=(0,))
    with pytest.raises(ConfigError, match="--batch-attention rows"):      # refused before the long build
        BuildConfig(target="t", out="o", precision="int4", batch=True, batch_prefill="rowwise-gqa",
                    attention="standard")
    assert BuildConfig(target="t", out="o", precision="int4", batch=True, batch_prefill="rowwise-gqa",
                       attention="standard", batch_attention="rows").batch_prefill_graph == "rowwise-gqa"


def test_inspect_names_the_prompt_graphs_attention(tiny_batch_int4_engines, tiny_batch_int4_rowwise_engines):
    from specrt.tools.describe import describe
    text = describe(load(tiny_batch_int4_engines))
    line = next(x for x in text.splitlines() if x.strip().startswith("prefill  rowwise"))
    assert ", attention gqa:" in line and "the same bits in any cache row and length" in line
    other = describe(load(tiny_batch_int4_rowwise_engines))
    assert "attention gqa:" not in next(x for x in other.splitlines() if x.strip().startswith("prefill  rowwise"))


def test_a_one_token_prompt_chunk_runs_as_two_tokens_through_group_query_attention(tiny_batch_int4_engines):
    """GroupQueryAttention's one-token path rounds apart from its several-token path (~4e-6 in
    a K/V on SmolLM2 int4, ~1.4 in a logit after int8 row scales), so a prompt one past a
    multiple of the chunk would get other numbers in chunks of 64 than of 256. The runtime runs
    such a chunk as two tokens, one row (never as a padding row beside it): every prompt
    position takes the several-token path. What it returns and writes is the one token's."""
    model, man = _model(tiny_batch_int4_engines)
    ids, s = list(range(9, 9 + 17)), 16
    _feed(model, 0, ids[:s], man.shapes.prefill_chunk)
    model._bindings.clear()
    got = model.step("prefill", np.array([[ids[s]]]), np.array([s]), 0, np.array([[0]]), pad_start=0)
    assert got.shape == (1, 1, int(man.batch.dims["vocab"]))
    assert [(k[0].rsplit("/", 1)[-1], k[2], k[3]) for k in model._bindings] == [("prefill.onnx", 1, 2)]
    every = model.step("prefill", np.array([[ids[s]]]), np.array([s]), 0)           # no positions: all T
    assert every.shape == got.shape and np.array_equal(every, got)
    whole = _feed(model, 1, ids, 32)            # the same prompt in one chunk, row 1
    assert np.array_equal(got[0, 0], whole[0])
    assert all(np.array_equal(a[0, :, :s + 1], b) for a, b in zip(model.cache.keys + model.cache.values, whole[1]))
    # the step graph (rows attention) runs a one-token call as it is
    model._bindings.clear()
    model.step("decode", np.array([[ids[s]]]), np.array([s]), 0)
    assert [(k[2], k[3]) for k in model._bindings] == [(1, 1)]
