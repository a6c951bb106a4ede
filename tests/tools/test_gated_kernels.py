"""A CPU folder's exactness gates are bound to the kernels they were measured on
(manifest device.gated_on: onnxruntime's version and the CPU's instruction set,
runtime/backends/ort_cpu.py kernel_fingerprint). On other kernels every loader refuses it,
naming `specrt retime`; retime measures the gates there (builder/gates/here.py) and, where they
hold, adds those kernels; where one fails, it says which and writes nothing.

"Another machine" is a monkeypatched kernel_fingerprint: the tests say the same on any CPU.
A real change of kernels (another instruction set) cannot be made on one machine; what these
tests show is the bookkeeping and that retime runs the real gates over the folder's files."""
from __future__ import annotations

import json

import pytest
from bad_input_helpers import copy_engines, edit_manifest, expect

from specrt import cpu_features
from specrt import manifest as mf
from specrt.builder.gates import batch
from specrt.errors import GatesNotMeasuredError, ManifestError, ParityError
from specrt.runtime import SpeculativeGenerator
from specrt.runtime.backends import ort_cpu
from specrt.runtime.batch.generator import open_batch
from specrt.tools.describe import describe
from specrt.tools.retime import retime

OTHER = "onnxruntime 1.32.0, x86_64: avx avx2 fma f16c avx512f avx512bw avx512dq avx512vl avx512_vnni"


def _speculative(d):
    SpeculativeGenerator(d)


def _batch(d):
    open_batch(d, max_num_seqs=1).close()


LOADERS = {"SpeculativeGenerator": _speculative, "open_batch": _batch}


def _quiet(line):
    pass


def _move(monkeypatch):
    """This process runs on other kernels than the build's (after the folders are built: a build
    records the kernels it runs on)."""
    monkeypatch.setattr(ort_cpu, "kernel_fingerprint", lambda: OTHER)


@pytest.fixture
def elsewhere(monkeypatch):
    """_move, for tests whose folders are session fixtures (built before a function's fixtures)."""
    _move(monkeypatch)


@pytest.mark.parametrize("line, machine, want", [
    ("flags\t\t: fpu sse2 avx2 fma f16c avx bmi2", "x86_64", "x86_64: avx avx2 fma f16c"),    # Zen 2: ISA order
    ("flags\t\t: avx avx2 fma avx512f avx512bw avx512_vnni amx_tile amx_int8", "x86_64",
     "x86_64: avx avx2 fma avx512f avx512bw avx512_vnni amx_tile amx_int8"),
    ("Features\t: fp asimd asimddp i8mm sve", "aarch64", "aarch64: asimd asimddp i8mm sve"),
    (None, "x86_64", None),                                    # no /proc/cpuinfo: nothing to compare
])
def test_kernel_isa_lists_the_flags_the_kernels_are_chosen_by(monkeypatch, line, machine, want):
    text = None if line is None else f"processor\t: 0\n{line}\nbogomips\t: 1\n"
    monkeypatch.setattr(cpu_features, "_read_cpuinfo", lambda: text)
    monkeypatch.setattr(cpu_features, "_machine", lambda: machine)
    assert cpu_features.kernel_isa() == want


def test_a_build_records_the_kernels_its_gates_held_on_and_serves_here(tiny_batch_rows_engines, tiny_engines):
    for eng in (tiny_batch_rows_engines, tiny_engines):
        gated = mf.load(eng).device["gated_on"]
        assert [g["kernels"] for g in gated] == [ort_cpu.kernel_fingerprint()] and gated[0]["by"] == "specrt build"
        for load in LOADERS.values():
            load(eng)
    assert "this machine's: it serves here" in describe(mf.load(tiny_batch_rows_engines))


@pytest.mark.parametrize("how", LOADERS)
@pytest.mark.parametrize("fixture", ["tiny_batch_rows_engines", "tiny_engines", "tiny_int4_engines"])
def test_a_folder_on_kernels_its_gates_were_not_measured_on_is_refused_naming_retime(request, monkeypatch, how,
                                                                                     fixture):
    eng = request.getfixturevalue(fixture)
    _move(monkeypatch)
    msg = expect(GatesNotMeasuredError, LOADERS[how], eng)
    assert "specrt retime" in msg and OTHER in msg and "avx2 fma f16c]" not in msg.split("this machine runs")[1]


def test_another_onnxruntime_version_is_other_kernels(tiny_batch_rows_engines, monkeypatch):
    here = ort_cpu.kernel_fingerprint()
    monkeypatch.setattr(ort_cpu.ort, "__version__", "9.9.9")
    assert ort_cpu.kernel_fingerprint() != here
    expect(GatesNotMeasuredError, _batch, tiny_batch_rows_engines)


def test_folders_built_before_the_record_load_as_before(tiny_batch_rows_engines, tmp_path, elsewhere):
    eng = copy_engines(tiny_batch_rows_engines, tmp_path)
    edit_manifest(eng, lambda raw: raw["device"].pop("gated_on"))
    for load in LOADERS.values():
        load(eng)


@pytest.mark.parametrize("bad", ["x", [1], [{"kernels": 3}], {"kernels": "y"}])
def test_an_edited_record_is_a_manifest_error_naming_retime(tiny_batch_rows_engines, tmp_path, bad):
    eng = copy_engines(tiny_batch_rows_engines, tmp_path)
    edit_manifest(eng, lambda raw: raw["device"].update(gated_on=bad))
    assert "specrt retime" in expect(ManifestError, _batch, eng)


