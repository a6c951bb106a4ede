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
    with pytest.raises(ExportError, match="batched graph"):
        onnx_export.export_model(lm, SHAPES, tmp_path / "b", graphs=("decode",), batch=2, attention="rows",
                                 hidden_layers=(0,))


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
