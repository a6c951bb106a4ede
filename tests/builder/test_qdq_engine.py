"""`specrt qdq` writes a runnable engine folder: the Q/DQ target, the source's tokenizer and
draft, a manifest with hashes, the decode/verify identity check; written through outdir.py
(a failed run leaves the previous folder, a user's folder is refused, a re-run replaces)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specrt import manifest as mf
from specrt.builder import qdq_engine
from specrt.builder.gates import identity
from specrt.calibration import qdq
from specrt.errors import BuildOutputError, ConfigError, GraphFileError, ParityError
from specrt.runtime import SpeculativeGenerator
from specrt.runtime.backends.ort_cpu import kernel_fingerprint

SMALL = qdq.QDQSpec(prompts=3, eval_prompts=2, decode_steps=6)
TINY = qdq.QDQSpec(prompts=1, eval_prompts=1, decode_steps=2)
PROMPTS = [[5, 6, 7], [40, 50, 60, 70, 80, 90, 100], list(range(10, 40))]


@pytest.fixture(scope="module")
def shared(tiny_self_engines, tmp_path_factory):
    """From the tiny target with its int8 draft that reads the target's cache."""
    out = tmp_path_factory.mktemp("qdq-shared") / "out"
    qdq_engine.make_qdq(tiny_self_engines, out, SMALL, progress=lambda s: None)
    return out


@pytest.fixture(scope="module")
def own(tiny_engines, tmp_path_factory):
    """From the tiny target with a separate 1-layer draft (own cache), through the CLI."""
    from specrt.cli import main
    out = tmp_path_factory.mktemp("qdq-own") / "out"
    assert main(["qdq", str(tiny_engines), "--out", str(out), "--prompts", "2", "--eval-prompts", "1",
                 "--decode-steps", "4", "--quiet"]) == 0
    return out


def _tokens(g, ids, n, method):
    return [e.token for e in g.tokens(ids, max_new_tokens=n, method=method)]


@pytest.mark.parametrize("which", ["shared", "own"])
def test_the_folder_runs_and_greedy_speculative_equals_plain(which, request):
    gen = SpeculativeGenerator(request.getfixturevalue(which))
    assert gen.manifest.target.precision == "int8-qdq" and gen.draft is not None
    for ids in PROMPTS:
        plain = _tokens(gen, ids, 30, "plain")
        assert len(plain) == 30 and _tokens(gen, ids, 30, "speculative") == plain
    assert gen.generate("Hello", max_new_tokens=5).text is not None


def test_manifest_describes_the_qdq_target_its_tokenizer_and_draft(shared, tiny_self_engines):
    src, man = mf.load(tiny_self_engines), mf.load(shared)
    mf.check_files(man, shared, hashes=True)
    t = man.target
    assert t.precision == "int8-qdq" and t.dims == src.target.dims and t.kv == src.target.kv
    assert set(t.graphs) == {"prefill", "decode", "verify"} and man.shapes == src.shapes
    assert all(g.file.startswith("target/") for g in t.graphs.values()) and t.weights["file"] == "target/weights.bin"
    assert {k: v for k, v in man.device.items() if k != "gated_on"} == mf.this_device()
    assert {"onnx", "onnxruntime", "specrt"} <= set(man.tools)
    assert [g["kernels"] for g in man.device["gated_on"]] == [kernel_fingerprint()]     # its identity gate's kernels
    q = t.source["quantization"]
    assert q["method"] == "static Q/DQ" and q["symmetric"] and q["rules"]["passed"]
    assert q["calibration"]["prompts"] == 3 and q["calibration"]["max_abs_input"]
    assert t.source["engines"] == str(tiny_self_engines.resolve())
    assert t.source["manifest_sha256"] == mf.sha256_file(tiny_self_engines / mf.FILENAME)
    assert t.parity["fp32_export"] == src.target.parity
    idn = t.parity["identity"]
    # the decode graph runs the verify graph's kernels (qdq_engine.decode_graph): bit for bit
    assert idn["rows"] > 0 and idn["argmax_flips"] == 0 and idn["bitwise_equal"] and "bit for bit" in idn["guarantee"]
    assert "one-token interface" in q["decode_graph"]
    assert 0 < t.parity["agreement_with_fp32"]["top1_agreement"] <= 1
    # the tokenizer and the draft: the source's, byte for byte, under the same hashes
    assert man.tokenizer == src.tokenizer
    assert (shared / "tokenizer.json").read_bytes() == (tiny_self_engines / "tokenizer.json").read_bytes()
    d = man.draft
    assert d.shares_cache_with == "target" and d.graphs == src.draft.graphs and d.weights == src.draft.weights
    assert d.parity["agreement_with_target"]["positions"] > 0
    assert d.parity["agreement_with_fp32_target"] == src.draft.parity["agreement_with_target"]
    assert man.build["command"] == "specrt qdq" and man.build["timing"]["graphs"]


