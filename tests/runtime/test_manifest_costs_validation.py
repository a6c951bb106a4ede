"""The build's measured step costs (manifest build.speculation) and the batched graphs' static T
are checked when the engines are opened: a damaged value is a ManifestError that names the
field and says to rebuild, never an AttributeError, IndexError or ZeroDivisionError at a
request's first step (what scripts/fuzz_manifest.py found on a `--batch-attention rows` build)."""
from __future__ import annotations

import json
import math
import shutil

import pytest

from specrt import manifest as mf
from specrt.errors import ManifestError
from specrt.runtime.costs import StepCosts
from specrt.runtime.backends.ort_batch import check_static_tokens
from specrt.runtime.batch.policy import BatchCosts

# bad step costs: zero, negative, not a number, a bool, not finite, missing
BAD_COSTS = (0, 0.0, -1.0, "1.5", True, None, float("nan"), float("inf"), [], {})
NOT_OBJECTS = (True, 1.5, "x", [], 0)
BAD_COUNTS = ("0", "-1", "x", "1.5", "true", "", "01")


# --- one request: StepCosts (build.speculation.costs_ms) ---------------------------------------

SPEC = {"costs_ms": {"target_decode": 20.0, "target_verify": 24.0, "draft_decode": 8, "context": 92, "runs": 15}}


def test_step_costs_of_a_build_are_read_as_written():
    assert StepCosts.from_manifest(SPEC) == StepCosts(decode=20.0, verify=24.0, draft=8.0)
    assert StepCosts.from_manifest(None) is None
    assert StepCosts.from_manifest({"chosen": {"method": "plain"}}) is None
    # a build without a draft times the target alone: no adaptive k, nothing wrong
    assert StepCosts.from_manifest({"costs_ms": {"target_decode": 1.0, "target_verify": 1.2}}) is None


@pytest.mark.parametrize("speculation", NOT_OBJECTS)
def test_a_speculation_entry_that_is_not_an_object_is_refused(speculation):
    with pytest.raises(ManifestError, match=r"build\.speculation=.*rebuild"):
        StepCosts.from_manifest(speculation)
    with pytest.raises(ManifestError, match=r"build\.speculation=.*specrt build \.\.\. --batch"):
        BatchCosts.from_manifest(speculation)


@pytest.mark.parametrize("costs", ("x", [], 1.5, True))
def test_a_costs_entry_that_is_not_an_object_is_refused(costs):
    with pytest.raises(ManifestError, match=r"build\.speculation\.costs_ms="):
        StepCosts.from_manifest({"costs_ms": costs})


@pytest.mark.parametrize("key", ("target_decode", "target_verify", "draft_decode"))
@pytest.mark.parametrize("bad", BAD_COSTS, ids=repr)
def test_a_step_cost_that_is_not_a_positive_number_is_refused(key, bad):
    spec = {"costs_ms": {**SPEC["costs_ms"], key: bad}}
    with pytest.raises(ManifestError, match=rf"build\.speculation\.costs_ms\.{key}=.*positive number.*rebuild"):
        StepCosts.from_manifest(spec)


@pytest.mark.parametrize("key", ("target_decode", "target_verify"))
def test_a_draft_cost_without_the_target_costs_is_refused(key):
    costs = dict(SPEC["costs_ms"])
    del costs[key]
    with pytest.raises(ManifestError, match=rf"costs_ms has draft_decode without {key}"):
        StepCosts.from_manifest({"costs_ms": costs})


def test_step_costs_refuse_a_bool_and_infinity_built_by_hand():
    for bad in (True, float("inf"), float("nan"), 0.0):
        with pytest.raises(ValueError, match="positive finite"):
            StepCosts(decode=bad, verify=1.0, draft=1.0)


# --- batched: BatchCosts (build.speculation.batch_costs_ms) ------------------------------------

