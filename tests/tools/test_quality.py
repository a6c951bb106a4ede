"""The calibration prompt set (shipped file, user files, the split) and `specrt quality`
on tiny random models: an fp32 build measured against itself agrees exactly, an int4
build of the same target does not, and the JSON report carries every field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specrt import manifest as mf
from specrt.calibration.dataset import SHIPPED, Prompt, load_prompts, split
from specrt.errors import ConfigError

SHORT = ["hi", "add 2 and 3", "name a cat", "sort: b a c", "say yes", "why?", "list 3 odd numbers", "ok go"]


# --- the shipped prompt set ----------------------------------------------------------------
def test_shipped_set_has_200_unique_varied_short_prompts():
    prompts = load_prompts()
    assert len(prompts) >= 200
    assert len({p.text for p in prompts}) == len(prompts) and len({p.id for p in prompts}) == len(prompts)
    assert {"chat", "code", "math", "rewrite", "list", "summarize", "instruct"} <= {p.kind for p in prompts}
    assert max(len(p.text.split()) for p in prompts) <= 60
    summaries = [p for p in prompts if p.kind == "summarize"]
    assert all('"' in p.text for p in summaries)       # the passage is inside the prompt


def test_shipped_file_is_package_data():
    assert SHIPPED.parent.name == "data" and SHIPPED.parent.parent.name == "calibration"
    import tomllib
    from pathlib import Path
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert "calibration/data/*.jsonl" in pyproject["tool"]["setuptools"]["package-data"]["specrt"]


# --- user files ------------------------------------------------------------------------------
def test_user_jsonl_and_text_files(tmp_path):
    j = tmp_path / "mine.jsonl"
    j.write_text('{"prompt": "first"}\n\n{"id": "x", "kind": "code", "prompt": " second "}\n')
    assert load_prompts(j) == [Prompt("mine-1", "user", "first"), Prompt("x", "code", "second")]
    t = tmp_path / "mine.txt"
    t.write_text("one prompt\n\n  another prompt  \n")
    assert [p.text for p in load_prompts(t)] == ["one prompt", "another prompt"]
    assert {p.kind for p in load_prompts(t)} == {"user"}


@pytest.mark.parametrize("name,content,words", [
    ("missing.jsonl", None, "does not exist"),
    ("empty.jsonl", "\n\n", "no prompts"),
    ("empty.txt", "", "no prompts"),
    ("bad.jsonl", '{"prompt": "a"}\n{"prompt": \n', "line 2 is not valid JSON"),
    ("list.jsonl", '["a"]\n', "line 1 is a JSON list"),
    ("nofield.jsonl", '{"prompt": "a"}\n{"text": "b"}\n', 'line 2 has no "prompt"'),
    ("blank.jsonl", '{"prompt": "   "}\n', 'line 1 has no "prompt"'),
    ("dup.jsonl", '{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', "line 2 repeats id '1' of line 1"),
])
def test_bad_prompt_files_are_config_errors_naming_the_line(tmp_path, name, content, words):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=words.replace("[", r"\[")):
        load_prompts(path)


def test_folder_and_non_utf8_file_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="is a folder"):
        load_prompts(tmp_path)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_prompts(bad)


# --- split -----------------------------------------------------------------------------------
def test_split_is_deterministic_disjoint_and_covers_every_kind():
    prompts = load_prompts()
    cal, ev = split(prompts)
    assert (cal, ev) == split(prompts) and split(prompts, seed=1) != (cal, ev)
    assert not {p.id for p in cal} & {p.id for p in ev}
    assert len(cal) + len(ev) == len(prompts)
    assert abs(len(ev) - 0.25 * len(prompts)) <= len({p.kind for p in prompts})
    assert {p.kind for p in ev} == {p.kind for p in prompts}
    assert len({p.kind for p in ev[:16]}) >= 5          # the first N held-out prompts mix kinds


def test_split_of_a_small_plain_file_keeps_both_parts(tmp_path):
    prompts = [Prompt(str(i), "user", t) for i, t in enumerate(SHORT[:2])]
    cal, ev = split(prompts, eval_fraction=0.9)
    assert len(cal) == 1 and len(ev) == 1
    for bad in (0, 1, 1.5, True):
        with pytest.raises(ConfigError, match="eval_fraction"):
            split(prompts, eval_fraction=bad)
    with pytest.raises(ConfigError, match="at least 2"):
        split(prompts[:1])


# --- the quality table on tiny builds --------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_builds(tmp_path_factory, tiny_pair):
    from conftest import build_tiny
    root = tmp_path_factory.mktemp("quality")
    kw = dict(max_context=128, prefill_chunk=16)
    fp32 = build_tiny(root / "fp32", tiny_pair[0], "none", **kw)
    int4 = build_tiny(root / "int4", tiny_pair[0], "none", precision="int4", block_size=16, **kw)
    return fp32, int4


def test_quality_table_fp32_against_itself_and_int4(tiny_builds, tmp_path, capsys):
    from specrt.cli import main
    fp32, int4 = tiny_builds
    prompts = tmp_path / "short.txt"
    prompts.write_text("\n".join(SHORT) + "\n")
    out = tmp_path / "q.json"
    rc = main(["quality", str(fp32), str(int4), "--reference", str(fp32), "--prompts", str(prompts),
               "--eval", "4", "--new-tokens", "12", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    from specrt.tools.quality import FIELDS
    ref_row, q_row = report["variants"]
    for row in (ref_row, q_row):
        assert set(FIELDS) <= set(row)
        assert row["engines"] in printed
        assert row["decode_ms"] > 0 and row["verify_ms"] > 0 and row["verify_tokens"] == 4
    assert report["prompts"] == 2 and report["new_tokens"] == 12        # 8 prompts -> 2 held out
    assert len(report["prompt_ids"]) == 2 and ref_row["greedy_mismatch_ids"] == []
    assert set(q_row["greedy_mismatch_ids"]) <= set(report["prompt_ids"])
    assert ref_row["precision"] == "fp32" and q_row["precision"] == "int4"
    assert ref_row["top1_agreement"] == 1.0 and ref_row["mean_kl"] < 1e-9
    assert ref_row["max_abs_logit_delta"] == 0.0 and ref_row["greedy_exact_match"] == 2
    assert ref_row["decode_x_reference"] == 1.0 and ref_row["positions"] == q_row["positions"] > 0
    assert q_row["mean_kl"] > 0 and q_row["max_abs_logit_delta"] > 0
    assert q_row["weights_bytes"] < ref_row["weights_bytes"]


def test_int4_disagrees_somewhere_on_more_prompts(tiny_builds):
    """Random tiny weights quantized to 4 bits: some argmax moves on a few dozen positions."""
    from specrt.tools.quality import quality_table
    fp32, int4 = tiny_builds
    report = quality_table([int4], fp32, SHORT, new_tokens=16, timing_rounds=1, out=None)
    (row,) = report["variants"]
    assert row["top1_agreement"] < 1.0 and row["positions"] >= len(SHORT)
    assert row["greedy_exact_match"] < len(SHORT) and row["greedy_mismatch_prompts"]


def test_quality_refuses_prompts_that_leave_no_room(tiny_builds):
    from specrt.tools.quality import quality_table
    fp32, _ = tiny_builds
    with pytest.raises(ConfigError, match="leaves room"):
        quality_table([fp32], fp32, ["x" * 200], new_tokens=8, out=None)


def test_record_writes_each_row_into_its_own_manifest_and_inspect_shows_it(tiny_builds, tmp_path, capsys):
    import shutil

    from specrt import manifest as mf
    from specrt.cli import main
    from specrt.runtime import SpeculativeGenerator
    fp32, int4 = (shutil.copytree(d, tmp_path / d.name) for d in tiny_builds)
    prompts = tmp_path / "short.txt"
    prompts.write_text("\n".join(SHORT) + "\n")
    assert main(["quality", str(fp32), str(int4), "--reference", str(fp32), "--prompts", str(prompts),
                 "--eval", "4", "--new-tokens", "8", "--record"]) == 0
    assert f"recorded in {int4}/manifest.json" in capsys.readouterr().out
    q = mf.load(int4).quality
    assert q["reference"] == str(fp32) and len(q["prompt_ids"]) == 2 and q["new_tokens"] == 8
    assert 0 <= q["row"]["top1_agreement"] < 1.0 and q["row"]["engines"] == str(int4)
    assert mf.load(fp32).quality["row"]["top1_agreement"] == 1.0
    assert main(["inspect", str(int4)]) == 0
    shown = capsys.readouterr().out
    assert "quality    vs " in shown and ", of its one-row graphs (specrt" in shown and "these one-row graphs" not in shown
    SpeculativeGenerator(int4, methods=("plain",))     # the files and their hashes are untouched
    assert mf.load(tiny_builds[1]).quality is None       # only the folders named were written


def test_a_batch_folder_is_measured_on_its_batched_model(tiny_builds, tiny_batch_engines, tmp_path, capsys):
    """A --batch folder's requests run its batched model (here GroupQueryAttention steps, int8 prompt
    weights), so its row measures that model (runtime/batch/forced.py), says so, and times no
    verify window where the model verifies none; `specrt inspect` names what the recorded row measured."""
    import shutil

    from specrt.cli import main
    from specrt.tools.quality import quality_table
    fp32, int4 = tiny_builds
    report = quality_table([tiny_batch_engines, int4], fp32, SHORT[:4], new_tokens=8, timing_rounds=1, out=None)
    batched, one_row = report["variants"]
    assert batched["runs"] == "batched model (gqa)" and one_row["runs"] == "one-row graphs"
    assert batched["verify_ms"] is None and batched["verify_x_reference"] is None and batched["decode_ms"] > 0
    assert one_row["verify_ms"] > 0 and batched["precision"] == "int4"
    assert batched["top1_agreement"] < 1.0 and batched["mean_kl"] > 0
    copy = shutil.copytree(tiny_batch_engines, tmp_path / "batch")
    prompts = tmp_path / "short.txt"
    prompts.write_text("\n".join(SHORT) + "\n")
    assert main(["quality", str(copy), "--reference", str(fp32), "--prompts", str(prompts), "--eval", "2",
                 "--new-tokens", "4", "--record"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(str(copy)))
    assert line.split()[7] == "-" and line.endswith("batched model (gqa)")     # verify ms; runs
    assert main(["inspect", str(copy)]) == 0
    shown = capsys.readouterr().out
    assert "of its batched model (gqa)" in shown
    # the build's own figure is its one-row graphs', and says so where requests run the batched model
    assert "vs fp32  top-1 agreement" in shown and "(these one-row graphs: the folder's requests run" in shown


def _fp32_refs(folder: Path) -> list[dict]:
    """What the build measured a folder against, again: the fp32 export's greedy continuations
    of the build's prompts (an fp32 folder's target graphs are its fp32 export)."""
    from specrt.builder import steps
    from specrt.builder.gates import identity
    from specrt.runtime.tokenizer import Tokenizer
    man = mf.load(folder)
    t = man.target
    part = {"graphs": {g: {"file": Path(e.file).name, "tokens": e.tokens} for g, e in t.graphs.items()}, "dims": t.dims}
    prompts = steps.prompt_ids(Tokenizer(folder, man.tokenizer), int(t.dims["vocab"]))
    return identity.fp32_reference(folder / "target", part, man.shapes, prompts)


def test_the_build_records_what_a_batch_folders_requests_run(tiny_batch_rows_engines, tiny_batch_engines, capsys):
    """A --batch build measures its batched model against fp32 as every request runs it
    (identity.requests_agreement: the engine's own calls, runtime/batch/forced.py) and records it
    beside the one-row graphs' figure; `specrt inspect` shows both and says which is which."""
    from specrt.builder.gates import identity
    from specrt.cli import main
    folder = tiny_batch_rows_engines                        # fp32: its target graphs are the reference
    rec = mf.load(folder).batch.parity["agreement_with_fp32"]
    assert rec["model"].startswith("the batched model (rows)") and rec["positions"] > 0
    again = identity.requests_agreement(folder, _fp32_refs(folder), 2)
    assert again == rec                                     # the record is that measurement, to the bit
    assert rec["top1_agreement"] == 1.0 and rec["mean_kl"] < 1e-6   # fp32 rows: the one-row model to rounding
    # int4: the batched model (GroupQueryAttention, int8 prompt weights) is another model than the
    # one-row int4 graphs, measured on the same positions of the same continuations
    man = mf.load(tiny_batch_engines)
    batched, one_row = man.batch.parity["agreement_with_fp32"], man.target.parity["agreement_with_fp32"]
    assert batched["positions"] == one_row["positions"] > 0 and batched["mean_kl"] != one_row["mean_kl"]
    assert batched["model"].startswith("the batched model (gqa)") and "model" not in one_row
    assert main(["inspect", str(tiny_batch_engines)]) == 0
    shown = capsys.readouterr().out
    assert "(these one-row graphs: the folder's requests run its batched model, measured below)" in shown
    assert f"top-1 agreement {batched['top1_agreement']:.3f} over {batched['positions']} positions, mean KL " \
           f"{batched['mean_kl']:.3f} (the batched model, as every request runs it)" in shown
