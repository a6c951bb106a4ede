"""`specrt build --out` never deletes what it did not create and fails before the long work
(issue 6): foreign folders, user siblings, files, the current folder, mount points,
unwritable places, interrupted builds and their leftovers."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from bad_input_helpers import copy_engines, expect
from conftest import build_tiny as _build_tiny

from specrt.builder import outdir
from specrt.errors import BuildOutputError
from specrt.runtime import SpeculativeGenerator


def build_tiny(out, target, draft, force=False):
    """conftest.build_tiny, with build's force flag."""
    if not force:
        return _build_tiny(out, target, draft)
    from specrt.builder.config import BuildConfig
    from specrt.builder.pipeline import build
    return build(BuildConfig(target=str(target), out=str(out), draft=draft, max_context=96, prefill_chunk=16, k=3),
                 progress=False, force=True)


# --------------------------------------------------------------------------- build --out


def _never_load(monkeypatch):
    """The output checks must run before the (long) model load."""
    from specrt.export import sources

    def boom(*a, **k):
        raise AssertionError("the build started loading the model before checking --out")
    monkeypatch.setattr(sources, "load_source", boom)


def test_build_refuses_an_existing_folder_that_is_not_an_engine_folder_and_keeps_it(tiny_pair, tmp_path,
                                                                                   monkeypatch):
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("precious")
    (out / "sub" / "data.csv").write_text("1,2")
    _never_load(monkeypatch)
    msg = expect(BuildOutputError, build_tiny, out, tiny_pair[0], "none")
    assert "--force" in msg and "notes.txt" in msg
    assert (out / "notes.txt").read_text() == "precious" and (out / "sub" / "data.csv").exists()


