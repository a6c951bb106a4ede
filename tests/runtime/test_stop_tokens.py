"""Per-request stop token ids and ignore_eos in the Python API (the server's and the batched
engine's use of them: tests/serve/test_request_fields.py, tests/runtime/batch/test_batch_engine.py)."""
from __future__ import annotations

import pytest

from specrt.errors import SamplingParamsError
from specrt.runtime.text import TextTail, stop_token_set


class _Tok:
    eos_token_ids = frozenset({9})

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids if not (skip_special_tokens and i == 9))


def _run(tail: TextTail, tokens) -> tuple[str, list[int], str | None]:
    text, toks = "", []
    for t in tokens:
        chunk, reason = tail.push(t)
        if chunk is not None:
            text, toks = text + chunk.text, toks + chunk.tokens
        if reason:
            return text, toks, reason
    return text, toks, None


def test_eos_ends_with_eos_a_stop_token_with_stop_and_neither_is_in_the_output():
    assert _run(TextTail(_Tok()), [0, 1, 9, 2]) == ("ab", [0, 1], "eos")
    assert _run(TextTail(_Tok(), stop_token_ids=[1]), [0, 1, 9, 2]) == ("a", [0], "stop")
    assert _run(TextTail(_Tok(), stop_token_ids=[9]), [0, 9]) == ("a", [0], "eos")    # EOS stays EOS


def test_ignore_eos_makes_eos_an_ordinary_token_but_keeps_stop_tokens():
    assert _run(TextTail(_Tok(), ignore_eos=True), [0, 9, 1]) == ("ab", [0, 9, 1], None)
    assert _run(TextTail(_Tok(), stop_token_ids=[9], ignore_eos=True), [0, 9, 1]) == ("a", [0], "stop")


@pytest.mark.parametrize("ids,ignore", [("12", False), ([1, -1], False), ([1.5], False), ([True], False),
                                        (5, False), ([1], "yes")])
def test_bad_stop_token_ids_or_ignore_eos_are_sampling_params_errors(ids, ignore):
    with pytest.raises(SamplingParamsError):
        stop_token_set(ids, ignore)
