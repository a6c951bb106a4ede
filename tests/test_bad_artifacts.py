"""Bad artifacts: missing or corrupt graph, weight and tokenizer files, manifests from
another version or for another device. Each is refused with a typed error that says to
rebuild, never with a traceback from ONNX Runtime."""
from __future__ import annotations

import shutil

import pytest

from specrt.runtime.backends.gpu_errors import CudaUnavailableError
from bad_input_helpers import copy_engines, edit_manifest, expect, prompt_of

from specrt.errors import (
    GraphFileError,
    ManifestError,
    SpecrtError,
)
from specrt.runtime import SpeculativeGenerator

MAX_CONTEXT = 96   # conftest.build_tiny's default
BUILT_K = 3        # conftest.build_tiny's default




# --------------------------------------------------------------------------- 5. missing / corrupt files


@pytest.mark.parametrize("rel", ["target/verify.onnx", "target/prefill.onnx", "draft/decode.onnx",
                                 "target/weights.bin", "draft/weights.bin", "tokenizer.json"])
def test_missing_graph_weight_or_tokenizer_file_raises_graph_file_error(tiny_engines, tmp_path, rel):
    d = copy_engines(tiny_engines, tmp_path)
    (d / rel).unlink()
    msg = expect(GraphFileError, SpeculativeGenerator, d)
    assert rel.split("/")[-1] in msg and "missing" in msg
    assert "rebuild" in msg


@pytest.mark.parametrize("rel", ["target/weights.bin", "draft/weights.bin"])
def test_truncated_weights_file_raises_graph_file_error(tiny_engines, tmp_path, rel):
    d = copy_engines(tiny_engines, tmp_path)
    data = (d / rel).read_bytes()
    (d / rel).write_bytes(data[:-4096])
    msg = expect(GraphFileError, SpeculativeGenerator, d)
    assert "truncated" in msg and str(len(data)) in msg
    assert "rebuild" in msg


def _garbage(data: bytes) -> bytes:
    return b"\x00this is not an onnx graph\xff" * 64


def _half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _empty(data: bytes) -> bytes:
    return b""


@pytest.mark.parametrize("damage", [_garbage, _half, _empty], ids=["garbage", "truncated", "empty"])
@pytest.mark.parametrize("rel", ["target/verify.onnx", "draft/decode.onnx"])
def test_corrupt_graph_file_raises_graph_file_error_not_an_onnxruntime_error(tiny_engines, tmp_path, rel, damage):
    d = copy_engines(tiny_engines, tmp_path)
    (d / rel).write_bytes(damage((d / rel).read_bytes()))
    with pytest.raises(SpecrtError) as ei:
        SpeculativeGenerator(d)
    e = ei.value
    assert type(e) is GraphFileError, f"{type(e).__module__}.{type(e).__name__}: {e}"
    assert "onnxruntime" not in type(e).__module__ and "onnx" not in type(e).__module__
    assert e.__cause__ is None and e.__suppress_context__   # raised `from None`: no chained ORT traceback
    msg = str(e)
    print(f"\n[GraphFileError] {msg}")
    assert rel.split("/")[-1] in msg and "corrupt" in msg and "rebuild" in msg


def test_graph_file_replaced_by_another_models_graph_raises_graph_file_error(tiny_engines, tmp_path):
    d = copy_engines(tiny_engines, tmp_path)
    shutil.copy(d / "draft" / "decode.onnx", d / "target" / "decode.onnx")   # 1-layer graph in a 3-layer slot
    msg = expect(GraphFileError, SpeculativeGenerator, d)
    assert "rebuild" in msg


