"""The kernel table (builder/gates/kernels.py, issue 28): each CPU matrix kernel family timed at
the shapes the folder's runtime runs, beside the family each shape runs. Timings are recorded,
never asserted (CI is a busy machine): these tests check what is timed and what is claimed."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest

from specrt import manifest as mf
from specrt.builder.config import PRECISIONS
from specrt.builder.gates import kernels
from specrt.calibration.quantize import QuantSpec
from specrt.cli import main

FAMILY_OPS = {"fp32": "MatMul", "int4": "MatMulNBits", "int8": "MatMulNBits", "int8row": "MatMulIntegerToFloat"}


def _shape(table, use):
    [row] = [r for r in table["shapes"] if r["use"] == use]
    return row


def test_the_build_records_which_family_each_runtime_shape_runs(tiny_batch_rows_draft_engines):
    man = mf.load(tiny_batch_rows_draft_engines)
    table = man.build["kernels"]
    assert table["measured_by"] == "specrt build" and set(table["families"]) == set(kernels.FAMILIES)
    uses = {r["use"]: r for r in table["shapes"]}
    # fp32 batched target with the int8 self-draft: steps run fp32, the draft's steps int8 MatMulNBits,
    # prompt chunks the step graph (no second prefill graph)
    assert uses["decode, 1 request"]["runs"] == "fp32" and uses["decode, 1 request"]["graph"] == "batch/step.onnx"
    assert uses[f"verify window (k={man.shapes.k}), 1 request"]["tokens"] == man.shapes.k + 1
    assert uses["decode, 24 requests"]["rows"] == 24
    assert uses["int8 self-draft, 1 request"]["runs"] == "int8"
    assert uses["int8 self-draft, 1 request"]["graph"] == "batch/draft.onnx"
    chunk = uses["prompt chunk"]
    assert (chunk["tokens"], chunk["logit_rows"], chunk["runs"]) == (man.shapes.prefill_chunk, 1, "fp32")
    # requests admitted together share prompt calls here (parity.prompt_rows): that call is timed too
    group = uses[f"prompts of {kernels.GROUP_ROWS} requests in one call"]
    assert (group["rows"], group["tokens"], group["logit_rows"]) == (kernels.GROUP_ROWS, kernels.GROUP_TOKENS,
                                                                    kernels.GROUP_ROWS)
    for r in table["shapes"]:
        assert set(r["ms"]) == set(kernels.FAMILIES) and all(v > 0 for v in r["ms"].values())
        assert (r["model"], r["layers"]) == ("batch", man.target.layers)
    # the tiny target's 3 layers: every projection shape counted once a layer, the LM head apart
    body = {k: v for k, v in table["matmuls"].items() if "LM head" not in k}
    assert body and all(v == man.target.layers for v in body.values())


def test_the_int4_folder_runs_int4_steps_and_rowwise_prompt_chunks(tiny_batch_engines):
    man = mf.load(tiny_batch_engines)
    table = kernels.measure(tiny_batch_engines, man, runs=1, warmup=0)
    assert _shape(table, "decode, 8 requests")["runs"] == "int4"
    assert _shape(table, "prompt chunk")["runs"] == "int8row"
    assert _shape(table, "prompt chunk")["graph"] == "batch/prefill.onnx"
    # the folder's own int4 settings are what the int4 column measures (block 16 here, not the default 32)
    assert table["families"]["int4"]["block_size"] == 16 != PRECISIONS["int4"]["block_size"]
    assert not any(r["use"].startswith("int8 self-draft") for r in table["shapes"])      # no draft: not run
    assert not any(r["use"].startswith("prompts of") for r in table["shapes"])   # GroupQueryAttention: one row a call


def test_rows_are_padded_where_the_graph_wants_even_rows(tiny_batch_b64_engines):
    man = mf.load(tiny_batch_b64_engines)
    assert man.batch.io.get("row_multiple") == 2
    rows = {r["use"]: r for r in kernels.runtime_shapes(man)}
    shape = {use: (r["rows"], r["tokens"], r["logit_rows"]) for use, r in rows.items()}
    c, k = man.shapes.prefill_chunk, man.shapes.k
    assert shape["decode, 1 request"] == (2, 1, 2)              # a lone one-token row: a padding row
    assert shape["decode, 8 requests"] == (8, 1, 8)
    assert shape["pair round, 1 request"] == (1, 2, 2)          # even already
    # one row of several tokens: one token more where odd, never a second row (that would time
    # twice the work: the table said a 64-token prompt chunk cost two rows' worth, 2026-12-07)
    assert shape[f"verify window (k={k}), 1 request"] == (1, k + 1 + (k + 1) % 2, k + 1 + (k + 1) % 2)
    assert shape["prompt chunk"] == (1, c + c % 2, 2)           # one logit position, padded to two


def test_the_table_times_the_calls_the_runtime_binds(tiny_batch_b64_engines, monkeypatch):
    """What the engine really runs on a padded folder (a long prompt in chunks, then steps), as
    the calls bound in ONNX Runtime: the table's prompt chunk and one-request decode are those."""
    from specrt.runtime.backends.ort_batch import OrtBatchModel
    from specrt.runtime.batch.folder import batch_engine
    from specrt.runtime.batch.request import Request
    from specrt.runtime.sampling import SamplingParams
    bound = set()
    real = OrtBatchModel._binding

    def spy(self, graph, first_row, n, T, P, alone=None):
        bound.add((self._file_of[graph], n, T, n * P))
        return real(self, graph, first_row, n, T, P, alone)

    monkeypatch.setattr(OrtBatchModel, "_binding", spy)
    man = mf.load(tiny_batch_b64_engines)
    # the engine stepped here, not on the generator's thread: which prompt is prefilled beside a
    # running row must not depend on when the second request reached the thread
    eng, _ = batch_engine(tiny_batch_b64_engines, max_num_seqs=2)
    lone = eng.lone_prefill_tokens
    assert lone > man.shapes.prefill_chunk                      # the folder showed its chunks give the same bits
    rng = np.random.default_rng(0)
    # both queued before the first step: the first prompt is prefilled alone (the larger chunks),
    # the second's first chunk beside the first's decoding (the folder's chunk)
    for _ in range(2):
        eng.add(Request([int(t) for t in rng.integers(3, 100, lone + 3)], 12, SamplingParams(), 0, ignore_eos=True))
    for _ in range(500):
        if not eng.step() and eng.idle():
            break
    assert eng.idle()
    rows = {r["use"]: r for r in kernels.runtime_shapes(man)}
    assert rows["prompt chunk, a request alone"]["tokens"] == lone
    for use in ("prompt chunk", "prompt chunk, a request alone", "decode, 1 request"):
        r = rows[use]
        assert (r["graph"], r["rows"], r["tokens"], r["logit_rows"]) in bound, (use, sorted(bound))


