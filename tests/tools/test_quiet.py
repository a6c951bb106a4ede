"""Whether the machine was free while a build or `specrt retime` timed the folder's steps
(builder/gates/quiet.py): the share of its threads' time the process got is recorded with the
costs, and a busy timing is a warning naming `specrt retime` in the build's output, retime's
and `specrt inspect`. The share itself depends on the machine's load, so these tests give the
timing a CPU clock of their own (a busy one: half the time; a quiet one) and check what is
recorded and said; the record of a real build is checked for consistency only."""
from __future__ import annotations

import pytest
from bad_input_helpers import copy_engines, edit_manifest

from specrt import manifest as mf
from specrt.builder.gates import quiet
from specrt.tools.describe import describe
from specrt.tools.retime import retime


def _clock(monkeypatch, share: float, threads: int = 2):
    """A CPU clock that runs at `share` of `threads` wall clocks."""
    now = iter(range(10 ** 6))
    walls = []

    def wall():
        walls.append(next(now) * 1.0)
        return walls[-1]

    monkeypatch.setattr(quiet, "_wall", wall)
    monkeypatch.setattr(quiet, "_cpu_seconds", lambda: (walls[-1] if walls else 0.0) * share * threads)


@pytest.mark.parametrize("share, busy", [(0.5, True), (0.79, True), (0.95, False), (1.0, False)])
def test_the_share_of_its_threads_time_says_whether_the_machine_was_busy(monkeypatch, share, busy):
    _clock(monkeypatch, share)
    with quiet.cpu_share(2, "test") as rec:
        pass
    assert rec["cpu_share"] == pytest.approx(share, abs=1e-3) and rec["busy"] is busy and rec["threads"] == 2
    assert (quiet.warning(rec) is not None) is busy
    if busy:
        assert "specrt retime" in quiet.warning(rec) and f"x{share:.2f}" in quiet.warning(rec)


def test_a_build_records_the_share_beside_its_costs(tiny_batch_rows_engines):
    rec = mf.load(tiny_batch_rows_engines).build["speculation"]["conditions"]
    assert rec["by"] == "specrt build" and rec["threads"] == 2 and rec["seconds"] > 0
    assert rec["cpu_share"] > 0 and rec["busy"] == (rec["cpu_share"] < quiet.BUSY)


@pytest.mark.parametrize("share", [0.45, 0.97])
def test_inspect_says_when_the_costs_were_timed_on_a_busy_machine(tiny_batch_rows_engines, tmp_path, share):
    eng = copy_engines(tiny_batch_rows_engines, tmp_path)
    edit_manifest(eng, lambda raw: raw["build"]["speculation"]["conditions"].update(
        cpu_share=share, busy=share < quiet.BUSY, threads=2, load_1min=3.1))
    text = describe(mf.load(eng))
    assert f"x{share:.2f} of its 2 threads' time while timing" in text
    assert ("timed on a busy machine" in text) is (share < quiet.BUSY)


def test_retime_on_a_busy_machine_records_it_and_says_so(tiny_batch_rows_engines, tmp_path, monkeypatch):
    eng = copy_engines(tiny_batch_rows_engines, tmp_path)
    _clock(monkeypatch, 0.5)
    lines = []
    retime(eng, out=lines.append)
    rec = mf.load(eng).build["speculation"]["conditions"]
    assert rec["busy"] is True and rec["by"].endswith("retime") and rec["cpu_share"] == pytest.approx(0.5, abs=1e-3)
    assert any("timed on a busy machine" in line and "specrt retime" in line for line in lines)
    _clock(monkeypatch, 0.96)
    lines.clear()
    retime(eng, out=lines.append)
    assert mf.load(eng).build["speculation"]["conditions"]["busy"] is False
    assert not any("timed on a busy machine" in line for line in lines), lines
