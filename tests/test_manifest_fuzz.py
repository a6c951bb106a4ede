"""Seeded samples of scripts/fuzz_manifest.py's mutants on a tiny build of every engine kind
`make engines*` builds: no mutant ends in an untyped exception or runs silently with other
output, on the one-request path (in each memory mode the engines accept) and through
open_batch where the folder has a batched model (the full run over every field is the
script's; its output is in the issue's closing note)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from conftest import _once, build_tiny

spec = importlib.util.spec_from_file_location("fuzz_manifest", Path(__file__).parents[1] / "scripts" / "fuzz_manifest.py")
fuzz = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fuzz)

# the kinds `make engines*` builds -> (tiny fixture, its ways, the fields sampled: batched folders
# sample models.batch, the fields only the batched path reads). int4-b128 differs from b64 only by
# the block size (the tiny hidden size is 64); engines-int4 (rows attention) is stood in for by
# tiny_batch_rows_engines' fp32 target. A batched folder runs its batched model for every request
# (runtime/one.py): "shared" is refused there.
KINDS = {
    "engines (fp32, --batch: rows attention, the int8 self-draft in the batch)":
        ("tiny_batch_rows_draft_engines", ["fast", "batch"], ("models.batch",)),
    "engines without --batch (fp32 + int8 self-draft)": ("tiny_self_engines", ["fast", "shared"], ()),
    "engines-int8": ("tiny_int8_engines", ["fast"], ()),
    "engines-int4 without --batch": ("tiny_int4_engines", ["fast"], ()),
    "engines-int4-gqa (rowwise prefill)": ("tiny_batch_engines", ["fast", "batch"], ("models.batch",)),
    "engines-int4-same": ("tiny_batch_same_engines", ["fast", "batch"], ("models.batch",)),
    "engines-int4 (--batch, rows attention)": ("tiny_batch_rows_engines", ["fast", "batch"], ("models.batch",)),
    "engines-int4-b64": ("tiny_batch_b64_engines", ["fast", "batch"], ("models.batch",)),
}
SAMPLE = 10


@pytest.fixture(scope="session")
def tiny_int8_engines(tmp_path_factory, tiny_pair) -> Path:
    """`make engines-int8`: the tiny target quantized to int8, with its int8 draft."""
    return _once(tmp_path_factory, "eng-int8", lambda d: build_tiny(d / "int8", tiny_pair[0], "int8", precision="int8"))


def test_a_sample_of_manifest_mutants_is_refused_or_harmless(tiny_self_engines):
    report = fuzz.fuzz(tiny_self_engines, limit=60, seed=3, out=print)
    assert report["findings"] == [], report["findings"]
    assert report["mutants"] == 60 and report["outcomes"].get("refused", 0) >= 20


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_engine_kind_refuses_or_ignores_its_mutants(kind, request):
    fixture, ways, fields = KINDS[kind]
    engines = request.getfixturevalue(fixture)
    report = fuzz.fuzz(engines, limit=SAMPLE, seed=5, fields=fields, out=print)
    assert report["ways"] == ways, report["left_out"]     # int4/int8 targets refuse "shared": left out, not a crash
    assert report["findings"] == [], report["findings"]
    assert report["mutants"] == SAMPLE and report["outcomes"].get("refused", 0) >= 1, report["outcomes"]


def test_the_mutants_cover_every_field_by_type_and_value(tiny_self_engines, tiny_batch_engines):
    raw = json.loads((tiny_self_engines / "manifest.json").read_text())
    names = [what for what, _ in fuzz.mutants(raw)]
    for must in ('tokenizer.file = "../tokenizer.json"', "tokenizer.eos_token_ids = []", "del shapes.k",
                 "shapes.max_context = -1", "models.target.weights.file = null"):
        assert must in names, must
    batched = [what for what, _ in fuzz.mutants(json.loads((tiny_batch_engines / "manifest.json").read_text()),
                                                ("models.batch",))]
    for must in ('models.batch.io.past_key = "../past_k_%d"', "del models.batch.graphs.prefill",
                 "models.batch.parity.batch_invariance.equal = false", "models.batch.dims.vocab = 129"):
        assert must in batched, must
    assert all(w.removeprefix("del ").split(" = ")[0].split(".")[:2] == ["models", "batch"] for w in batched)


def test_the_classifier_calls_an_untyped_exception_and_changed_tokens_findings(tiny_self_engines, monkeypatch):
    from specrt.errors import ConfigError, SpecrtError

    def way_fails(bad: str, error: Exception):
        def run_way(way, engines, method):
            if way == bad:
                raise error
            return [1]
        return run_way

    both = {"fast": [1], "batch": [1]}
    monkeypatch.setattr(fuzz, "run_way", way_fails("batch", KeyError("x")))
    assert fuzz.classify(tiny_self_engines, both)[0] == "UNTYPED"
    # the batched engine's thread passes an untyped exception on as a plain "internal error"
    monkeypatch.setattr(fuzz, "run_way", way_fails("batch", SpecrtError("internal error in the batched engine (x)")))
    assert fuzz.classify(tiny_self_engines, both)[0] == "UNTYPED"
    monkeypatch.setattr(fuzz, "run_way", way_fails("fast", ConfigError("no")))
    assert fuzz.classify(tiny_self_engines, both) == ("refused", "[fast] refused ConfigError: no")
    monkeypatch.setattr(fuzz, "run_way", lambda way, engines, method: [2] if way == "batch" else [1])
    assert fuzz.classify(tiny_self_engines, both)[0] == "CHANGED"
    assert fuzz.classify(tiny_self_engines, both, setting=True)[0] == "steered"
    monkeypatch.setattr(fuzz, "run_way", lambda way, engines, method: [1])
    assert fuzz.classify(tiny_self_engines, both) == ("same", "")


def test_the_weights_fields_run_in_every_memory_mode_and_the_rest_in_the_first():
    baseline = {"fast": [1], "shared": [1], "batch": [2]}
    assert list(fuzz.ways_for("models.target.weights.file = null", baseline)) == ["fast", "shared", "batch"]
    assert list(fuzz.ways_for("shapes.k = 0", baseline)) == ["fast", "batch"]