def test_build_with_force_replaces_a_foreign_folder(tiny_pair, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("replace me")
    build_tiny(out, tiny_pair[0], "none", force=True)
    assert (out / "manifest.json").is_file() and not (out / "notes.txt").exists()


def test_rebuild_replaces_the_previous_build_and_leaves_user_siblings_alone(tiny_pair, tmp_path):
    out = tmp_path / "eng"
    for name in ("eng.old", "eng.partial"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "keep.txt").write_text(name)
    build_tiny(out, tiny_pair[0], "none")
    build_tiny(out, tiny_pair[0], "none")            # replaces its own previous build
    for name in ("eng.old", "eng.partial"):
        assert (tmp_path / name / "keep.txt").read_text() == name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eng", "eng.old", "eng.partial"]
    SpeculativeGenerator(out)


def test_rebuild_refuses_when_the_user_added_files_to_an_engine_folder(tiny_pair, tiny_engines, tmp_path,
                                                                      monkeypatch):
    out = copy_engines(tiny_engines, tmp_path)
    (out / "my-notes.md").write_text("keep")
    _never_load(monkeypatch)
    msg = expect(BuildOutputError, build_tiny, out, tiny_pair[0], "none")
    assert "my-notes.md" in msg and (out / "my-notes.md").exists()


def test_build_into_an_empty_existing_folder_works(tiny_pair, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    build_tiny(out, tiny_pair[0], "none")
    assert (out / "manifest.json").is_file()


@pytest.mark.parametrize("where, words", [
    ("file", "is an existing file"),
    (".", "current folder"),
    ("..", "current folder"),
    ("/proc", "mount point"),
    ("/sys/specrt-out", "writable"),
])
def test_build_refuses_bad_destinations_before_any_work(tiny_pair, tmp_path, monkeypatch, where, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("not a folder")
    _never_load(monkeypatch)
    assert words in expect(BuildOutputError, build_tiny, Path(where), tiny_pair[0], "none")
    assert (tmp_path / "file").read_text() == "not a folder"


def test_a_failed_build_leaves_no_hidden_partial_folder(tiny_pair, tmp_path, monkeypatch):
    from specrt.export import sources

    def fail(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(sources, "load_source", fail)
    with pytest.raises(KeyboardInterrupt):
        build_tiny(tmp_path / "eng", tiny_pair[0], "none")
    assert list(tmp_path.iterdir()) == []


def test_a_partial_folder_left_by_a_killed_build_is_cleaned_but_foreign_ones_are_not(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = tmp_path / ".eng.partial-abc123"
    stale.mkdir()
    (stale / outdir.MARKER).write_text(dead)
    foreign = tmp_path / ".eng.partial-user"
    foreign.mkdir()
    tmp = outdir.make_partial(tmp_path / "eng")
    assert not stale.exists() and foreign.exists() and tmp.exists()
    outdir.discard(tmp)
    assert not tmp.exists()


# --------------------------------------------------------------------------- issue 16

@pytest.mark.parametrize("nested", ["sub/data.csv", "a/b/c/deep.bin"])
def test_a_folder_whose_only_user_files_are_nested_is_refused_and_kept(tiny_pair, tmp_path, monkeypatch, nested):
    out = tmp_path / "mine"
    (out / nested).parent.mkdir(parents=True)
    (out / nested).write_text("precious")
    _never_load(monkeypatch)
    msg = expect(BuildOutputError, build_tiny, out, tiny_pair[0], "none")
    assert nested in msg and (out / nested).read_text() == "precious"


def test_an_engine_folder_with_a_user_file_in_a_subfolder_is_refused(tiny_pair, tiny_engines, tmp_path,
                                                                     monkeypatch):
    out = copy_engines(tiny_engines, tmp_path)
    (out / "target" / "notes.txt").write_text("keep")
    _never_load(monkeypatch)
    assert "target/notes.txt" in expect(BuildOutputError, build_tiny, out, tiny_pair[0], "none")
    assert (out / "target" / "notes.txt").read_text() == "keep"


def test_an_out_that_is_a_symbolic_link_is_refused_before_any_work_leaving_nothing(tiny_pair, tiny_engines,
                                                                                   tmp_path, monkeypatch):
    real = copy_engines(tiny_engines, tmp_path, "bld")
    link = tmp_path / "bldlink"
    link.symlink_to(real)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    _never_load(monkeypatch)
    for out in (link, dangling):
        msg = expect(BuildOutputError, build_tiny, out, tiny_pair[0], "none")
        assert "symbolic link" in msg and "--out" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bld", "bldlink", "dangling"]
    assert link.is_symlink() and (real / "manifest.json").is_file()


@pytest.mark.parametrize("failing", ["the new build into place", "the previous build aside"])
def test_a_failed_final_move_keeps_the_previous_build_and_the_partial_folder_is_discarded(tmp_path, monkeypatch,
                                                                                          failing):
    out = tmp_path / "eng"
    out.mkdir()
    (out / "manifest.json").write_text("previous")
    tmp = outdir.make_partial(out)
    (tmp / "manifest.json").write_text("new")
    real_replace = outdir.os.replace

    def replace(src, dst):
        if Path(src) == (tmp if failing == "the new build into place" else out):
            raise OSError(21, "Is a directory")
        return real_replace(src, dst)
    monkeypatch.setattr(outdir.os, "replace", replace)
    with pytest.raises(BuildOutputError, match="previous contents are unchanged"):
        outdir.commit(tmp, out)
    outdir.discard(tmp)
    assert (out / "manifest.json").read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eng"]     # no .eng.partial-*, no .eng.old-*


SLOW_BUILD = """
import sys, time
from specrt.builder.config import BuildConfig
from specrt.export import sources
from specrt.builder.pipeline import build

def slow(*a, **k):
    print("building", flush=True)
    time.sleep(120)
sources.load_source = slow
build(BuildConfig(target=sys.argv[1], out=sys.argv[2], draft="none", max_context=96, prefill_chunk=16, k=3),
      progress=False)
"""


def test_sigterm_removes_the_partial_build_like_ctrl_c(tiny_pair, tmp_path):
    import signal
    proc = subprocess.Popen([sys.executable, "-c", SLOW_BUILD, str(tiny_pair[0]), str(tmp_path / "d" / "x")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "building"
        assert [p.name.startswith(".x.partial-") for p in (tmp_path / "d").iterdir()] == [True]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert list((tmp_path / "d").iterdir()) == []


def test_a_full_disk_says_so_with_sizes_and_leaves_nothing(tiny_pair, tmp_path, monkeypatch):
    import errno

    from specrt.export import onnx_export

    def fill(model, shapes, out_dir, **kw):
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "weights.bin").write_bytes(b"\0" * 3_000_000)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(onnx_export, "export_model", fill)
    msg = expect(BuildOutputError, build_tiny, tmp_path / "eng", tiny_pair[0], "none")
    assert "disk is full" in msg and "had written 3 MB" in msg and "MB more were free" in msg
    assert list(tmp_path.iterdir()) == []