def _batch_spec(**changes) -> dict:
    """A table as `specrt build --batch` writes it (JSON: string keys), with `changes` applied."""
    table = {"target": {"1": {"1": 0.392, "2": 0.3596, "4": 0.4418, "8": 0.5504},
                        "4": {"1": 0.4329, "2": 0.552, "4": 0.8871, "8": 1.0976}},
             "context": 92, "runs": 7}
    table.update(changes)
    return {"costs_ms": {"target_decode": 0.16, "target_verify": 0.2}, "batch_costs_ms": table}


def test_batch_costs_of_a_build_are_read_as_written():
    c = BatchCosts.from_manifest(_batch_spec())
    assert [c.target(n, 1) for n in (1, 2, 4, 8)] == [0.392, 0.3596, 0.4418, 0.5504]
    assert [c.target(n, 4) for n in (1, 2, 4, 8)] == [0.4329, 0.552, 0.8871, 1.0976]
    assert c.draft(2) is None
    d = BatchCosts.from_manifest(_batch_spec(draft={"1": 0.1, "8": 0.45}))
    assert (d.draft(1), d.draft(8)) == (0.1, 0.45)
    assert BatchCosts.from_manifest(_batch_spec(draft=None)).draft(1) is None
    assert BatchCosts.from_manifest(None) is None
    assert BatchCosts.from_manifest({"costs_ms": {"target_decode": 1.0}}) is None


@pytest.mark.parametrize("target", (None, {}, [], "x", 1.5))
def test_a_batch_table_without_target_costs_is_refused(target):
    with pytest.raises(ManifestError, match=r"batch_costs_ms\.target=.*specrt build \.\.\. --batch"):
        BatchCosts.from_manifest(_batch_spec(target=target))


@pytest.mark.parametrize("row", ({}, [], "x", 0, None))
def test_an_empty_or_damaged_row_table_is_refused(row):
    spec = _batch_spec()
    spec["batch_costs_ms"]["target"]["4"] = row
    with pytest.raises(ManifestError, match=r"batch_costs_ms\.target\.4=.*at least one entry"):
        BatchCosts.from_manifest(spec)
    with pytest.raises(ManifestError, match=r"batch_costs_ms\.draft=.*at least one entry"):
        BatchCosts.from_manifest(_batch_spec(draft=row if row is not None else {}))


@pytest.mark.parametrize("bad", BAD_COSTS, ids=repr)
def test_a_batch_step_cost_that_is_not_a_positive_number_is_refused(bad):
    spec = _batch_spec(draft={"1": 0.1, "8": 0.45})
    spec["batch_costs_ms"]["target"]["1"]["2"] = bad
    with pytest.raises(ManifestError, match=r"batch_costs_ms\.target\.1\.2=.*positive number"):
        BatchCosts.from_manifest(spec)
    spec = _batch_spec(draft={"1": 0.1, "8": bad})
    with pytest.raises(ManifestError, match=r"batch_costs_ms\.draft\.8=.*positive number"):
        BatchCosts.from_manifest(spec)


@pytest.mark.parametrize("key", BAD_COUNTS)
def test_a_token_or_row_count_that_is_not_a_positive_integer_is_refused(key):
    spec = _batch_spec()
    spec["batch_costs_ms"]["target"][key] = {"1": 1.0}
    with pytest.raises(ManifestError, match=r"batch_costs_ms\.target has the key .*positive integers"):
        BatchCosts.from_manifest(spec)
    spec = _batch_spec()
    spec["batch_costs_ms"]["target"]["1"][key] = 1.0
    with pytest.raises(ManifestError, match=r"batch_costs_ms\.target\.1 has the key .*positive integers"):
        BatchCosts.from_manifest(spec)


