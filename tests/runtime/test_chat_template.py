"""Chat templates render as transformers renders them: every template in chat_templates/ on
several conversations, with and without the generation prompt, gives the same text with
transformers' `apply_chat_template(..., tokenize=False)` and specrt's `Tokenizer`; where
transformers refuses a conversation (a template's raise_exception, a missing field), specrt
refuses it with a PromptError. Also: compile errors name the line, and hostile templates fail
fast with a PromptError."""
from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from specrt.errors import ChatTemplateError, ManifestError, PromptError
from specrt.runtime import chat_template as ct
from specrt.runtime.tokenizer import Tokenizer
from tiny_models import make_tokenizer_files

TEMPLATES = {p.stem: p.read_text() for p in sorted((Path(__file__).parent / "chat_templates").glob("*.jinja"))}

# special tokens of each family (the file name's prefix picks them)
SPECIAL = {
    "llama3": dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
    "mistral": dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
    "zephyr": dict(bos_token="<s>", eos_token="</s>"),
    "gemma": dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"),
    "phi": dict(bos_token="<s>", eos_token="<|endoftext|>"),
    "qwen": dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
    "": dict(bos_token="<|im_start|>", eos_token="<|im_end|>"),
}

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Météo actuelle d'une ville (°C)",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "la ville, e.g. Zürich"},
        "unit": {"type": "string", "enum": ["c", "f"]}}}}}]

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "Hello! What's 2+2?"}
ANSWER = {"role": "assistant", "content": "4."}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "abc123XYZ", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
RESULT = {"role": "tool", "tool_call_id": "abc123XYZ", "name": "get_weather", "content": '{"temp": 21}'}

