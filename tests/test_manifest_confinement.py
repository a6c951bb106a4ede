"""Issue 16, the artifacts: an engine folder names only files inside itself, its special
ids are token ids of its vocabulary, and a damaged entry is refused at load, not at the
first step. Every case is the issue's reproducer on a copy of the tiny engines."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from bad_input_helpers import copy_engines, edit_manifest, expect

from specrt import manifest as mf
from specrt.errors import ManifestError, SamplingParamsError
from specrt.runtime import SamplingParams, SpeculativeGenerator


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specrt.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def eng(tiny_self_engines, tmp_path) -> Path:
    return copy_engines(tiny_self_engines, tmp_path / "d")


# --------------------------------------------------------------------------- paths

def _outside_copy(eng: Path, rel: str) -> Path:
    """A byte-identical copy of eng/rel outside the folder (so its sha256 still matches)."""
    dst = eng.parent / ("outside_" + Path(rel).name)
    shutil.copyfile(eng / rel, dst)
    return dst


@pytest.mark.parametrize("field,rel,make", [
    ("tokenizer.file", "../outside_tokenizer.json", "copy"),
    ("tokenizer.file", "ABS", "copy"),
    ("models.target.graphs.prefill.file", "../../../../../../../../{tmp}/outside_prefill.onnx", "copy"),
    ("models.target.weights.file", "target/../../outside_weights.bin", "copy"),
    ("tokenizer.file", "../../../../../../../../etc/passwd", "passwd"),
    ("tokenizer.file", "target/../tokenizer.json", None),
    ("tokenizer.file", "ABS-INSIDE", None),
    ("tokenizer.file", "C:\\Windows\\win.ini", None),
    ("tokenizer.file", "", None),
    ("tokenizer.file", "tok\x00enizer.json", None),
], ids=["dotdot", "absolute", "deep-dotdot", "dotdot-after-a-folder", "etc-passwd", "dotdot-staying-inside",
        "absolute-inside", "windows-drive", "empty", "nul"])
def test_a_manifest_path_that_leaves_the_folder_is_refused_naming_the_field(eng, field, rel, make):
    source = {"tokenizer.file": "tokenizer.json", "models.target.graphs.prefill.file": "target/prefill.onnx",
              "models.target.weights.file": "target/weights.bin"}[field]
    if make == "copy":
        outside = _outside_copy(eng, source)
        rel = str(outside) if rel == "ABS" else rel.replace("{tmp}", str(eng.parent).lstrip("/"))
    if rel == "ABS-INSIDE":        # even a file of the folder is named relatively
        rel = str((eng / source).resolve())
    digest = _sha(Path("/etc/passwd")) if make == "passwd" else None

    def edit(raw):
        node, *path = field.split(".")
        obj = raw[node]
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = rel
        if digest:
            obj["sha256"] = digest
    edit_manifest(eng, edit)
    msg = expect(ManifestError, SpeculativeGenerator, eng)
    assert field in msg and "inside" in msg
    r = cli("generate", eng, "hi", "--max-new-tokens", "2")
    assert r.returncode == 2 and "ManifestError" in r.stderr and field in r.stderr, r.stderr


def test_a_symbolic_link_that_leads_outside_is_refused_and_one_that_stays_inside_is_not(eng):
    inside = eng / "target" / "prefill.onnx"
    outside = _outside_copy(eng, "target/prefill.onnx")
    inside.unlink()
    inside.symlink_to(outside)
    msg = expect(ManifestError, SpeculativeGenerator, eng)
    assert "models.target.graphs.prefill.file" in msg and "symbolic link" in msg
    inside.unlink()
    shutil.move(outside, eng / "prefill-real.onnx")
    inside.symlink_to(Path("..") / "prefill-real.onnx")      # a relative link to a file in the folder
    assert SpeculativeGenerator(eng).generate("hi", max_new_tokens=3).tokens
    linked = eng.parent / "linked"                        # the folder itself reached through a link
    linked.symlink_to(eng)
    assert SpeculativeGenerator(linked).generate("hi", max_new_tokens=3).tokens


def test_the_manifest_file_itself_is_refused_with_give_the_folder(eng):
    msg = expect(ManifestError, mf.load, eng / "manifest.json")
    assert "give the engine folder" in msg and str(eng) in msg
    r = cli("generate", eng / "manifest.json", "hi")
    assert r.returncode == 2 and "give the engine folder" in r.stderr and "missing" not in r.stderr, r.stderr


# --------------------------------------------------------------------------- special ids and entries

@pytest.mark.parametrize("eos,words", [([], "chat template"), ([1000000], "outside the target's vocabulary"),
                                       ([-1], "outside"), ([True], "list of integers"), (5, "list of integers")])
def test_end_of_sequence_ids_outside_the_vocabulary_or_missing_for_a_chat_model_are_refused(eng, eos, words):
    edit_manifest(eng, lambda raw: raw["tokenizer"].update(eos_token_ids=eos))
    assert words in expect(ManifestError, SpeculativeGenerator, eng)


def test_a_model_without_a_chat_template_may_have_no_end_of_sequence_id(eng):
    edit_manifest(eng, lambda raw: raw["tokenizer"].update(eos_token_ids=[], chat_template=None))
    assert SpeculativeGenerator(eng).generate("hi", max_new_tokens=3).tokens


def test_a_shared_weights_entry_of_the_wrong_shape_is_refused_at_load_not_at_the_first_step(eng):
    edit_manifest(eng, lambda raw: raw["models"]["target"]["weights"]["initializers"].update(
        lm_head=[0, 4, "float32", [1]]))
    msg = expect(ManifestError, SpeculativeGenerator, eng, memory="shared")
    assert "lm_head" in msg and "[64, 128]" in msg


# --------------------------------------------------------------------------- sampling inputs

def test_a_temperature_that_underflows_float32_gives_the_greedy_tokens(tiny_self_engines):
    gen = SpeculativeGenerator(tiny_self_engines)
    want = gen.generate("hi", max_new_tokens=8).tokens
    for t in (1e-46, 1e-300, 5e-324):
        assert gen.generate("hi", max_new_tokens=8, sampling=SamplingParams(temperature=t, seed=0)).tokens == want


def test_sampling_may_be_a_mapping_of_its_fields(tiny_self_engines):
    gen = SpeculativeGenerator(tiny_self_engines)
    want = gen.generate("hi", max_new_tokens=8, sampling=SamplingParams(temperature=0.5, seed=3)).tokens
    assert [t for c in gen.stream("hi", max_new_tokens=8, sampling={"temperature": 0.5, "seed": 3})
            for t in c.tokens] == want
    assert "temprature" in expect(SamplingParamsError, gen.generate, "hi", sampling={"temprature": 0.5})
    assert "mapping" in expect(SamplingParamsError, gen.generate, "hi", sampling="hot")
    assert "temperature" in expect(SamplingParamsError, gen.generate, "hi", sampling={"temperature": -1})


# --------------------------------------------------------------------------- other tools

def test_profile_onto_a_file_is_a_typed_error(tiny_self_engines, tmp_path):
    (tmp_path / "afile.txt").write_text("keep")
    for out in (tmp_path / "afile.txt", tmp_path / "afile.txt" / "sub"):
        r = cli("profile", tiny_self_engines, "--out", out, "--max-new-tokens", "2")
        assert r.returncode == 2 and "ConfigError" in r.stderr and "--out" in r.stderr, r.stderr
    assert (tmp_path / "afile.txt").read_text() == "keep"


def test_confinement_needs_no_hash_check_to_refuse(eng):
    """The folder check runs at load, before a file is opened or hashed (verify='none' too)."""
    outside = _outside_copy(eng, "tokenizer.json")
    edit_manifest(eng, lambda raw: raw["tokenizer"].update(file=os.path.relpath(outside, eng)))
    assert "tokenizer.file" in expect(ManifestError, SpeculativeGenerator, eng, verify="none")


def test_a_shared_weights_entry_shifted_within_the_file_is_refused_not_run_on_other_weights(eng):
    def shift(raw):
        entry = raw["models"]["target"]["weights"]["initializers"]["layers.0.qkv"]
        entry[0] += 4      # the same shape and length, 4 bytes further: inside the file, other numbers
    edit_manifest(eng, shift)
    msg = expect(ManifestError, SpeculativeGenerator, eng, memory="shared")
    assert "layers.0.qkv" in msg and "at bytes" in msg


# the manifest fuzz's untyped exceptions (scripts/fuzz_manifest.py), each now a ManifestError at load
FUZZ_FINDINGS = {
    "io-empty": lambda raw: raw["models"]["target"].update(io={}),
    "io-no-logits": lambda raw: raw["models"]["draft"]["io"].pop("logits"),
    "io-template": lambda raw: raw["models"]["target"]["io"].update(present_key=""),
    "io-list": lambda raw: raw["models"]["target"].update(io=[]),
    "tokens-bool": lambda raw: raw["models"]["target"]["graphs"]["decode"].update(tokens=True),
    "shares-cache": lambda raw: raw["models"]["draft"]["kv"].update(shares_cache_with="a\x00b"),
    "device-list": lambda raw: raw["device"].update(kind=[]),
    "build-string": lambda raw: raw.update(build="x"),
    "huge-context": lambda raw: raw["shapes"].update(max_context=2**63),
    "offset-bool": lambda raw: raw["models"]["target"]["weights"]["initializers"]["lm_head"].__setitem__(0, True),
    "object-dtype": lambda raw: raw["models"]["target"]["weights"]["initializers"]["lm_head"].__setitem__(2, "O"),
}


@pytest.mark.parametrize("edit", FUZZ_FINDINGS.values(), ids=FUZZ_FINDINGS.keys())
def test_what_the_manifest_fuzz_found_is_a_typed_error_at_load(eng, edit):
    edit_manifest(eng, edit)
    expect(ManifestError, SpeculativeGenerator, eng)