def test_a_falling_segment_never_extends_to_a_cost_of_zero_or_below():
    """Timing noise can measure 8 rows faster than 4; beyond 8 the 4..8 slope would reach 0 ms (a
    division by zero in the policy) and then go negative. Below the smallest count likewise."""
    c = BatchCosts({1: {4: 8.0, 8: 4.0}, 2: {4: 1.0, 8: 10.0}})
    # the 4..8 slope, -1 ms a row, extended: 2, 0 (a division by zero), -4, -52
    assert [c.target(n, 1) for n in (10, 12, 16, 64)] == [4.0, 4.0, 4.0, 4.0]
    assert c.target(2, 1) == pytest.approx(10.0)       # falling, extended backwards: positive, as before
    assert c.target(1, 2) == pytest.approx(0.25)       # the 4..8 slope gives -5.75: 1.0 * 1 / 4 instead
    assert c.target(16, 2) == pytest.approx(28.0)      # a rising segment extends as before
    assert all(c.target(n, T) > 0 for n in range(1, 257) for T in (1, 2))


# --- the batched graphs' static T -------------------------------------------------------------

SHAPES = mf.Shapes(batch=1, max_context=96, prefill_chunk=16, k=3)


class _Entry:
    role = "batch"


@pytest.mark.parametrize("tokens, alias, field", [
    ({"step": 1, "prefill": 1, "decode": 1, "verify": 1}, {"prefill": "step", "decode": "step", "verify": "step"},
     r"models\.batch\.graphs\.step has a static T of 1 .* prefill calls with exactly 16"),
    ({"step": 8, "prefill": 8, "decode": 8, "verify": 8}, {"prefill": "step", "decode": "step", "verify": "step"},
     r"graphs\.step has a static T of 8 .* prefill calls with exactly 16"),
    ({"step": 0, "prefill": 32, "decode": 0, "verify": 0}, {"decode": "step", "verify": "step"},
     r"graphs\.prefill has a static T of 32 .* prefill calls with exactly 16"),
    ({"step": 2, "prefill": 16, "decode": 2, "verify": 2}, {"decode": "step", "verify": "step"},
     r"graphs\.step has a static T of 2 .* verify calls with up to 4"),
])
def test_a_static_graph_the_engine_would_call_with_another_T_is_refused(tokens, alias, field):
    with pytest.raises(ManifestError, match=field + r".*specrt build \.\.\. --batch"):
        check_static_tokens(_Entry(), SHAPES, tokens, alias)


@pytest.mark.parametrize("tokens", [
    {"step": 0, "prefill": 0, "decode": 0, "verify": 0},           # dynamic T: any call
    {"step": 0, "prefill": 16, "decode": 0, "verify": 0},          # a static prefill graph of one chunk
    {"step": 16, "prefill": 16, "decode": 16, "verify": 16},       # windows padded to 16
    {"step": 4, "prefill": 16, "decode": 4, "verify": 4},
])
def test_static_graphs_that_fit_the_engine_calls_are_accepted(tokens):
    check_static_tokens(_Entry(), SHAPES, tokens, {})


# --- end to end: open_batch and SpeculativeGenerator on an edited tiny rows build --------------

def _edited(src, dst, edit):
    shutil.copytree(src, dst)
    path = dst / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))
    return dst


def _set(*path, value):
    def edit(m):
        obj = m
        for k in path[:-1]:
            obj = obj[k]
        if value is _DEL:
            del obj[path[-1]]
        else:
            obj[path[-1]] = value
    return edit


_DEL = object()
BATCH_CASES = {
    "dynamic_tokens false": (_set("models", "batch", "graphs", "step", "dynamic_tokens", value=False),
                             r"models\.batch\.graphs\.step has a static T of 1"),
    "dynamic_tokens deleted": (_set("models", "batch", "graphs", "step", "dynamic_tokens", value=_DEL),
                               r"models\.batch\.graphs\.step has a static T of 1"),
    "speculation true": (_set("build", "speculation", value=True), r"build\.speculation=True"),
    "speculation string": (_set("build", "speculation", value="x"), r"build\.speculation='x'"),
    "target row empty": (_set("build", "speculation", "batch_costs_ms", "target", "1", value={}),
                         r"batch_costs_ms\.target\.1=\{\}"),
    "target cost zero": (_set("build", "speculation", "batch_costs_ms", "target", "2", "1", value=0.0),
                         r"batch_costs_ms\.target\.2\.1=0\.0"),
    "target cost nan": (_set("build", "speculation", "batch_costs_ms", "target", "1", "2", value=math.nan),
                        r"batch_costs_ms\.target\.1\.2=nan"),
}


