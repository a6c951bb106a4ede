"""Whether the machine was free while a build or `specrt retime` timed the folder's steps
(builder/gates/quiet.py): the share of the machine's CPU time other processes used meanwhile is
recorded with the costs, and a busy timing is a warning naming `specrt retime` in the build's
output, retime's and `specrt inspect`. The share itself depends on the machine's load, so these
tests give the timing clocks of their own (busy, quiet, unreadable) and check what is recorded
and said; the record of a real build is checked for consistency only."""
from __future__ import annotations

import pytest
from bad_input_helpers import copy_engines, edit_manifest

from specrt import manifest as mf
from specrt.builder.gates import quiet
from specrt.tools.describe import describe
from specrt.tools.retime import retime


def _clock(monkeypatch, others: float | None, share: float = 0.9, threads: int = 2):
    """Clocks for the timing: each read advances the wall by a second; this process uses
    `share` of its threads' time, other processes `others` of the machine's (None: /proc/stat
    cannot be read), on a machine of `threads` cores."""
    now = iter(range(1, 10 ** 6))
    t = [0.0]

    def wall():
        t[0] = float(next(now))
        return t[0]

    monkeypatch.setattr(quiet, "_wall", wall)
    monkeypatch.setattr(quiet, "_cpu_seconds", lambda: t[0] * share * threads)
    monkeypatch.setattr(quiet, "_machine_seconds", lambda: None if others is None else
                        (t[0] * share * threads + t[0] * threads * others, t[0] * threads))


@pytest.mark.parametrize("others, busy", [(0.5, True), (0.11, True), (0.05, False), (0.0, False), (None, None)])
def test_the_share_others_used_says_whether_the_machine_was_busy(monkeypatch, others, busy):
    _clock(monkeypatch, others)
    with quiet.cpu_share(2, "test") as rec:
        pass
    assert rec["busy"] is busy and rec["threads"] == 2 and rec["cpu_share"] == pytest.approx(0.9, abs=1e-3)
    assert rec["others_share"] == (None if others is None else pytest.approx(others, abs=1e-3))
    assert (quiet.warning(rec) is not None) is bool(busy)
    if busy:
        assert "specrt retime" in quiet.warning(rec) and f"x{others:.2f}" in quiet.warning(rec)


def test_a_slow_python_loop_is_not_a_busy_machine(monkeypatch):
    """A small model's timing runs ONNX Runtime a small part of the time (its own share of its
    threads' time is low on a quiet machine too): what says busy is what the others used."""
    _clock(monkeypatch, 0.0, share=0.4)
    with quiet.cpu_share(2, "test") as rec:
        pass
    assert rec["busy"] is False and rec["cpu_share"] == pytest.approx(0.4, abs=1e-3)


def test_a_build_records_the_share_beside_its_costs(tiny_batch_rows_engines):
    rec = mf.load(tiny_batch_rows_engines).build["speculation"]["conditions"]
    assert rec["by"] == "specrt build" and rec["threads"] == 2 and rec["seconds"] > 0
    assert rec["cpu_share"] > 0 and 0 <= rec["others_share"] <= 1 and rec["busy"] == (rec["others_share"] > quiet.BUSY)


@pytest.mark.parametrize("others", [0.45, 0.01])
def test_inspect_says_when_the_costs_were_timed_on_a_busy_machine(tiny_batch_rows_engines, tmp_path, others):
    eng = copy_engines(tiny_batch_rows_engines, tmp_path)
    edit_manifest(eng, lambda raw: raw["build"]["speculation"]["conditions"].update(
        others_share=others, busy=others > quiet.BUSY, threads=2, load_1min=3.1))
    text = describe(mf.load(eng))
    assert f"other processes used x{others:.2f} of the machine's CPU time while timing" in text
    assert ("timed on a busy machine" in text) is (others > quiet.BUSY)


def test_retime_on_a_busy_machine_records_it_and_says_so(tiny_batch_rows_engines, tmp_path, monkeypatch):
    eng = copy_engines(tiny_batch_rows_engines, tmp_path)
    _clock(monkeypatch, 0.5)
    lines: list[str] = []
    retime(eng, out=lines.append)
    rec = mf.load(eng).build["speculation"]["conditions"]
    assert rec["busy"] is True and rec["by"].endswith("retime") and rec["others_share"] == pytest.approx(0.5, abs=1e-3)
    assert any("timed on a busy machine" in line and "specrt retime" in line for line in lines)
    _clock(monkeypatch, 0.02)
    lines.clear()
    retime(eng, out=lines.append)
    assert mf.load(eng).build["speculation"]["conditions"]["busy"] is False
    assert not any("timed on a busy machine" in line for line in lines), lines
