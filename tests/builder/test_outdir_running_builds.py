"""A build never deletes the partial folder of another build that is still running (issue 26,
item 9): only a partial folder whose builder is gone is stale. A second build into the same
--out while the first runs is refused, naming the other build; the first keeps its folder.

"Running" is the builder's process being alive (the pid in the folder's marker). A live
builder here is a child process blocked on its stdin (alive until the test closes it), a dead
one a child that exited and was reaped: no sleeps, no timing."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from bad_input_helpers import expect
from conftest import build_tiny

from specrt.builder import outdir
from specrt.errors import BuildOutputError


@pytest.fixture
def live_pid():
    """The pid of a process that stays alive until the test ends (it waits on its stdin)."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        yield proc.pid
    finally:
        proc.stdin.close()          # EOF: it exits
        proc.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()                     # exited and reaped: its pid names no process now
    return proc.pid


def _partial(parent: Path, name: str, pid: int) -> Path:
    """A partial folder as a build leaves it mid-way: its marker and some written files."""
    p = parent / name
    (p / "target").mkdir(parents=True)
    (p / outdir.MARKER).write_text(str(pid))
    (p / "target" / "model.onnx").write_bytes(b"half-written graph")
    return p


def _partials(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name)


def test_a_running_builds_partial_folder_survives_and_the_second_build_is_refused_naming_it(tmp_path, live_pid):
    running = _partial(tmp_path, ".eng.partial-running", live_pid)
    stale = _partial(tmp_path, ".eng.partial-stale", _dead_pid())
    msg = expect(BuildOutputError, outdir.make_partial, tmp_path / "eng")
    assert str(live_pid) in msg and str(running) in msg and "another specrt build" in msg
    assert (running / "target" / "model.onnx").read_bytes() == b"half-written graph"
    assert (running / outdir.MARKER).read_text() == str(live_pid)
    # the dead builder's folder is cleaned all the same, and the refused build left none of its own
    assert _partials(tmp_path) == [".eng.partial-running"]


def test_once_the_other_build_is_gone_its_folder_is_stale_and_the_next_build_proceeds(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        left = _partial(tmp_path, ".eng.partial-left", proc.pid)
        expect(BuildOutputError, outdir.make_partial, tmp_path / "eng")
        assert left.is_dir()
    finally:
        proc.stdin.close()
        proc.wait()
    tmp = outdir.make_partial(tmp_path / "eng")      # same folder, its builder now dead and reaped
    try:
        assert not left.exists() and _partials(tmp_path) == [tmp.name]
    finally:
        outdir.discard(tmp)
    assert _partials(tmp_path) == []


def test_a_second_build_in_the_same_process_is_refused_while_the_first_is_unfinished(tmp_path):
    first = outdir.make_partial(tmp_path / "eng")    # e.g. a build running in another thread
    try:
        (first / "weights.bin").write_bytes(b"w")
        assert str(first) in expect(BuildOutputError, outdir.make_partial, tmp_path / "eng")
        assert (first / "weights.bin").read_bytes() == b"w" and _partials(tmp_path) == [first.name]
        other = outdir.make_partial(tmp_path / "other")  # another --out in the same folder is not blocked
        outdir.discard(other)
    finally:
        outdir.discard(first)
    assert list(tmp_path.iterdir()) == []


def test_build_is_refused_before_loading_the_model_and_leaves_the_running_build_alone(tiny_pair, tmp_path,
                                                                                      monkeypatch, live_pid):
    from specrt.export import sources

    def boom(*a, **k):
        raise AssertionError("the build started loading the model while another build writes the same --out")
    monkeypatch.setattr(sources, "load_source", boom)
    running = _partial(tmp_path, ".eng.partial-running", live_pid)
    msg = expect(BuildOutputError, build_tiny, tmp_path / "eng", tiny_pair[0], "none")
    assert str(live_pid) in msg and "--out" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == [".eng.partial-running"]   # no `eng`, no second partial
    assert (running / "target" / "model.onnx").read_bytes() == b"half-written graph"
