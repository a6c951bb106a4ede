"""Prompts in the Python API: text, token ids, or a list of chat messages (multi-turn), each
checked before any work."""
from __future__ import annotations

import pytest

from specrt.errors import ContextLengthError, PromptError, SamplingParamsError, TokenizerMismatchError
from specrt.runtime import SpeculativeGenerator
from specrt.runtime.prompt import check_request


@pytest.fixture(scope="module")
def gen(tiny_self_engines):
    return SpeculativeGenerator(tiny_self_engines)


def test_a_list_of_messages_is_a_multi_turn_chat(gen):
    turns = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"},
             {"role": "user", "content": "ef"}]
    ids = gen.encode_prompt(turns)
    assert ids == gen.tokenizer.encode_chat(turns)
    assert gen.encode_prompt(turns, system="be brief") == gen.tokenizer.encode_chat(
        [{"role": "system", "content": "be brief"}] + turns)
    assert gen.encode_prompt("ef", chat=True) == gen.tokenizer.encode_chat([{"role": "user", "content": "ef"}])
    c = gen.generate(turns, max_new_tokens=4, method="plain")
    assert c.prompt_tokens == len(ids) and len(c.tokens) <= 4


def test_a_malformed_message_list_is_a_prompt_error(gen):
    with pytest.raises(PromptError):
        gen.encode_prompt([{"content": "no role"}])
    with pytest.raises(PromptError):
        gen.encode_prompt([{"role": "user", "content": "x"}], system=3)


def test_requests_are_checked_before_any_work():
    assert check_request([1, 2], 4, 10, 50) == [1, 2]
    with pytest.raises(SamplingParamsError):
        check_request([1], True, 10, 50)
    with pytest.raises(ContextLengthError):
        check_request([], 4, 10, 50)
    with pytest.raises(ContextLengthError, match="--max-context 14"):
        check_request(list(range(10)), 4, 10, 50)
    with pytest.raises(TokenizerMismatchError):
        check_request([1, 50], 4, 10, 50)
