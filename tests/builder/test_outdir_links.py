"""Symbolic links a user left inside an `--out` folder are the user's (issue 26, item 11): a
build writes plain files only, so any link is foreign. Without --force the build is refused
and names it; with --force the folder is replaced and the links go with it, but what they
point to (a folder and a file outside --out) is never deleted, emptied or written through.

The links sit in a previous specrt build's folder, where a user's files would otherwise be
recognised: one beside the artifacts, and one that replaced an artifact under its own name."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from bad_input_helpers import copy_engines, expect

from specrt import manifest as mf
from specrt.builder import outdir
from specrt.errors import BuildOutputError


def _build(out: Path, target: Path, *, force: bool) -> Path:
    from specrt.builder.config import BuildConfig
    from specrt.builder.pipeline import build
    return build(BuildConfig(target=str(target), out=str(out), draft="none", max_context=96, prefill_chunk=16,
                             k=3, measure_costs=False, ngram_tokens=512), progress=False, force=force)


def _digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` (links followed nowhere) -> sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def _artifacts(out: Path) -> list[str]:
    return sorted(rel for rel, _ in mf.artifact_files(mf.load(out)))


@pytest.fixture
def linked(tiny_engines, tmp_path):
    """(out, outside, links): an engine folder holding the user's links to things outside it.

    outside/data/       a folder with files (nested too), linked as out/mydata
    outside/notes.txt   a file, linked as out/notes.txt
    out/gone            a dangling link"""
    out = copy_engines(tiny_engines, tmp_path)
    outside = tmp_path / "outside"
    (outside / "data" / "deep").mkdir(parents=True)
    (outside / "data" / "a.csv").write_text("1,2,3")
    (outside / "data" / "deep" / "b.bin").write_bytes(bytes(range(256)))
    (outside / "notes.txt").write_text("precious")
    links = {"mydata": outside / "data", "notes.txt": outside / "notes.txt", "gone": tmp_path / "nowhere"}
    for name, to in links.items():
        (out / name).symlink_to(to)
    return out, outside, links


def _never_load(monkeypatch):
    from specrt.export import sources

    def boom(*a, **k):
        raise AssertionError("the build started loading the model before checking --out")
    monkeypatch.setattr(sources, "load_source", boom)


def test_links_in_an_engine_folder_are_foreign_and_the_build_is_refused_leaving_them(linked, tiny_pair,
                                                                                    monkeypatch):
    out, outside, links = linked
    before = _digest(outside)
    assert sorted(outdir.foreign_entries(out)) == sorted(links)
    _never_load(monkeypatch)
    msg = expect(BuildOutputError, _build, out, tiny_pair[0], force=False)
    assert "--force" in msg and all(name in msg for name in links)
    for name, to in links.items():
        assert (out / name).is_symlink() and (out / name).readlink() == to
    assert _digest(outside) == before


def test_a_link_under_an_artifacts_own_name_is_foreign_too(tiny_engines, tiny_pair, tmp_path, monkeypatch):
    """The user replaced one artifact with a link to another (inside the folder, so the
    manifest still loads): the folder is no longer all specrt's, and the link is kept."""
    out = copy_engines(tiny_engines, tmp_path)
    onnx = [rel for rel in _artifacts(out) if rel.endswith(".onnx")]
    linked_as, to = onnx[0], out / onnx[1]
    (out / linked_as).unlink()
    (out / linked_as).symlink_to(to)
    before = to.read_bytes()
    assert outdir.foreign_entries(out) == [linked_as]
    _never_load(monkeypatch)
    assert linked_as in expect(BuildOutputError, _build, out, tiny_pair[0], force=False)
    assert (out / linked_as).is_symlink() and (out / linked_as).readlink() == to and to.read_bytes() == before


def test_force_replaces_the_links_but_never_what_they_point_to(linked, tiny_pair):
    out, outside, links = linked
    weights = next(rel for rel in _artifacts(out) if rel.endswith("weights.bin"))   # an artifact, by its name:
    (outside / "weights.bin").write_bytes((out / weights).read_bytes())             # a copy kept outside
    (out / weights).unlink()
    (out / weights).symlink_to(outside / "weights.bin")
    before = _digest(outside)
    _build(out, tiny_pair[0], force=True)
    assert _digest(outside) == before                  # not deleted, not emptied, not written through
    assert sorted(p.name for p in outside.iterdir()) == ["data", "notes.txt", "weights.bin"]
    mf.check_files(mf.load(out), out, hashes=True)     # a fresh build, of plain files only
    assert not [p for p in out.rglob("*") if p.is_symlink()]
    assert not any((out / name).exists() for name in links)
    assert sorted(p.name for p in out.parent.iterdir()) == ["eng", "outside"]   # no .eng.old-*, no partial