def test_a_one_row_folder_times_its_own_graphs(tiny_int4_engines):
    man = mf.load(tiny_int4_engines)
    rows = {r["use"]: r for r in kernels.runtime_shapes(man)}
    assert rows["decode, 1 request"]["tokens"] == 2          # int8 compute: the two-row decode graph
    assert rows["decode, 1 request"]["graph"] == man.target.graphs["decode"].file
    assert rows["draft step"]["graph"] == man.draft.graphs["decode"].file
    assert rows["prompt chunk"]["graph"] == man.target.graphs["prefill"].file
    assert kernels.family_of(man.target.source["quantization"]) == "int4"
    assert kernels.family_of(man.draft.source["quantization"]) == "int8"
    assert kernels.family_of({"method": "onnxruntime quantize_dynamic"}) == "int8dyn"    # not a timed family


def test_the_weight_shapes_read_from_an_int4_graph_are_the_fp32_graphs(tiny_engines, tiny_int4_engines):
    fp32, int4 = mf.load(tiny_engines), mf.load(tiny_int4_engines)
    d = fp32.target.dims
    a = kernels.weight_shapes(tiny_engines / fp32.target.graphs["verify"].file, d["vocab"], d["head_dim"])
    b = kernels.weight_shapes(tiny_int4_engines / int4.target.graphs["verify"].file, d["vocab"], d["head_dim"])
    assert a == b and a[1] == (d["hidden"], d["vocab"])
    assert all(count == fp32.target.layers for count in a[0].values())