# name -> (messages, tools, extra template variables)
CONVERSATIONS = {
    "user": ([USER], None, {}),
    "system+user": ([SYSTEM, USER], None, {}),
    "multi-turn": ([SYSTEM, USER, ANSWER, {"role": "user", "content": "And 3+3?"}], None, {}),
    "multi-turn, no system": ([USER, ANSWER, {"role": "user", "content": "And 3+3?"}], None, {}),
    "unicode and spaces": ([{"role": "user", "content": "  Ça va? 日本語のテキスト 🙂\n\t "}], None, {}),
    "content parts": ([{"role": "user", "content": [{"type": "text", "text": " Describe "}]}], None, {}),
    "tools": ([SYSTEM, {"role": "user", "content": "Weather in Paris?"}, CALL, RESULT], TOOLS, {}),
    "tools, options": ([{"role": "user", "content": "Weather?"}], TOOLS,
                       {"tools_in_user_message": False, "date_string": "01 Jan 2025", "system_prefix": "PRE\n"}),
    "reasoning in content": ([USER, {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4."},
                              {"role": "user", "content": "And 3+3?"}], None, {"enable_thinking": False}),
    "reasoning field": ([USER, {"role": "assistant", "content": "4.", "reasoning_content": "add them"}],
                        None, {"enable_thinking": True}),
    "alternation broken": ([USER, {"role": "user", "content": "again"}], None, {}),
    "reasoning, other name": ([USER, {"role": "assistant", "content": "4.", "reasoning": "add them"}], None, {}),
    "None fields dropped": ([USER, {"role": "assistant", "content": "4.", "tool_calls": None, "name": None},
                             {"role": "user", "content": "ok"}], None, {}),
}

FROZEN = dt.datetime(2025, 3, 4, 5, 6, 7)


class _FrozenDatetime(dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return FROZEN


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer_files(d, 256)
    return d


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch):
    """strftime_now reads the clock: both renderers see the same instant."""
    import transformers.utils.chat_template_utils as hf_ct
    monkeypatch.setattr(hf_ct, "datetime", _FrozenDatetime)
    monkeypatch.setattr(ct, "datetime", _FrozenDatetime)


def _special(name: str) -> dict:
    return next(v for k, v in SPECIAL.items() if name.startswith(k))


def _pair(tokenizer_dir: Path, name: str, source: str):
    """(transformers' tokenizer, specrt's Tokenizer) on the same files and template; the manifest
    carries transformers' special_tokens_map, as a build writes it."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"), chat_template=source,
                                 **_special(name))
    ours = Tokenizer(tokenizer_dir, {"file": "tokenizer.json", "chat_template": source,
                                     "special_tokens_map": dict(hf.special_tokens_map)})
    return hf, ours


def _compare(hf, ours, messages, tools, extra, gen: bool) -> str:
    """'equal' or 'both refuse'; an AssertionError for any difference."""
    try:
        want = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen, **extra)
    except Exception as e:     # transformers refuses: specrt must refuse with its typed error
        with pytest.raises(PromptError):
            ours.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, **extra)
        return f"both refuse ({type(e).__name__})"
    got = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, **extra)
    assert got == want, f"specrt:\n{got!r}\ntransformers:\n{want!r}"
    return "equal"


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_template_renders_as_transformers_renders_it(tokenizer_dir, name):
    hf, ours = _pair(tokenizer_dir, name, TEMPLATES[name])
    outcomes = {}
    for conv, (messages, tools, extra) in CONVERSATIONS.items():
        for gen in (True, False):
            outcomes[conv, gen] = _compare(hf, ours, messages, tools, extra, gen)
    print(f"\n{name}: {sum(o == 'equal' for o in outcomes.values())} equal, "
          f"{sum(o != 'equal' for o in outcomes.values())} refused by both")
    # every template renders the plain conversations: a comparison of two refusals proves nothing
    assert all(outcomes[c, g] == "equal" for c in ("user", "multi-turn, no system") for g in (True, False)), outcomes


def test_the_comparison_covers_the_families_and_features_the_issue_names():
    names = set(TEMPLATES)
    assert {"llama3_1", "qwen2_5", "qwen3", "mistral_v1", "gemma2", "gemma3", "phi3", "smollm2", "chatml",
            "zephyr"} <= names
    text = "\n".join(TEMPLATES.values())
    for feature in ("strftime_now", "{%- break %}", "{%- continue %}", "namespace(", "enable_thinking",
                    "raise_exception", "tojson(indent=4)", "separators=", "sort_keys=", "generation %}"):
        assert feature in text, feature


def test_messages_are_not_modified_by_rendering(tokenizer_dir):
    _, ours = _pair(tokenizer_dir, "qwen3", TEMPLATES["qwen3"])
    messages, _, _ = CONVERSATIONS["reasoning field"]
    before = json.dumps(messages)
    ours.apply_chat_template(messages)
    assert json.dumps(messages) == before


# --------------------------------------------------------------------------- errors at load

def test_a_template_that_does_not_compile_names_the_line_and_does_not_say_damaged(tokenizer_dir):
    source = "{% for m in messages %}\n{{ m.content }}\n{% for x in %}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError) as e:
        Tokenizer(tokenizer_dir, {"file": "tokenizer.json", "chat_template": source})
    msg = str(e.value)
    assert isinstance(e.value, ManifestError)          # callers catching ManifestError still do
    assert "template line 3" in msg and "{% for x in %}" in msg and "Expected an expression" in msg, msg
    assert "damaged" not in msg and "--raw" in msg


def test_break_and_continue_render(tokenizer_dir):
    # older specrt: "the manifest is damaged; rebuild the engines" for this template
    source = "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content }}" \
             "{% if loop.index == 3 %}{% break %}{% endif %}{% endfor %}"
    tok = Tokenizer(tokenizer_dir, {"file": "tokenizer.json", "chat_template": source})
    msgs = [SYSTEM, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "user", "content": "c"}]
    assert tok.apply_chat_template(msgs) == "ab"


def test_raise_exception_is_a_prompt_error_with_the_templates_words(tokenizer_dir):
    tok = Tokenizer(tokenizer_dir, {"file": "tokenizer.json", "chat_template": TEMPLATES["mistral_v1"]})
    with pytest.raises(PromptError, match="roles must alternate"):
        tok.apply_chat_template([USER, USER])


def test_a_render_error_names_the_template_line(tokenizer_dir):
    tok = Tokenizer(tokenizer_dir, {"file": "tokenizer.json", "chat_template": "a\nb\n{{ messages[0].content.nope() }}"})
    with pytest.raises(PromptError, match="template line 3"):
        tok.apply_chat_template([USER])


# --------------------------------------------------------------------------- bounds

HOSTILE = {
    "range too long": ("{% for i in range(10**7) %}x{% endfor %}", "range"),
    "nested loops": ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "loop steps"),
    "loops over a doubled list": ("{% set ns = namespace(l=[1]) %}{% for i in range(30) %}{% set ns.l = ns.l + ns.l %}"
                                  "{% endfor %}{% for x in ns.l %}{% endfor %}", "items"),
    "string multiplication": ("{{ 'x' * 10**10 }}", "repeats a str"),
    "list multiplication": ("{% for x in messages * 10**9 %}{% endfor %}", "repeats a list"),
    "doubling with ~": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}{{ ns.s }}", "'~'"),
    "doubling with +": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                        "{% endfor %}{{ ns.s }}", "more than"),
    "huge power": ("{{ 2 ** (10 ** 9) }}", "bits"),   # jinja's ** groups left: parentheses
    "center filter": ("{{ 'x' | center(10**10) }}", "center"),
    "ljust method": ("{{ 'x'.ljust(10**10) }}", "ljust"),
    "output size": ("{% for i in range(99999) %}{{ 'x' * 1000 }}{% endfor %}", "output"),
    "recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    "sandbox escape": ("{{ messages.__class__.__mro__ }}", "could not render"),
    "namespace underscore": ("{% set ns = namespace(_x=1) %}", "underscore"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_template_fails_with_a_prompt_error(tokenizer_dir, name):
    source, words = HOSTILE[name]
    tok = Tokenizer(tokenizer_dir, {"file": "tokenizer.json", "chat_template": source})
    with pytest.raises(PromptError) as e:
        tok.apply_chat_template([USER])
    assert words in str(e.value), str(e.value)


def test_bounds_leave_room_for_real_templates(tokenizer_dir):
    # a long conversation through the heaviest template stays far inside every budget
    tok = Tokenizer(tokenizer_dir, {"file": "tokenizer.json", "chat_template": TEMPLATES["qwen3"]})
    msgs = [m for i in range(500) for m in ({"role": "user", "content": f"q{i} " * 50}, ANSWER)]
    assert tok.apply_chat_template(msgs).count("<|im_start|>") == 1001
    big = ct.MAX_CHARS // 2
    assert len(tok.apply_chat_template([{"role": "user", "content": "y" * big}])) > big


# --------------------------------------------------------------------------- messages

@pytest.mark.parametrize("messages, words", [
    ({"role": "user", "content": "hi"}, "got one dict"),
    ("hi", "got str"),
    ([], "empty"),
    (["hi"], "messages[0] must be a dict"),
    ([{"content": "hi"}], "'role'"),
    ([{"role": "user", "content": 5}], "content"),
    ([{"role": "user", "content": "a\udfffb"}], "UTF-8"),
    ([{"role": "user", "content": "hi", "meta": object()}], "messages[0]['meta']"),
    ([{"role": "user", "content": "hi", 3: "x"}], "key"),
])
def test_bad_messages_are_prompt_errors_naming_the_field(tokenizer_dir, messages, words):
    tok = Tokenizer(tokenizer_dir, {"file": "tokenizer.json", "chat_template": TEMPLATES["chatml"]})
    for call in (tok.apply_chat_template, tok.encode_chat):
        with pytest.raises(PromptError, match=words.replace("[", r"\[").replace("]", r"\]")):
            call(messages)