def test_the_draft_and_tokenizer_are_copies_so_onnx_still_reads_the_sources_graphs(shared, tiny_self_engines):
    """onnx refuses external data from a file with several hard links ("hardlink attack"):
    a linked draft would break onnx.load of the source folder's own graphs."""
    import onnx
    src = mf.load(tiny_self_engines)
    for root in (tiny_self_engines, shared):
        assert (root / src.draft.weights["file"]).stat().st_nlink == 1
        assert (root / "tokenizer.json").stat().st_nlink == 1
        onnx.load(str(root / src.draft.graphs["decode"].file))     # external data loads


def test_the_decode_graph_is_the_verify_graph_behind_a_one_token_interface(shared):
    """On SmolLM2-135M a Q/DQ graph exported for T=1 picks another token than the verify rows
    at 10 of 192 positions; the verify graph's own kernels agree bit for bit."""
    import onnx
    man = mf.load(shared)
    dec, ver = (onnx.load(str(shared / man.target.graphs[g].file), load_external_data=False)
                for g in ("decode", "verify"))
    names = {n.name for n in dec.graph.node}
    assert {n.name for n in ver.graph.node} <= names and "one_token.pad" in names
    ids = next(i for i in dec.graph.input if i.name == "input_ids")
    assert [d.dim_value for d in ids.type.tensor_type.shape.dim] == [1, 1]
    pad = next(i for i in dec.graph.initializer if i.name == "one_token.pad_ids")
    assert list(pad.dims) == [1, man.shapes.k]                      # k padding rows: T = k + 1