@pytest.mark.parametrize("fixture", ["tiny_batch_rows_draft_engines", "tiny_batch_int4_engines"])
def test_retime_measures_the_gates_on_these_kernels_and_the_folder_then_serves(request, tmp_path, monkeypatch,
                                                                              fixture):
    """The speculating fp32 rows folder (identity, batch, windows) and the int4 default (its
    GroupQueryAttention prompt graph: prompt invariance too)."""
    eng = copy_engines(request.getfixturevalue(fixture), tmp_path)
    _move(monkeypatch)
    built = mf.load(eng)
    expect(GatesNotMeasuredError, _batch, eng)
    lines = []
    retime(eng, out=lines.append)
    man = mf.load(eng)
    gated = man.device["gated_on"]
    assert [g["kernels"] for g in gated] == [built.device["gated_on"][0]["kernels"], OTHER]
    assert gated[0] == built.device["gated_on"][0]                  # the build's record is kept
    gates = gated[1]["gates"]
    want = {"identity", "batch_invariance", "window_invariance"} | \
        ({"prompt_invariance"} if "prompt_invariance" in built.batch.parity else set())
    assert set(gates) == want and all(g["equal"] for g in gates.values())
    assert gates["batch_invariance"]["rows"] == built.batch.parity["batch_invariance"]["rows"]
    assert any("gate 2" in line for line in lines) and "device.gated_on" in lines[-1]
    _batch(eng)                                                      # serves here now
    assert "it serves here" in describe(man)
    retime(eng, out=_quiet)                                          # again: replaced, not added
    assert [g["kernels"] for g in mf.load(eng).device["gated_on"]] == [gated[0]["kernels"], OTHER]


def test_gates_only_adds_these_kernels_and_keeps_the_costs(tiny_batch_rows_engines, tmp_path, elsewhere, capsys):
    """A folder that serves on a second kind of CPU: the gates measured there, the costs (one
    table, the main machine's) untouched."""
    from specrt.cli import main
    eng = copy_engines(tiny_batch_rows_engines, tmp_path)
    before = mf.load(eng)
    assert main(["retime", str(eng), "--gates-only"]) == 0
    assert "the costs and the kernel table kept" in capsys.readouterr().out
    man = mf.load(eng)
    assert [g["kernels"] for g in man.device["gated_on"]] == [before.device["gated_on"][0]["kernels"], OTHER]
    assert man.build == before.build
    _batch(eng)


def test_a_gate_that_fails_on_these_kernels_stops_retime_and_writes_nothing(tiny_batch_rows_engines, tmp_path,
                                                                           elsewhere, monkeypatch):
    eng = copy_engines(tiny_batch_rows_engines, tmp_path)
    raw = (eng / "manifest.json").read_bytes()
    real = batch.invariance

    def rounds_apart(*a, **kw):       # what another kernel's summation order would give
        return {**real(*a, **kw), "equal": False, "max_abs_logit_delta": 3e-6}

    monkeypatch.setattr(batch, "invariance", rounds_apart)
    with pytest.raises(ParityError, match=r"batched row alone against among others .*rebuild the engines on this "
                                          r"machine.*Nothing was written"):
        retime(eng, out=_quiet)
    assert (eng / "manifest.json").read_bytes() == raw
    expect(GatesNotMeasuredError, _batch, eng)


def test_the_larger_prompt_chunk_only_where_every_gated_machine_gave_the_same_bits(tiny_batch_rows_engines,
                                                                                   tmp_path, elsewhere):
    """The build's machine said the larger chunk rounds apart (edited here, as a machine whose
    kernels do would record it); these kernels give the same bits: the folder, which serves on
    both, keeps the build's chunk, and says so."""
    from specrt.runtime.backends.batch_calls import lone_prefill_tokens, prompt_rows
    eng = copy_engines(tiny_batch_rows_engines, tmp_path)

    def unequal(raw):
        for gate in ("chunk_invariance", "prompt_rows"):        # (prompts of several requests a call: the same rule)
            raw["models"]["batch"]["parity"][gate].update(equal=False)
    edit_manifest(eng, unequal)
    retime(eng, out=_quiet)
    man = mf.load(eng)
    for gate in ("chunk_invariance", "prompt_rows"):
        rec = man.batch.parity[gate]
        assert rec["equal"] is False and rec["equal_here"] is True
    assert lone_prefill_tokens(man.batch, man.shapes) == man.shapes.prefill_chunk and prompt_rows(man.batch) == 1
    # gated on these kernels alone (the build's record dropped): these kernels' verdict
    edit_manifest(eng, lambda raw: raw["device"].update(gated_on=raw["device"]["gated_on"][1:]))
    retime(eng, out=_quiet)
    man = mf.load(eng)
    assert man.batch.parity["chunk_invariance"]["equal"] is True and man.batch.parity["prompt_rows"]["equal"] is True
    assert lone_prefill_tokens(man.batch, man.shapes) == 4 * man.shapes.prefill_chunk and prompt_rows(man.batch) > 1
    assert json.loads((eng / "manifest.json").read_text())["device"]["gated_on"][0]["kernels"] == OTHER
