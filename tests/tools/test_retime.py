"""`specrt retime FOLDER`: the step costs that choose speculation, and the kernel table, are
measured again on this machine and written into the manifest; nothing else in the folder changes, a damaged or GPU
folder is refused, and the answers stay the same (the costs choose rounds, never tokens)."""
from __future__ import annotations

import hashlib
import json

import pytest

from specrt import manifest as mf
from specrt.cli import main
from specrt.errors import ConfigError, ManifestError
from specrt.runtime.generator import SpeculativeGenerator
from specrt.tools.retime import retime
from tests.bad_input_helpers import copy_engines, edit_manifest

SENTINEL = 12345.0      # no step of a tiny model takes 12 s: a value retime must replace


def _files(folder):
    return {p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "manifest.json"}


def _poison(raw):
    sp = raw["build"]["speculation"]
    sp["costs_ms"] = {k: SENTINEL for k in ("target_decode", "target_verify", "draft_decode")}
    for rows in sp["batch_costs_ms"]["target"].values():
        for n in rows:
            rows[n] = SENTINEL
    for n in sp["batch_costs_ms"]["draft"]:
        sp["batch_costs_ms"]["draft"][n] = SENTINEL


def test_retime_measures_every_cost_again_and_changes_nothing_else(tiny_batch_rows_draft_engines, tmp_path, capsys):
    eng = copy_engines(tiny_batch_rows_draft_engines, tmp_path)
    edit_manifest(eng, _poison)
    before_files, before = _files(eng), mf.load(eng)
    want = SpeculativeGenerator(eng).generate("a b a b a b", max_new_tokens=12)

    assert main(["retime", str(eng)]) == 0
    assert "written to" in capsys.readouterr().out
    man = mf.load(eng)
    sp = man.build["speculation"]
    costs = [sp["costs_ms"][k] for k in ("target_decode", "target_verify", "draft_decode")]
    batch = [v for rows in sp["batch_costs_ms"]["target"].values() for v in rows.values()] + \
        [*sp["batch_costs_ms"]["draft"].values()]
    assert all(0 < c < SENTINEL for c in costs + batch)
    assert set(sp["batch_costs_ms"]["target"]) == set(before.build["speculation"]["batch_costs_ms"]["target"])
    assert sp["acceptance"] == before.build["speculation"]["acceptance"]
    assert sp["chosen"]["method"] in ("speculative", "plain") and sp["predicted"]
    assert sp["retimed"]["previous"]["costs_ms"]["target_decode"] == SENTINEL
    assert sp["retimed"]["previous"]["measured_by"] == "specrt build"
    # only the manifest changed, and only its costs
    assert _files(eng) == before_files
    assert {k: v for k, v in man.build.items() if k not in ("speculation", "kernels")} == \
        {k: v for k, v in before.build.items() if k not in ("speculation", "kernels")}
    # the kernel table measured again too, over the same shapes
    assert man.build["kernels"]["measured_by"] == sp["retimed"]["by"]
    assert [r["use"] for r in man.build["kernels"]["shapes"]] == [r["use"] for r in before.build["kernels"]["shapes"]]
    assert man.models == before.models and man.shapes == before.shapes
    assert SpeculativeGenerator(eng).generate("a b a b a b", max_new_tokens=12).tokens == want.tokens
    from specrt.tools.describe import describe
    assert "timed      by specrt" in describe(man)

    retime(eng, out=lambda line: None)         # again: the previous costs are the first retime's
    assert mf.load(eng).build["speculation"]["retimed"]["previous"]["measured_by"].endswith("retime")


def test_a_damaged_folder_is_refused_and_its_manifest_kept(tiny_batch_rows_draft_engines, tmp_path):
    eng = copy_engines(tiny_batch_rows_draft_engines, tmp_path)
    weights = eng / "target" / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    raw = (eng / "manifest.json").read_text()
    with pytest.raises(ManifestError, match="sha256|hash"):
        retime(eng, out=lambda line: None)
    assert (eng / "manifest.json").read_text() == raw


def test_a_gpu_folder_is_refused_naming_where_its_costs_come_from(tiny_batch_rows_draft_engines, tmp_path):
    eng = copy_engines(tiny_batch_rows_draft_engines, tmp_path)
    edit_manifest(eng, lambda raw: raw["device"].update(kind="cuda"))
    raw = (eng / "manifest.json").read_text()
    with pytest.raises(ConfigError, match="GPU"):
        retime(eng, out=lambda line: None)
    assert json.loads((eng / "manifest.json").read_text()) == json.loads(raw)


def test_retime_gives_a_folder_built_before_the_chunk_check_its_record(tiny_batch_rows_engines, tmp_path, capsys):
    """A folder built before builder/gates/chunks.py existed has no chunk_invariance, so a request
    alone prefills in the folder's chunks; retime measures it where the folder serves. So with
    prompts of several requests in one call (prompt_rows)."""
    from specrt.runtime.backends.batch_calls import lone_prefill_tokens, prompt_rows
    eng = copy_engines(tiny_batch_rows_engines, tmp_path)
    built = mf.load(eng).batch.parity

    def drop(raw):
        del raw["models"]["batch"]["parity"]["chunk_invariance"]
        del raw["models"]["batch"]["parity"]["prompt_rows"]

    edit_manifest(eng, drop)
    man = mf.load(eng)
    assert lone_prefill_tokens(man.batch, man.shapes) == man.shapes.prefill_chunk and prompt_rows(man.batch) == 1
    before_files = _files(eng)
    assert main(["retime", str(eng)]) == 0
    said = capsys.readouterr().out
    assert "models.batch.parity.chunk_invariance" in said and "models.batch.parity.prompt_rows" in said
    man = mf.load(eng)
    for gate in ("chunk_invariance", "prompt_rows"):
        assert man.batch.parity[gate] == built[gate]              # the build's verdict, measured again
    assert lone_prefill_tokens(man.batch, man.shapes) == 4 * man.shapes.prefill_chunk
    assert prompt_rows(man.batch) > 1
    assert _files(eng) == before_files

