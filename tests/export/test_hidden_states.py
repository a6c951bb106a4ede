"""Hidden states out of the target (issue 29, item 1): graphs exported with `hidden_layers`
also return `hidden_states` [1, T, n * hidden] fp32, the chosen decoder layers' outputs side
by side (what an EAGLE-3 head reads); without the option the graph is unchanged. Checked
against transformers' own hidden states on every attention variant, through ONNX Runtime."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import make_tiny_model_dir

from specrt import driver
from specrt import manifest as mf
from specrt.errors import ExportError
from specrt.export import onnx_export, sources

SHAPES = mf.Shapes(batch=1, max_context=64, prefill_chunk=16, k=3)
PROMPT = [(7 * i + 5) % 120 for i in range(16)]        # one full prefill chunk


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return sources.load_source(make_tiny_model_dir(tmp_path_factory.mktemp("m") / "model", "llama", layers=3))


def _run(directory, part, graph, ids, past_len=0):
    import onnxruntime as ort

    from specrt.runtime.backends.ort_cpu import session_options
    sess = ort.InferenceSession(str(directory / part["graphs"][graph]["file"]), session_options(2),
                                providers=["CPUExecutionProvider"])
    d = part["dims"]
    feed = {"input_ids": np.array([ids], np.int64), "past_len": np.array([past_len], np.int64)}
    for i in range(int(d["layers"])):
        for kv in ("past_key", "past_value"):
            feed[mf.IO_NAMES[kv] % i] = np.zeros((1, d["kv_heads"], SHAPES.kv_capacity, d["head_dim"]), np.float32)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feed)))


@pytest.mark.parametrize("attention", ["gqa", "portable", "standard"])
def test_hidden_states_are_the_chosen_layers_outputs_and_change_nothing_else(lm, tmp_path, attention):
    layers = (0, 1)                                    # not the last: transformers normalises that one
    plain = onnx_export.export_model(lm, SHAPES, tmp_path / "plain", graphs=("prefill",), attention=attention)
    part = onnx_export.export_model(lm, SHAPES, tmp_path / "hidden", graphs=("prefill",), attention=attention,
                                    hidden_layers=layers)
    C = int(lm.dims.hidden)
    assert "hidden_layers" not in plain["dims"] and part["dims"]["hidden_layers"] == [0, 1]
    out = _run(tmp_path / "hidden", part, "prefill", PROMPT)
    ref = _run(tmp_path / "plain", plain, "prefill", PROMPT)
    assert mf.HIDDEN_STATES not in ref                 # no cost where it is not asked for
    assert list(out)[:len(ref)] == list(ref) and list(out)[-1] == mf.HIDDEN_STATES
    np.testing.assert_array_equal(out["logits"], ref["logits"])
    with torch.no_grad():
        hs = lm.model(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states   # [0] = embeddings
    want = torch.cat([hs[i + 1] for i in layers], dim=-1).numpy()
    got = out[mf.HIDDEN_STATES]
    assert got.shape == (1, SHAPES.prefill_chunk, 2 * C) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_the_runtime_runs_a_graph_set_with_hidden_states_as_without(lm, tmp_path):
    """The CPU runner binds the outputs it reads; the extra output leaves its tokens alone."""
    tokens = {}
    for name, hidden in (("plain", ()), ("hidden", (1,))):
        part = onnx_export.export_model(lm, SHAPES, tmp_path / name, attention="gqa", hidden_layers=hidden)
        gs = driver.GraphSet(tmp_path / name, part["graphs"], part["dims"], SHAPES.kv_capacity, 2)
        tokens[name] = driver.greedy(gs, PROMPT[:11], 12).tokens
    assert tokens["hidden"] == tokens["plain"]


def test_bad_hidden_layers_are_refused(lm, tmp_path):
    for bad in ((3,), (1, 0), (-1,), (1, 1)):
        with pytest.raises(ExportError, match="hidden_layers"):
            onnx_export.export_model(lm, SHAPES, tmp_path / "x", graphs=("decode",), hidden_layers=bad)


@pytest.mark.parametrize("attention", ["rows", "portable", "standard"])
def test_the_batched_graph_returns_every_rows_hidden_states_at_every_position(lm, tmp_path, attention):
    """Two rows of one call at different past lengths (a prompt chunk, then a 4-token window on
    each): hidden_states [B, T, n*C] at every position of the window, whatever logit_pos binds,
    equal transformers' hidden states of each row's whole sequence at those positions."""
    import onnxruntime as ort

    from specrt.runtime.backends.ort_cpu import session_options
    layers = (0, 1)                                    # not the last: transformers normalises that one
    part = onnx_export.export_model(lm, SHAPES, tmp_path, attention=attention, batch="dynamic",
                                    tokens={"step": "dynamic"}, hidden_layers=layers)
    assert part["dims"]["hidden_layers"] == [0, 1]
    sess = ort.InferenceSession(str(tmp_path / part["graphs"]["step"]["file"]), session_options(2),
                                providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    assert names[-1] == mf.HIDDEN_STATES and names.count(mf.HIDDEN_STATES) == 1
    d, M = part["dims"], SHAPES.kv_capacity
    caches = [np.zeros((2, d["kv_heads"], M, d["head_dim"]), np.float32) for _ in range(2 * int(d["layers"]))]
    seqs = [PROMPT[:9] + [11, 12, 13, 14], PROMPT[3:15] + [21, 22, 23, 24]]   # prompts of 9 and 12, then 4

    def call(ids, lens, logit_pos):
        feed = {"input_ids": np.array(ids, np.int64), "past_len": np.array(lens, np.int64),
                "logit_pos": np.array(logit_pos, np.int64)}
        for i in range(int(d["layers"])):
            feed[f"past_k_{i}"], feed[f"past_v_{i}"] = caches[2 * i], caches[2 * i + 1]
        out = dict(zip(names, sess.run(None, feed)))
        if attention != "portable":         # in place in the runtime (bound outputs); a copy here
            for i in range(int(d["layers"])):
                caches[2 * i][:], caches[2 * i + 1][:] = out[f"present_k_{i}"], out[f"present_v_{i}"]
        else:                               # the caller writes the new K/V
            for i in range(int(d["layers"])):
                for j, kv in enumerate(("k", "v")):
                    for b, n in enumerate(lens):
                        caches[2 * i + j][b, :, n:n + len(ids[b])] = out[f"new_{kv}_{i}"][b]
        return out[mf.HIDDEN_STATES]

    got = []
    for b, s in enumerate(seqs):            # each prompt alone in its row (row b of a 2-row call)
        n = len(s) - 4
        ids = [[0] * n, [0] * n]
        ids[b] = s[:n]
        lens = [0, 0] if b == 0 else [9, 0]
        if b == 1:
            ids[0] = [0] * n                  # row 0 pads past its length: never read
        got.append(call(ids, lens, [[n - 1], [n - 1]])[b, :n])
    window = call([seqs[0][9:], seqs[1][12:]], [9, 12], [[0], [3]])
    assert window.shape == (2, 4, 2 * int(lm.dims.hidden)) and window.dtype == np.float32
    for b, s in enumerate(seqs):
        with torch.no_grad():
            hs = lm.model(torch.tensor([s]), output_hidden_states=True).hidden_states
        want = torch.cat([hs[i + 1] for i in layers], dim=-1)[0].numpy()
        n = len(s) - 4
        np.testing.assert_allclose(got[b], want[:n], atol=1e-4, rtol=1e-4, err_msg=f"row {b} prompt")
        np.testing.assert_allclose(window[b], want[n:], atol=1e-4, rtol=1e-4, err_msg=f"row {b} window")


def test_a_manifest_with_bad_hidden_layers_is_refused(tiny_engines, tmp_path):
    import json
    import shutil
    def edited(layers, name):
        d = tmp_path / f"e{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny_engines, d)
        raw = json.loads((d / "manifest.json").read_text())
        if layers is not None:
            raw["models"]["target"]["dims"]["hidden_layers"] = layers
        if name is not None:
            raw["models"]["target"]["io"]["hidden_states"] = name
        (d / "manifest.json").write_text(json.dumps(raw))
        return d

    for layers, name in (([], "hidden_states"), ([0, 0], "hidden_states"), ([99], "hidden_states"),
                         ("1", "hidden_states"), ([True], "hidden_states"), ([0], None), (None, "hidden_states")):
        with pytest.raises(mf.ManifestError, match="hidden_layers"):
            mf.load(edited(layers, name))
    assert mf.load(edited([0], "hidden_states")).target.dims["hidden_layers"] == [0]
