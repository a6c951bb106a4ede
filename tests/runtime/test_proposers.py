"""Prompt lookup: the proposal rule, its replay on known outputs, and greedy decoding with
it through the target's graphs giving plain decoding's tokens."""
from __future__ import annotations

import pytest

from specrt.tools.lookup_sim import LookupStats, predicted_lookup_speedup, simulate_lookup
from specrt.runtime.proposers import lookup


def test_lookup_proposes_what_followed_the_latest_earlier_match():
    seq = [1, 2, 3, 9, 1, 2, 4, 5, 1, 2]
    assert lookup(seq, 2, 3) == [4, 5, 1]          # latest earlier [1, 2] is at index 4
    assert lookup(seq, 1, 2) == [4, 5]
    assert lookup(seq, 3, 2) == []                 # [5, 1, 2] never occurred before
    assert lookup([7], 1, 4) == []


def test_replaying_a_repetitive_output_needs_fewer_target_passes():
    out = [5, 6, 7, 8] * 6
    s = simulate_lookup([5, 6, 7, 8], out, n=1, k=4)
    assert s.tokens == len(out) - 1 and s.rounds < s.tokens and s.proposal_rounds > 0


def test_no_match_means_one_decode_step_per_token_and_no_speedup():
    s = simulate_lookup([1], list(range(10, 30)), n=2, k=4)
    assert s == LookupStats(tokens=19, rounds=19, proposal_rounds=0)
    assert predicted_lookup_speedup([s], t_decode=1.0, t_verify=1.6) == pytest.approx(1.0)


@pytest.fixture(scope="module")
def gen(tiny_self_engines):
    from specrt.runtime import SpeculativeGenerator
    return SpeculativeGenerator(tiny_self_engines)


@pytest.mark.parametrize("prompt", [[5, 6, 7, 5, 6, 7, 5, 6], list(range(10, 40)), [1, 99]])
def test_greedy_prompt_lookup_gives_plain_decodings_tokens(gen, prompt):
    from specrt.tools.bench import _run_lookup
    plain = [e.token for e in gen.tokens(prompt, max_new_tokens=40, method="plain")]
    toks, _, m = _run_lookup(gen, prompt, 40, 1)
    assert toks == plain[:len(toks)] and m.iterations <= len(toks)


def test_the_lookup_method_equals_plain_decoding_and_needs_no_draft(tiny_pair, tmp_path):
    from conftest import build_tiny

    from specrt.errors import SamplingParamsError
    from specrt.runtime import SamplingParams, SpeculativeGenerator
    d = build_tiny(tmp_path / "plain", tiny_pair[0], "none")
    gen = SpeculativeGenerator(d)
    assert gen.methods == ("plain", "lookup")
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]          # repeats: lookup has matches to propose
    drafted = 0
    for ngram in (1, 2, 3):
        plain = [e.token for e in gen.tokens(prompt, max_new_tokens=40, method="plain")]
        look = [e.token for e in gen.tokens(prompt, max_new_tokens=40, method="lookup", ngram=ngram)]
        assert look == plain
        drafted += gen.last_metrics.drafted
    assert drafted > 0          # the verify path ran, not only one-token steps
    with pytest.raises(SamplingParamsError):
        gen.tokens(prompt, method="lookup", sampling=SamplingParams(temperature=0.7))
    with pytest.raises(SamplingParamsError):
        gen.tokens(prompt, method="lookup", ngram=0)


def test_cli_generate_and_bench_run_prompt_lookup_on_engines_without_a_draft(tiny_pair, tmp_path, capsys):
    from conftest import build_tiny

    from specrt import cli
    d = build_tiny(tmp_path / "plain", tiny_pair[0], "none", max_context=480)
    capsys.readouterr()
    assert cli.main(["generate", str(d), "abcabcabc", "--raw", "--lookup", "2", "--max-new-tokens", "6"]) == 0
    assert cli.main(["bench", str(d), "--prompts", "1", "--max-new-tokens", "6"]) == 0
    assert "outputs identical: yes" in capsys.readouterr().out
    assert cli.main(["bench", str(d), "--prompts", "1", "--max-new-tokens", "6", "--temperature", "0.5"]) == 2
    assert "greedy only" in capsys.readouterr().err