def test_a_damaged_file_is_a_graph_file_error(shared, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(shared, copy)               # the fixture is module-scoped: damage a copy
    w = copy / "target" / "weights.bin"
    data = bytearray(w.read_bytes())
    data[len(data) // 2] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(GraphFileError, match="sha256"):
        mf.check_files(mf.load(copy), copy, hashes=True)
    with pytest.raises(GraphFileError, match="weights.bin"):
        SpeculativeGenerator(copy)
    (copy / "tokenizer.json").unlink()
    with pytest.raises(GraphFileError, match="tokenizer.json"):
        mf.check_files(mf.load(copy), copy)


def test_rerunning_replaces_the_folder_and_a_failure_keeps_the_previous_one(own, tiny_engines, tmp_path,
                                                                           monkeypatch):
    out = tmp_path / "q"
    shutil.copytree(own, out)
    before = mf.load(out).build["seconds"]
    (out / "manifest.json").write_text((out / "manifest.json").read_text().replace(
        f'"seconds": {before}', '"seconds": -1.0'))
    qdq_engine.make_qdq(tiny_engines, out, TINY, progress=lambda s: None)
    man = mf.load(out)
    assert man.build["seconds"] >= 0 and man.build["config"]["prompts"] == 1
    mf.check_files(man, out, hashes=True)
    flips = {"rows": 8, "argmax_flips": 2, "bitwise_equal_rows": 0, "bitwise_equal": False,
             "max_abs_logit_delta": 1.5}
    monkeypatch.setattr(identity, "decode_verify_agreement", lambda *a, **k: dict(flips))
    with pytest.raises(ParityError, match="2 of 8 positions.*--keep-float"):
        qdq_engine.make_qdq(tiny_engines, out, TINY, progress=lambda s: None)
    assert mf.load(out).build["seconds"] == man.build["seconds"]      # the previous folder, untouched
    mf.check_files(mf.load(out), out, hashes=True)
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_a_folder_that_is_not_a_specrt_folder_or_the_source_is_refused(tiny_engines, tmp_path):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep me")
    with pytest.raises(BuildOutputError, match="not a specrt engine folder"):
        qdq_engine.make_qdq(tiny_engines, user, TINY, progress=lambda s: None)
    assert (user / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(BuildOutputError, match="existing file"):
        qdq_engine.make_qdq(tiny_engines, tmp_path / "file", TINY, progress=lambda s: None)
    with pytest.raises(BuildOutputError, match="source"):
        qdq_engine.make_qdq(tiny_engines, tiny_engines, TINY, progress=lambda s: None)
    with pytest.raises(BuildOutputError, match="source"):
        qdq_engine.make_qdq(tiny_engines, tiny_engines / "qdq", TINY, progress=lambda s: None)
    assert not (tiny_engines / "qdq").exists()


def test_only_an_fp32_source_with_intact_files_is_taken(shared, tmp_path):
    with pytest.raises(ConfigError, match="int8-qdq.*fp32"):
        qdq_engine.make_qdq(shared, tmp_path / "again", TINY, progress=lambda s: None)
    copy = tmp_path / "src"
    shutil.copytree(shared, copy)
    raw = json.loads((copy / mf.FILENAME).read_text())
    raw["models"]["target"]["precision"] = "fp32"
    (copy / mf.FILENAME).write_text(json.dumps(raw))
    (copy / "tokenizer.json").write_text("{}")
    with pytest.raises(GraphFileError, match="tokenizer.json"):
        qdq_engine.make_qdq(copy, tmp_path / "out", TINY, progress=lambda s: None)
    assert not (tmp_path / "out").exists()


def test_a_draft_reading_a_cache_of_another_shape_is_refused(tiny_self_engines, tmp_path):
    man = mf.load(tiny_self_engines)
    target = {"dims": {**man.target.dims, "kv_heads": man.target.dims["kv_heads"] + 1}, "kv": man.target.kv}
    with pytest.raises(ConfigError, match="kv_heads"):
        qdq_engine.copy_draft(man, tiny_self_engines, tmp_path, target, [[1, 2, 3]])
    target = {"dims": man.target.dims, "kv": {**man.target.kv, "dtype": "float16"}}
    with pytest.raises(ConfigError, match="dtype"):
        qdq_engine.copy_draft(man, tiny_self_engines, tmp_path, target, [[1, 2, 3]])


def test_specrt_qdq_runs_without_importing_torch_or_transformers(tiny_self_engines, tmp_path):
    """`specrt qdq` works on ONNX folders only: the whole command, through the CLI, in a fresh
    process, never loads torch (nor transformers, which would load it)."""
    out = tmp_path / "qdq"
    code = textwrap.dedent(f"""
        import sys
        from specrt.cli import main
        rc = main(["qdq", {str(tiny_self_engines)!r}, "--out", {str(out)!r}, "--prompts", "1",
                   "--eval-prompts", "1", "--decode-steps", "2", "--quiet"])
        print("rc", rc, sorted(m for m in sys.modules if m.split('.')[0] in ("torch", "transformers")))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "rc 0 []", r.stdout[-2000:]
    assert mf.load(out).target.precision == "int8-qdq"
