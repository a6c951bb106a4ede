"""Build-time parity and agreement run through the runtime's own backend (issue 9: one
driver). The old build driver mapped a graph's outputs by position while the runtime binds
them by name, so a graph whose outputs came in another order passed the build and then
served wrong K/V; now both bind by name."""
from __future__ import annotations

import onnx
from tiny_models import make_tiny_model_dir

from specrt import manifest as mf
from specrt import driver
from specrt.export import onnx_export, parity, sources
from specrt.runtime.backends.ort_cpu import OrtModel

SHAPES = mf.Shapes(batch=1, max_context=48, prefill_chunk=16, k=3)


def _reverse_kv_outputs(path):
    """Same graph, its K/V outputs listed in reverse order (names unchanged)."""
    m = onnx.load(str(path), load_external_data=False)
    outs = list(m.graph.output)
    kv = outs[1:]
    del m.graph.output[:]
    m.graph.output.extend([outs[0], *reversed(kv)])
    onnx.save(m, str(path))


def test_the_build_driver_is_the_runtime_backend_and_binds_outputs_by_name(tmp_path):
    lm = sources.load_source(make_tiny_model_dir(tmp_path / "model", "llama", layers=2))
    part = onnx_export.export_model(lm, SHAPES, tmp_path / "onnx", attention="portable")
    for g in part["graphs"].values():
        _reverse_kv_outputs(tmp_path / "onnx" / g["file"])
    gs = driver.GraphSet(tmp_path / "onnx", part["graphs"], part["dims"], SHAPES.kv_capacity)
    assert isinstance(gs.model, OrtModel)
    report = parity.check_parity(lm.model, tmp_path / "onnx", part, SHAPES, rtol=lm.spec.parity_rtol)
    for name in ("prefill", "decode", "verify"):
        assert report["graphs"][name]["argmax_agreement"] == 1.0
        assert report["graphs"][name]["max_abs_logit_delta"] < report["tolerance"]


def test_the_build_driver_reads_the_update_mode_and_dtype_off_the_graphs(tmp_path):
    lm = sources.load_source(make_tiny_model_dir(tmp_path / "model", "llama", layers=1))
    for attention, update in (("gqa", "in_place"), ("portable", "returned")):
        part = onnx_export.export_model(lm, SHAPES, tmp_path / attention, graphs=("decode",), attention=attention)
        entry = driver.build_entry(tmp_path / attention, part["graphs"], part["dims"])
        assert entry.kv == {"dtype": "float32", "update": update}
