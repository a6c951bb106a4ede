"""A short, seeded sample of scripts/fuzz_manifest.py's mutants on the tiny engines: no
mutant ends in an untyped exception or runs silently with other output (the full run
over every field is the script's; its output is in the issue's closing note)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location("fuzz_manifest", Path(__file__).parents[1] / "scripts" / "fuzz_manifest.py")
fuzz = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fuzz)


def test_a_sample_of_manifest_mutants_is_refused_or_harmless(tiny_self_engines):
    report = fuzz.fuzz(tiny_self_engines, limit=60, seed=3, out=print)
    assert report["findings"] == [], report["findings"]
    assert report["mutants"] == 60 and report["outcomes"].get("refused", 0) >= 20


def test_the_mutants_cover_every_field_by_type_and_value(tiny_self_engines):
    raw = json.loads((tiny_self_engines / "manifest.json").read_text())
    names = [what for what, _ in fuzz.mutants(raw)]
    for must in ('tokenizer.file = "../tokenizer.json"', "tokenizer.eos_token_ids = []", "del shapes.k",
                 "shapes.max_context = -1", "models.target.weights.file = null"):
        assert must in names, must


def test_the_classifier_calls_an_untyped_exception_and_changed_tokens_findings(tiny_self_engines, monkeypatch):
    monkeypatch.setattr(fuzz, "run", lambda engines, **kw: (_ for _ in ()).throw(KeyError("x")))
    assert fuzz.classify(tiny_self_engines, [1])[0] == "UNTYPED"
    monkeypatch.setattr(fuzz, "run", lambda engines, **kw: {"fast": [1], "shared": [2]})
    assert fuzz.classify(tiny_self_engines, [1])[0] == "CHANGED"
    monkeypatch.setattr(fuzz, "run", lambda engines, **kw: {"fast": [1], "shared": [1]})
    assert fuzz.classify(tiny_self_engines, [1])[0] == "same"
