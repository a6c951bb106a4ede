"""`specrt check-modes` on the tiny int4 target built with `--batch --batch-prefill same` (its
batched graph computes each row as the one-row graphs do): every way of calling the folder
gives the greedy tokens of plain decoding, and the check itself reports a mode that does not."""
from __future__ import annotations

import dataclasses

import pytest

from specrt import cli
from specrt.tools import modes
from specrt.tools.modes import REFERENCE, Answer, Family, check_modes, compare, first_difference, format_table

PROMPTS = ["hello there", "the quick brown fox", "one two three four five", "to be or not to be"]
NEW = 12
ROWS = (1, 3)       # one row; three rows for four prompts (one waits for a row, then joins)


@pytest.fixture(scope="module")
def report(tiny_batch_same_engines):
    return check_modes(tiny_batch_same_engines, PROMPTS, max_new_tokens=NEW, rows=ROWS, progress=None)


def test_every_mode_gives_the_greedy_tokens_of_plain_decoding(report):
    names = [m["mode"] for m in report["modes"]]
    assert names == [REFERENCE, "generate: default", "specrt generate", "api: 2 threads", "server: one-request",
                     "triton: one-request"] + [name for r in ROWS for name in (
                         f"open_batch {r}: alone", f"open_batch {r}: generate_batch", f"open_batch {r}: threads",
                         f"server: --max-num-seqs {r}", f"triton: max_num_seqs {r}")] + [
                     f"open_batch {max(ROWS)}, prefill budget 1024: generate_batch"]
    assert report["prompts"] == len(PROMPTS) and report["skipped_prompts"] == 0
    assert any(len(t) > 1 for t in report["reference_tokens"]["greedy"])     # not all ended at once by EOS
    assert {m["mode"]: m["greedy_equal"] for m in report["modes"]} == {name: len(PROMPTS) for name in names}
    assert all(m["first_difference"] is None or m["first_difference"]["setting"] == "sample" for m in report["modes"])
    assert {m["mode"]: m["compared"] for m in report["modes"]}["server: --max-num-seqs 3"] == "text"
    assert {m["mode"]: m["compared"] for m in report["modes"]}["open_batch 3: generate_batch"] == "tokens"


def test_every_mode_gives_the_seeded_sample_of_plain_decoding(report):
    # one accept rule (runtime/choice.py): the one-request modes speculate, the batched ones do not
    assert {m["mode"]: m["sample_equal"] for m in report["modes"]} == \
        {m["mode"]: len(PROMPTS) for m in report["modes"]}
    assert report["equal"]


def _broken(family: Family, prompt: int, position: int) -> Family:
    """`family` with one greedy token of one prompt changed (what a mode that differs returns)."""
    def run(cases, job):
        for name, answers in family.run(cases, job):
            a = answers[0][prompt]
            toks = list(a.tokens)
            toks[position] = (toks[position] + 1) % 50
            answers[0][prompt] = dataclasses.replace(a, tokens=tuple(toks))
            yield name, answers
    return dataclasses.replace(family, run=run)


def test_a_mode_that_differs_fails_the_check_and_says_where(tiny_batch_same_engines):
    api, cli_family = modes.plan(tiny_batch_same_engines, (1,))[:2]
    got = check_modes(tiny_batch_same_engines, PROMPTS, max_new_tokens=NEW, progress=None,
                      families=[api, _broken(cli_family, prompt=1, position=3)])
    row = got["modes"][-1]
    assert row["mode"] == "specrt generate" and row["greedy_equal"] == len(PROMPTS) - 1
    assert row["first_difference"] == {"setting": "greedy", "prompt": 1, "position": 3, "unit": "token"}
    assert not got["equal"]
    table = format_table(got)
    assert "DIFFERENT" in table and "greedy: prompt 1, token 3" in table


def test_first_difference_counts_tokens_or_characters():
    assert first_difference(Answer((1, 2, 3), "abc"), Answer((1, 2, 3), "xyz")) is None    # tokens decide
    assert first_difference(Answer((1, 2, 3), "abc"), Answer((1, 5, 3), "abc")) == 1
    assert first_difference(Answer((1, 2, 3), "abc"), Answer((1, 2), "ab")) == 2             # stopped early
    assert first_difference(Answer((1, 2, 3), "abc"), Answer(None, "abd")) == 2              # text only
    row = compare("server", [[Answer(None, "abc")], [Answer(None, "ab")]],
                  [[Answer((1,), "abc")], [Answer((1,), "abc")]])
    assert (row["compared"], row["greedy_equal"], row["sample_equal"]) == ("text", 1, 0)
    assert row["first_difference"] == {"setting": "sample", "prompt": 0, "position": 2, "unit": "character"}


def test_the_command_exits_1_when_a_mode_differs_and_0_when_none_does(tiny_batch_same_engines, tmp_path,
                                                                      monkeypatch, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS + ["a b c", "x y", "hi", "ok go"]) + "\n")
    plan = modes.plan
    args = ["check-modes", str(tiny_batch_same_engines), "--prompt-file", str(prompts), "--prompts", "2",
            "--max-new-tokens", "6", "--rows", "1"]
    monkeypatch.setattr(modes, "plan", lambda engines, rows: plan(engines, rows)[:2])
    assert cli.main(args) == 0
    assert capsys.readouterr().out.strip().endswith("all equal")
    monkeypatch.setattr(modes, "plan", lambda engines, rows: [plan(engines, rows)[0],
                                                              _broken(plan(engines, rows)[1], 0, 0)])
    assert cli.main(args + ["--json", str(tmp_path / "r.json")]) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT" in out and "greedy: prompt 0, token 0" in out
    assert (tmp_path / "r.json").is_file()