@pytest.mark.parametrize("case", list(BATCH_CASES))
def test_open_batch_refuses_an_edited_manifest_when_it_opens(tiny_batch_rows_engines, tmp_path, case):
    from specrt.runtime.batch.generator import open_batch
    edit, field = BATCH_CASES[case]
    root = _edited(tiny_batch_rows_engines, tmp_path / "e", edit)
    with pytest.raises(ManifestError, match=field + r".*rebuild the engines with `specrt build \.\.\. --batch`"):
        open_batch(root, max_num_seqs=2)


def test_open_batch_reads_the_costs_its_build_measured(tiny_batch_rows_engines):
    from specrt.runtime.batch.generator import open_batch
    man = json.loads((tiny_batch_rows_engines / "manifest.json").read_text())
    table = man["build"]["speculation"]["batch_costs_ms"]["target"]
    with open_batch(tiny_batch_rows_engines, max_num_seqs=2) as gen:
        costs = gen.engine.policy.costs
        assert costs is not None
        assert {(int(T), int(n)): costs.target(int(n), int(T)) for T, by_n in table.items() for n in by_n} == \
            {(int(T), int(n)): ms for T, by_n in table.items() for n, ms in by_n.items()}
        assert len(gen.generate("Name three colours.", chat=True, max_new_tokens=4).tokens) == 4


@pytest.mark.parametrize("edit, field", [
    (_set("build", "speculation", value=1.5), r"build\.speculation=1\.5"),
    (_set("build", "speculation", "costs_ms", "target_decode", value=0), r"costs_ms\.target_decode=0"),
])
def test_the_one_request_generator_refuses_damaged_costs_when_it_opens(tiny_batch_rows_engines, tmp_path, edit,
                                                                       field):
    from specrt.runtime import SpeculativeGenerator
    root = _edited(tiny_batch_rows_engines, tmp_path / "e", edit)
    with pytest.raises(ManifestError, match=field + r".*rebuild the engines"):
        SpeculativeGenerator(root)


@pytest.mark.parametrize("capacity", [-1, +1, 1000])
def test_open_batch_refuses_a_max_context_the_batched_graph_was_not_built_for(tiny_batch_rows_engines, tmp_path,
                                                                               capacity):
    """shapes.max_context edited alone: the batched graph's cache inputs have the built capacity,
    so the model refuses at open (it reached ONNX Runtime at the first request)."""
    from specrt.errors import GraphFileError
    from specrt.runtime.batch.generator import open_batch
    man = json.loads((tiny_batch_rows_engines / "manifest.json").read_text())
    edit = _set("shapes", "max_context", value=man["shapes"]["max_context"] + capacity if capacity != 1000 else 1000)
    root = _edited(tiny_batch_rows_engines, tmp_path / "e", edit)
    with pytest.raises((GraphFileError, ManifestError), match=r"past_k_0|max_context|capacity"):
        open_batch(root, max_num_seqs=2)


def test_open_batch_runs_a_manifest_whose_optional_build_object_is_null(tiny_batch_rows_engines, tmp_path):
    """`build` is optional (manifest.load accepts null): the batched engine then has no measured
    costs and runs plain steps, with the same greedy tokens."""
    from specrt.runtime.batch.generator import open_batch
    root = _edited(tiny_batch_rows_engines, tmp_path / "e", _set("build", value=None))
    with open_batch(tiny_batch_rows_engines, max_num_seqs=2) as gen:
        want = gen.generate("Name three colours.", chat=True, max_new_tokens=6).tokens
    with open_batch(root, max_num_seqs=2) as gen:
        assert gen.engine.policy.costs is None
        assert gen.generate("Name three colours.", chat=True, max_new_tokens=6).tokens == want