@pytest.mark.parametrize("family", kernels.FAMILIES)
def test_each_family_times_the_product_it_claims(family):
    """A timed graph that computed nothing (or the fp32 product under another name) would make
    the table a lie: each family's graph gives x @ W within its quantization error, by its op."""
    spec = None if family == "fp32" else QuantSpec(**PRECISIONS[family])
    model = kernels._graph({(64, 48): 1, (96, 64): 1}, copies=2, seed=0)
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    q = kernels._quantized(model, spec)
    ops = {n.op_type for n in q.graph.node}
    assert FAMILY_OPS[family] in ops and (family == "fp32" or "MatMul" not in ops)
    if spec is not None and spec.method == "matmulnbits":
        bits = {onnx.helper.get_attribute_value(a) for n in q.graph.node if n.op_type == "MatMulNBits"
                for a in n.attribute if a.name == "bits"}
        assert bits == {spec.bits}
    rng = np.random.default_rng(1)
    x = {"x_64": rng.standard_normal((5, 64), dtype=np.float32), "x_96": rng.standard_normal((5, 96), dtype=np.float32)}
    [y] = kernels._session(q).run(None, x)
    want = np.concatenate([x["x_64"] @ weights[f"w_64_48_{j}"][:, :1] for j in range(2)]
                          + [x["x_96"] @ weights[f"w_96_64_{j}"][:, :1] for j in range(2)], axis=1)
    tol = {"fp32": 1e-5, "int8": 0.02, "int8row": 0.03, "int4": 0.15}[family] * np.abs(want).max()
    assert y.shape == want.shape and np.abs(y - want).max() <= tol


def test_inspect_shows_the_table_with_the_family_each_shape_runs(tiny_batch_rows_draft_engines, capsys):
    assert main(["inspect", str(tiny_batch_rows_draft_engines)]) == 0
    out = capsys.readouterr().out
    assert "kernels    weight MatMuls" in out
    [line] = [ln for ln in out.splitlines() if ln.strip().startswith("int8 self-draft, 1 request")]
    cells = line.split()[-5:-1]                                 # fp32 int4 int8 int8row
    assert [c.startswith("*") for c in cells] == [False, False, True, False]


def test_the_summary_names_where_another_family_is_faster():
    from specrt.tools.describe import kernel_faster, kernel_summary
    table = {"shapes": [
        {"use": "decode, 1 request", "runs": "int4", "fastest": "int4", "ms": {"int4": 4.0, "int8row": 4.4}},
        {"use": "decode, 24 requests", "runs": "int4", "fastest": "int8row", "ms": {"int4": 18.0, "int8row": 9.0}},
        {"use": "decode, 8 requests", "runs": "int4", "fastest": "int8row", "ms": {"int4": 8.0, "int8row": 7.6}}]}
    assert [(sh["use"], fam, round(r, 2)) for sh, fam, r in kernel_faster(table)] == [("decode, 24 requests", "int8row", 0.5)]
    line = kernel_summary(table)
    assert "1 of 3" in line and "decode, 24 requests, int8row x0.50" in line
    table["shapes"][1]["ms"]["int8row"] = 17.0                 # within 10%: nothing to say
    assert kernel_summary(table) is None


def _step(use, rows, runs, ms, tokens=1, model="batch"):
    return {"use": use, "rows": rows, "tokens": tokens, "model": model, "runs": runs, "ms": ms,
            "fastest": min(ms, key=ms.get)}


def test_the_server_notes_a_faster_family_at_its_widest_step():
    """specrt serve --max-num-seqs N: the widest decode step the table has at or below N decides;
    one row, draft shapes, windows and another model's shapes never do."""
    from specrt.tools.describe import serving_hint
    table = {"measured_by": "specrt retime", "shapes": [
        _step("decode, 1 request", 1, "int4", {"int4": 4.0, "int8row": 2.0}),
        _step("decode, 8 requests", 8, "int4", {"int4": 8.0, "int8row": 7.6}),
        _step("decode, 24 requests", 24, "int4", {"int4": 18.0, "int8row": 9.0}),
        _step("verify windows, 8 requests", 8, "int4", {"int4": 30.0, "int8row": 10.0}, tokens=5),
        _step("int8 self-draft, 8 requests", 8, "int8", {"int8": 30.0, "int8row": 10.0}),
        _step("draft model, 8 requests", 8, "int4", {"int4": 30.0, "int8row": 10.0}, model="batch_draft")]}
    assert serving_hint(table, 1) is None                   # the single stream: not this note
    assert serving_hint(table, 16) is None                  # 8 rows: int8row within 10%
    note = serving_hint(table, 32)
    assert note.startswith("at 24 requests") and "18.0 ms in this folder's int4 and 9.0 ms in int8row (x0.50" in note
    assert "--precision int8row" in note and "specrt retime" in note
    table["shapes"][2]["runs"] = "int8row"                  # the folder already runs the fastest
    assert serving_hint(table, 32) is None
    assert serving_hint({"shapes": []}, 8) is None


