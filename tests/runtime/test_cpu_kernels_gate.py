"""Quantized engines are bound to the int8 kernel path of the CPU they were built on
(manifest device.int8_kernels, specrt/cpu_features.py): a folder gated on VNNI/AMX dot products
is refused on an AVX2-only CPU, and the reverse, by every way of loading it. fp32 targets, int8
drafts and manifests written before the field load as before.

"This CPU" is pinned to "avx2" (monkeypatched into manifest_device.this_device) so the tests say the
same on any machine; the folders are tiny fixtures copied to tmp_path with device.int8_kernels
edited, as a folder copied from another machine would carry it."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import sys

import pytest
from bad_input_helpers import copy_engines, edit_manifest, expect

from specrt import cpu_features
from specrt import manifest as mf
from specrt import manifest_device
from specrt.errors import Int8KernelsError
from specrt.runtime import SpeculativeGenerator
from specrt.runtime.batch.generator import open_batch

HERE, OTHER = "avx2", "dot"


def _speculative(d):
    SpeculativeGenerator(d)


def _batch(d):
    open_batch(d, max_num_seqs=2).close()


LOADERS = {"SpeculativeGenerator": _speculative, "open_batch": _batch}


@pytest.fixture
def avx2_here(monkeypatch):
    monkeypatch.setattr(manifest_device, "int8_kernels", lambda: HERE)


def recorded(src, tmp_path, kernels: str | None):
    """A copy of the engine folder `src` whose manifest says it was built on `kernels` (None: no such key)."""
    d = copy_engines(src, tmp_path)

    def fn(m):
        m["device"].pop("int8_kernels", None)
        if kernels is not None:
            m["device"]["int8_kernels"] = kernels
    edit_manifest(d, fn)
    return d


@pytest.mark.parametrize("flags, machine, want", [
    ("fpu sse2 avx2 avx512f avx512_vnni", "x86_64", "dot"),        # Cascade Lake, Zen 4
    ("fpu sse2 avx2 avx_vnni", "x86_64", "dot"),                   # Alder Lake
    ("fpu sse2 avx2 amx_bf16 amx_int8 amx_tile", "x86_64", "dot"),  # Sapphire Rapids
    ("fpu sse2 avx2 fma bmi2", "x86_64", "avx2"),                   # Zen 1-3, Haswell
    ("fpu sse2 avx2 avx512f avx512_vnni", "AMD64", "dot"),          # Windows spells it AMD64
    ("fp asimd asimddp i8mm", "aarch64", "other"),
    (None, "x86_64", "unknown"),                                    # no /proc/cpuinfo
])
def test_int8_kernels_reads_the_dot_product_flags_from_cpuinfo(monkeypatch, flags, machine, want):
    text = None if flags is None else f"processor\t: 0\nvendor_id\t: X\nflags\t\t: {flags}\nbogomips\t: 1\n"
    monkeypatch.setattr(cpu_features, "_read_cpuinfo", lambda: text)
    monkeypatch.setattr(cpu_features, "_machine", lambda: machine)
    assert cpu_features.int8_kernels() == want


def test_a_build_records_this_cpus_int8_path_and_loads_here(tiny_batch_same_engines):
    assert mf.load(tiny_batch_same_engines).device["int8_kernels"] == cpu_features.int8_kernels()
    for load in LOADERS.values():
        load(tiny_batch_same_engines)


@pytest.mark.parametrize("how", LOADERS)
def test_a_quantized_folder_built_on_the_other_int8_path_is_refused_naming_the_fix(
        tiny_batch_same_engines, tmp_path, avx2_here, how):
    d = recorded(tiny_batch_same_engines, tmp_path, OTHER)
    msg = expect(Int8KernelsError, LOADERS[how], d)
    assert f"{OTHER!r} path" in msg and f"{HERE!r} path" in msg
    assert "target (int4) and batch (int4)" in msg
    assert "greedy speculative output = plain decoding" in msg and "independent of its batch" in msg
    assert "Rebuild the engines on this machine (`specrt build" in msg


@pytest.mark.parametrize("how", LOADERS)
def test_the_same_folder_recorded_with_this_cpus_path_loads(tiny_batch_same_engines, tmp_path, avx2_here, how):
    LOADERS[how](recorded(tiny_batch_same_engines, tmp_path, HERE))


@pytest.mark.parametrize("how", LOADERS)
def test_an_fp32_folder_recorded_with_the_other_path_loads(tiny_batch_rows_engines, tmp_path, avx2_here, how):
    d = recorded(tiny_batch_rows_engines, tmp_path, OTHER)
    assert {m.precision for m in mf.load(d).models.values()} == {"fp32"}
    LOADERS[how](d)


@pytest.mark.parametrize("value", [["dot"], 1, None])
def test_a_damaged_int8_path_is_a_manifest_error_not_a_crash(tiny_batch_same_engines, tmp_path, avx2_here, value):
    d = copy_engines(tiny_batch_same_engines, tmp_path)
    edit_manifest(d, lambda m: m["device"].update(int8_kernels=value))
    assert "device.int8_kernels must be a string" in expect(mf.ManifestError, mf.load, d)


@pytest.mark.parametrize("how", LOADERS)
def test_a_manifest_written_before_the_field_loads(tiny_batch_same_engines, tmp_path, avx2_here, how):
    LOADERS[how](recorded(tiny_batch_same_engines, tmp_path, None))


def test_an_int8_prompt_graph_binds_an_fp32_batched_model_an_int8_draft_and_an_unknown_cpu_do_not(tiny_batch_rows_engines):
    man = mf.load(tiny_batch_rows_engines)
    man = dataclasses.replace(man, device={**man.device, "int8_kernels": OTHER})
    t, b = man.target, man.batch
    draft = dataclasses.replace(t, role="draft", precision="int8-blockwise")
    mf.check_int8_kernels(dataclasses.replace(man, models={**man.models, "draft": draft}), HERE)
    # `--batch-prefill rowwise` on an fp32 target: prompt chunks run an int8 graph
    rowwise = dataclasses.replace(man, models={"target": t, "batch": dataclasses.replace(
        b, source={**b.source, "prefill_graph": {"precision": "int8"}})})
    with pytest.raises(Int8KernelsError, match=r"models batch \(fp32\) were built"):
        mf.check_int8_kernels(rowwise, HERE)
    mf.check_int8_kernels(rowwise, "unknown")        # flags unreadable here: nothing to compare
    mf.check_int8_kernels(dataclasses.replace(rowwise, device={**man.device, "int8_kernels": "unknown"}), HERE)


@pytest.mark.parametrize("kw", [{}, {"max_num_seqs": 2}], ids=["workers", "batched"])
def test_the_server_inherits_the_refusal(tiny_batch_same_engines, tmp_path, avx2_here, kw):
    from specrt.serve.server import ServeConfig, build_app
    _, pool = build_app(ServeConfig(str(recorded(tiny_batch_same_engines, tmp_path, OTHER)), **kw))
    expect(Int8KernelsError, pool.start)


@pytest.mark.parametrize("kw", [{}, {"max_num_seqs": 2}], ids=["one-request", "batched"])
def test_the_triton_model_inherits_the_refusal(tiny_batch_same_engines, tmp_path, avx2_here, monkeypatch, kw):
    from serve import fake_triton

    from specrt.serve.triton import write_triton_repo
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_triton.module())
    d = recorded(tiny_batch_same_engines, tmp_path, OTHER)
    model_dir = write_triton_repo(d, tmp_path / "repo", model_name="tiny", **kw)
    spec = importlib.util.spec_from_file_location("triton_model_under_test", model_dir / "1" / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    config = (model_dir / "config.pbtxt").read_text()
    params = dict(re.findall(r'key: "(\w+)" value: \{ string_value: ("(?:[^"\\]|\\.)*") \}', config))
    args = {"model_config": json.dumps({"parameters": {k: {"string_value": json.loads(v)} for k, v in params.items()}}),
            "model_repository": str(model_dir), "model_instance_kind": "CPU"}
    expect(Int8KernelsError, mod.TritonPythonModel().initialize, args)