def test_corrupt_tokenizer_file_raises_graph_file_error(tiny_engines, tmp_path):
    d = copy_engines(tiny_engines, tmp_path)
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {not json')
    msg = expect(GraphFileError, SpeculativeGenerator, d)
    assert "tokenizer" in msg and "corrupt" in msg and "rebuild" in msg


@pytest.mark.parametrize("rel", ["target/decode.onnx", "draft/weights.bin", "tokenizer.json"])
def test_verify_hashes_detects_a_modified_file_of_the_same_size(tiny_engines, tmp_path, rel):
    d = copy_engines(tiny_engines, tmp_path)
    data = bytearray((d / rel).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (d / rel).write_bytes(bytes(data))
    msg = expect(GraphFileError, SpeculativeGenerator, d, verify="full")
    assert "sha256" in msg and rel.split("/")[-1] in msg and "rebuild" in msg


def test_verify_hashes_accepts_an_intact_build(tiny_engines):
    SpeculativeGenerator(tiny_engines, verify="full")


# --------------------------------------------------------------------------- 6. manifest from another version


def test_manifest_with_another_schema_version_raises_manifest_error(tiny_engines, tmp_path):
    d = copy_engines(tiny_engines, tmp_path)
    edit_manifest(d, lambda m: m.__setitem__("schema_version", m["schema_version"] + 1))
    msg = expect(ManifestError, SpeculativeGenerator, d)
    assert "schema_version=2" in msg and "schema_version=1" in msg
    assert "rebuild" in msg


def test_manifest_that_is_not_json_raises_manifest_error(tiny_engines, tmp_path):
    d = copy_engines(tiny_engines, tmp_path)
    (d / "manifest.json").write_text('{"format": "specrt-manifest", "schema_')
    msg = expect(ManifestError, SpeculativeGenerator, d)
    assert "not valid JSON" in msg and "rebuild" in msg


def test_manifest_that_is_not_utf8_raises_manifest_error(tiny_engines, tmp_path):
    d = copy_engines(tiny_engines, tmp_path)
    (d / "manifest.json").write_bytes(b"\xff\xfe\x00garbage")
    msg = expect(ManifestError, SpeculativeGenerator, d)
    assert "rebuild" in msg


def test_missing_manifest_raises_manifest_error_saying_to_build(tmp_path):
    msg = expect(ManifestError, SpeculativeGenerator, tmp_path / "nowhere")
    assert "manifest.json" in msg and "specrt build" in msg


def test_folder_without_manifest_raises_manifest_error_saying_to_build(tiny_engines, tmp_path):
    d = copy_engines(tiny_engines, tmp_path)
    (d / "manifest.json").unlink()
    msg = expect(ManifestError, SpeculativeGenerator, d)
    assert "specrt build" in msg


@pytest.mark.parametrize("value", ["onnx-manifest", None], ids=["other-format", "no-format"])
def test_manifest_with_a_wrong_format_field_raises_manifest_error(tiny_engines, tmp_path, value):
    d = copy_engines(tiny_engines, tmp_path)
    edit_manifest(d, lambda m: m.__setitem__("format", value) if value else m.pop("format"))
    msg = expect(ManifestError, SpeculativeGenerator, d)
    assert "not a specrt manifest" in msg and "format=" in msg


def test_manifest_that_is_a_json_list_raises_manifest_error(tiny_engines, tmp_path):
    d = copy_engines(tiny_engines, tmp_path)
    (d / "manifest.json").write_text("[1, 2, 3]")
    expect(ManifestError, SpeculativeGenerator, d)


@pytest.mark.parametrize("edit", ["format", "no-target"])
def test_manifest_errors_about_format_or_missing_target_say_what_to_do(tiny_engines, tmp_path, edit):
    d = copy_engines(tiny_engines, tmp_path)
    if edit == "format":
        edit_manifest(d, lambda m: m.__setitem__("format", "onnx-manifest"))
    else:
        edit_manifest(d, lambda m: m["models"].pop("target"))
    msg = expect(ManifestError, SpeculativeGenerator, d)
    assert "rebuild" in msg or "specrt build" in msg


@pytest.mark.parametrize("edit", ["drop-shapes", "extra-shape-field", "drop-graph-sha", "drop-device"])
def test_manifest_with_missing_or_unknown_fields_raises_manifest_error(tiny_engines, tmp_path, edit):
    d = copy_engines(tiny_engines, tmp_path)

    def fn(m):
        if edit == "drop-shapes":
            del m["shapes"]
        elif edit == "extra-shape-field":
            m["shapes"]["beams"] = 4
        elif edit == "drop-graph-sha":
            del m["models"]["target"]["graphs"]["decode"]["sha256"]
        else:
            del m["device"]
    edit_manifest(d, fn)
    msg = expect(ManifestError, SpeculativeGenerator, d)
    assert "rebuild" in msg


@pytest.mark.parametrize("field,value,exc", [("max_context", "96", ManifestError),
                                             ("max_context", 200, GraphFileError), ("k", 5, ManifestError)])
def test_manifest_whose_shapes_do_not_match_its_graphs_raises_manifest_error(
        tiny_engines, tmp_path, field, value, exc):
    d = copy_engines(tiny_engines, tmp_path)
    edit_manifest(d, lambda m: m["shapes"].__setitem__(field, value))

    def load_and_run():
        g = SpeculativeGenerator(d)
        g.generate(prompt_of(20), max_new_tokens=8)
    msg = expect(exc, load_and_run)   # GraphFileError: the graphs disagree with the edited manifest
    assert "rebuild" in msg


# --------------------------------------------------------------------------- 7. manifest for another device


@pytest.mark.parametrize("key,value,hint,exc", [
    ("backend", "tensorrt", "rebuild with `specrt build` on this machine", ManifestError),
    ("machine", "aarch64-not-this-one", "rebuild the engines on this machine", ManifestError),
    ("os", "Windows-not-this-one", "rebuild the engines on this machine", ManifestError),
    # the ort-cuda backend refuses: a ManifestError that also says which package and GPU are missing
    ("kind", "cuda", "rebuild with `specrt build` on this machine", CudaUnavailableError),
])
def test_manifest_built_for_another_device_raises_manifest_error(tiny_engines, tmp_path, key, value, hint, exc):
    d = copy_engines(tiny_engines, tmp_path)
    edit_manifest(d, lambda m: m["device"].__setitem__(key, value))
    assert issubclass(exc, ManifestError)
    msg = expect(exc, SpeculativeGenerator, d)
    assert repr(value) in msg and hint in msg




def test_backends_are_chosen_from_the_manifest_through_the_registry(tiny_engines):
    from specrt import manifest as mf
    from specrt.runtime.backends import backend_for, registered
    assert [b.name for b in registered()] == ["ort-cpu", "ort-cuda", "tensorrt"]
    assert backend_for(mf.load(tiny_engines)).name == "ort-cpu"


@pytest.mark.parametrize("field, value", [("kv", "float16"), ("logits", "float16"), ("kv", "bfloat99")])
def test_manifest_dtypes_are_checked_against_the_graphs(tiny_engines, tmp_path, field, value):
    d = copy_engines(tiny_engines, tmp_path)
    edit_manifest(d, lambda m: m["models"]["target"]["io"]["dtypes"].__setitem__(field, value))
    msg = expect(ManifestError if value == "bfloat99" else GraphFileError, SpeculativeGenerator, d)
    assert value in msg and "rebuild" in msg