def test_serve_prints_the_note_before_loading(tiny_batch_engines, tmp_path, monkeypatch, capsys):
    import shutil

    from specrt import commands
    folder = shutil.copytree(tiny_batch_engines, tmp_path / "eng")
    man = mf.load(folder)
    table = {"measured_by": "a test", "shapes": [_step("decode, 8 requests", 8, "int4", {"int4": 8.0, "int8row": 4.0})]}
    dataclasses.replace(man, build={**man.build, "kernels": table}).save(folder)
    commands._serving_hint(str(folder), 8)
    assert "specrt: note: at 8 requests" in capsys.readouterr().err
    commands._serving_hint(str(folder), 1)
    commands._serving_hint(str(tmp_path / "missing"), 8)          # the server says why it cannot start: no note
    assert capsys.readouterr().err == ""


def test_a_separate_draft_is_timed_on_its_own_layers(tiny_engines):
    """The one-row folder's draft is another model (1 layer against the target's 3): its row is
    timed on its own graph's weights, not the target's."""
    man = mf.load(tiny_engines)
    assert (man.target.layers, man.draft.layers) == (3, 1)
    table = kernels.measure(tiny_engines, man, runs=1, warmup=0)
    rows = {r["use"]: r for r in table["shapes"]}
    assert (rows["draft step"]["model"], rows["draft step"]["layers"]) == ("draft", 1)
    assert (rows["decode, 1 request"]["model"], rows["decode, 1 request"]["layers"]) == ("target", 3)
    # what is timed: the draft graph's own projections, scaled to its 1 layer (the target's to 3)
    parts, plan = kernels._parts(tiny_engines, man, kernels.runtime_shapes(man))
    for graph, layers in ((man.draft.graphs["decode"].file, 1), (man.target.graphs["decode"].file, 3)):
        (key, scale, what), _ = plan[graph]
        mats, copies = parts[key]
        assert what == "body" and round(scale * copies) == layers


def test_a_draft_model_inside_the_batch_has_its_rows(tiny_batch_rows_model_engines):
    man = mf.load(tiny_batch_rows_model_engines)
    table = kernels.measure(tiny_batch_rows_model_engines, man, runs=1, warmup=0)
    rows = {r["use"]: r for r in table["shapes"]}
    draft = rows["draft model, 8 requests"]
    assert (draft["model"], draft["layers"], draft["graph"]) == ("batch_draft", 2, man.batch_draft.graphs["step"].file)
    assert draft["runs"] == "fp32" and rows["decode, 8 requests"]["layers"] == 3


def test_large_matrices_are_timed_on_a_slice(monkeypatch, tiny_batch_rows_engines):
    """A layer or LM head past MAX_PARAMS (a 7B model's [4096, 128256] head is 2 GiB in fp32, over
    protobuf's limit) is timed on a slice of its columns and scaled, never built whole."""
    man = mf.load(tiny_batch_rows_engines)
    monkeypatch.setattr(kernels, "MAX_PARAMS", 2000)
    parts, plan = kernels._parts(tiny_batch_rows_engines, man, kernels.runtime_shapes(man))
    for mats, copies in parts.values():
        assert copies == 1 and sum(k * n * c for (k, n), c in mats.items()) <= 2000 * 2
    step = plan[man.batch.graphs["step"].file]
    assert all(scale > 1 for _, scale, _ in step)


def test_a_table_that_could_not_be_measured_is_said_so(tiny_batch_rows_draft_engines, tmp_path, monkeypatch, capsys):
    from specrt.tools.describe import kernel_lines
    from specrt.tools.retime import retime
    from tests.bad_input_helpers import copy_engines
    assert kernel_lines({"error": "ValueError: boom"}) == [
        "kernels    not measured: ValueError: boom (`specrt retime` measures it again)"]
    eng = copy_engines(tiny_batch_rows_draft_engines, tmp_path)
    before = mf.load(eng).build["kernels"]

    def boom(*a, **k):
        raise RuntimeError("no memory")
    monkeypatch.setattr(kernels, "measure", boom)
    spec = retime(eng, out=print)
    after = mf.load(eng).build
    assert after["kernels"] == before and after["speculation"]["retimed"]["by"] == spec["retimed"]["by"]
    assert "could not be measured (RuntimeError: no memory)" in capsys.readouterr().out
