"""Chat templates rendered as transformers renders them, without importing transformers.

transformers 5.x (`utils/chat_template_utils.py`: `_cached_compile_jinja_template`,
`render_jinja_template`) renders a model's chat template in jinja2's
`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the loop-controls
extension (`{% break %}`, `{% continue %}`) and a `{% generation %}` tag, the globals
`raise_exception`, `strftime_now`, `dict` and an underscore-refusing `namespace`, and its own
`tojson` filter (ensure_ascii=False, indent, separators, sort_keys). The template sees
`messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens (`bos_token`, ...)
and any extra keyword (`enable_thinking=False`). This module builds the same environment; a
test renders real templates with both and compares the text.

Beyond transformers, a render is bounded, because an engine folder is shared like any download
and its template is code: every `{% for %}` step counts against one budget per render, strings
built by `+`, `*` and `~` and the whole output have a size limit, `**` and integer arguments to
calls and filters are capped. Breaking a bound is a `PromptError` that says which, never a hang,
an `OverflowError` or a memory blow-up.
"""
from __future__ import annotations

import functools
import json
import re
from contextvars import ContextVar
from datetime import datetime
from typing import Any, Mapping

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.visitor import NodeTransformer

from specrt.errors import ChatTemplateError, PromptError, SpecrtError

MAX_LOOP_STEPS = 1_000_000      # {% for %} iterations per render, all loops together (a chat needs ~10/message)
MAX_CHARS = 1 << 23             # ~8M: a rendered chat, or a string/list a template builds (far past any context)
MAX_INT_ARGUMENT = MAX_CHARS    # size arguments: `'x'|center(10**9)`, `'x'.ljust(10**9)`: refused before running
MAX_POWER_BITS = 1 << 16        # `2 ** 10**9` would run for minutes

# private-use characters wrapped around control tokens typed in user strings (transformers' own pair)
MARK_START, MARK_END = "\U000f0000", "\U000f0001"

_budget: ContextVar[list[int] | None] = ContextVar("specrt_template_budget", default=None)


class _Raised(jinja2.TemplateError):
    """`raise_exception(msg)` in a template: the template refusing the conversation."""


class ChatTemplate:
    """A compiled chat template. `render` is safe to call from several threads at once."""

    def __init__(self, source: str):
        env = _environment()
        try:
            ast = env.parse(source)
            self.literal_text = _literal_text(ast)
            self._template = env.from_string(_Bounded(env).visit(ast))
        except jinja2.TemplateSyntaxError as e:
            line = source.splitlines()[e.lineno - 1].strip() if 0 < e.lineno <= len(source.splitlines()) else ""
            raise ChatTemplateError(
                f"the chat template does not compile: {e.message} (template line {e.lineno}: {line[:120]!r}). specrt "
                "renders chat templates as transformers 5 does; correct tokenizer.chat_template in manifest.json (or "
                "the model's tokenizer_config.json, and rebuild), or use plain prompts (--raw, chat=False)") from None
        except Exception as e:   # jinja raises more than TemplateError on odd input (RecursionError, ...)
            raise ChatTemplateError(f"the chat template does not compile ({type(e).__name__}: {e}): correct "
                                    "tokenizer.chat_template in manifest.json, or use plain prompts (--raw, "
                                    "chat=False)") from None

    def render(self, messages: list[dict], *, add_generation_prompt: bool, variables: Mapping[str, Any],
               tools: list | None = None, documents: list | None = None) -> str:
        """The template's text for `messages` (already normalized), as transformers'
        `apply_chat_template(..., tokenize=False)` returns it. `variables`: the special tokens
        and extra keywords, in that order of precedence."""
        token = _budget.set([MAX_LOOP_STEPS])
        try:
            out, size = [], 0
            for piece in self._template.generate(messages=messages, tools=tools, documents=documents,
                                                 add_generation_prompt=add_generation_prompt, **variables):
                size += len(piece)
                if size > MAX_CHARS:
                    raise PromptError(f"the chat template's output passed {MAX_CHARS} characters: far more than any "
                                      "context holds (the template or the messages are unreasonably large)")
                out.append(piece)
            return "".join(out)
        except _Raised as e:
            raise PromptError(f"the chat template refused these messages: {e.message}") from None
        except SpecrtError:
            raise
        except Exception as e:   # a template is code: any failure in it is this conversation's failure
            where = _template_line(e.__traceback__)
            raise PromptError(f"the chat template could not render these messages ({type(e).__name__}: {e}"
                              f"{where}); check the messages, or pass a plain prompt (chat=False / --raw)") from None
        finally:
            _budget.reset(token)


# --------------------------------------------------------------------------- the environment (transformers')

def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters.update({name: _capped(env.filters[name]) for name in _SIZED_FILTERS})
    env.filters["tojson"] = _tojson
    env.filters["specrt_counted"] = _counted
    env.filters["specrt_concat"] = _concat
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _raise_exception(message):
    raise _Raised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override: jinja's own tojson escapes HTML characters and takes only indent
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` in a template, without the type object's attributes (as transformers)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace refusing underscore names, which reach CPython internals (as transformers)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore-prefixed attributes on a "
                                                  f"namespace ({name!r})")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    is its body, unchanged (transformers' AssistantTracker, without the tracking)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


# --------------------------------------------------------------------------- the bounds (specrt's)

class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"+", "*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                and right * abs(left).bit_length() > MAX_POWER_BITS:
            raise PromptError(f"the chat template computes {left} ** {right}: a number of more than "
                              f"{MAX_POWER_BITS} bits (a broken or hostile template)")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_CHARS:
                    raise PromptError(f"the chat template repeats a {type(seq).__name__} of length {len(seq)} "
                                      f"{n} times: more than {MAX_CHARS} items (a broken or hostile template)")
        if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                and len(left) + len(right) > MAX_CHARS:
            raise PromptError(f"the chat template builds a {type(left).__name__} of more than {MAX_CHARS} items")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):   # noqa: N805 (jinja's signature)
        if __obj is safe_range or isinstance(getattr(__obj, "__self__", None), (str, list)):
            _check_ints(getattr(__obj, "__name__", "range"), args, kwargs)   # 'x'.ljust(n), range(n)
        return super().call(__context, __obj, *args, **kwargs)


def _check_ints(name: str, args, kwargs) -> None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT_ARGUMENT:
            raise PromptError(f"the chat template passes {v} to {name}(): more than {MAX_INT_ARGUMENT} "
                              "(a broken or hostile template)")


_SIZED_FILTERS = ("center", "indent", "wordwrap", "batch", "slice")   # their integer argument sizes the result


def _capped(f):
    """A filter that refuses a huge size argument (`'x'|center(10**9)`); the value filtered is not
    checked. functools.wraps keeps jinja's pass_context/pass_environment mark."""
    skip = 2 if hasattr(f, "jinja_pass_arg") else 1     # (context or environment,) value, arguments...

    @functools.wraps(f)
    def filter_(*args, **kwargs):
        _check_ints(f.__name__, args[skip:], kwargs)
        return f(*args, **kwargs)
    return filter_


def _counted(iterable):
    """Every `{% for %}` iterates through this: one budget of steps per render."""
    budget = _budget.get()
    for item in iterable:
        if budget is not None:
            budget[0] -= 1
            if budget[0] < 0:
                raise PromptError(f"the chat template ran more than {MAX_LOOP_STEPS} loop steps for one "
                                  "conversation (a broken or hostile template)")
        yield item


def _concat(parts) -> str:
    """`a ~ b`: jinja's str_join, with the size limit."""
    parts = [str(p) for p in parts]
    if sum(map(len, parts)) > MAX_CHARS:
        raise PromptError(f"the chat template builds a string of more than {MAX_CHARS} characters with '~'")
    return "".join(parts)


class _Bounded(NodeTransformer):
    """Routes every loop's iterable through `specrt_counted` and every `~` through `specrt_concat`."""

    def __init__(self, env):
        self.env = env

    def _filter(self, node, name: str, lineno: int):
        return nodes.Filter(node, name, [], [], None, None, lineno=lineno).set_environment(self.env)

    def visit_For(self, node):
        node = self.generic_visit(node)
        node.iter = self._filter(node.iter, "specrt_counted", node.lineno)
        return node

    def visit_Concat(self, node):
        node = self.generic_visit(node)
        return self._filter(nodes.List(node.nodes, lineno=node.lineno), "specrt_concat", node.lineno)


def _template_line(tb) -> str:
    """' at template line N' from jinja's rewritten traceback, when it has one."""
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" at template line {line}" if line else ""


def _literal_text(ast) -> str:
    """The template's raw text and string constants, NUL-joined (transformers' _get_template_literal_text):
    added tokens found here are the template's control tokens."""
    literals = {n.data for n in ast.find_all(nodes.TemplateData)}
    literals |= {n.value for n in ast.find_all(nodes.Const) if isinstance(n.value, str)}
    return "\0".join(sorted(literals))


# --------------------------------------------------------------------------- messages and control tokens

_MAX_DEPTH = 32


def normalize_messages(messages) -> list[dict]:
    """A conversation as the template may see it: a non-empty list of dicts, each with a string
    "role", of plain JSON data (str, int, float, bool, lists, dicts with str keys) in valid UTF-8;
    keys whose value is None are dropped and the reasoning field is aliased, as transformers does.
    Anything else is a PromptError naming the message and field."""
    if isinstance(messages, Mapping):
        raise PromptError("messages must be a list of messages, got one dict: wrap it, [{'role': 'user', "
                          "'content': '...'}]")
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise PromptError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if not messages:
        raise PromptError("the conversation is empty: give at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise PromptError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if not all(isinstance(k, str) for k in m):
            raise PromptError(f"messages[{i}] has a key that is not a string: {sorted(map(repr, m))}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise PromptError(f"messages[{i}] needs a 'role' string (system, user, assistant, ...), got "
                              f"{m.get('role')!r}")
        if not isinstance(m.get("content"), (str, list, type(None))):
            raise PromptError(f"messages[{i}]['content'] must be a string (or a list of content parts), got "
                              f"{type(m['content']).__name__}")
        msg = {k: _plain(v, f"messages[{i}][{k!r}]", 0) for k, v in m.items() if v is not None}
        reasoning = next((msg[k] for k in ("reasoning_content", "thinking", "reasoning") if k in msg), None)
        if reasoning is not None:   # templates read reasoning_content (gpt-oss: thinking)
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


def plain_data(value, where: str):
    """`value` (tools, documents, extra template variables) as plain JSON data, or a PromptError."""
    return _plain(value, where, 0)


def _plain(v, where: str, depth: int):
    if depth > _MAX_DEPTH:
        raise PromptError(f"{where} is nested more than {_MAX_DEPTH} levels deep")
    if v is None or type(v) in (bool, int, float):
        return v
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise PromptError(f"{where} is not valid UTF-8 text (a lone surrogate at position {e.start}): send "
                              "UTF-8 text") from None
        return str.__str__(v)
    if type(v).__module__ == "numpy" and hasattr(v, "item"):   # numpy scalars
        return _plain(v.item(), where, depth)
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return float(v)
    if isinstance(v, Mapping):
        if not all(isinstance(k, str) for k in v):
            raise PromptError(f"{where} has a key that is not a string")
        return {_plain(k, where, depth + 1): _plain(x, f"{where}[{k!r}]", depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x, f"{where}[{j}]", depth + 1) for j, x in enumerate(v)]
    raise PromptError(f"{where} is a {type(v).__name__}; chat messages hold only strings, numbers, booleans, "
                      "lists and dicts")


@functools.lru_cache(maxsize=8)
def control_patterns(control_tokens: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern]:
    """(any control token, a marked control token or a lone marker); longest tokens first."""
    alternatives = "|".join(map(re.escape, sorted(control_tokens, key=len, reverse=True))) or "(?!)"
    return re.compile(alternatives), re.compile(f"{MARK_START}({alternatives}){MARK_END}|[{MARK_START}{MARK_END}]")


def mark_control_tokens(obj, tokens_re: re.Pattern):
    """Wrap each control token in user strings in MARK_START/MARK_END (markers already there are
    dropped, so a user cannot forge one); dict keys are left alone (transformers' mark_control_tokens)."""
    if isinstance(obj, str):
        obj = obj.replace(MARK_START, "").replace(MARK_END, "")
        return tokens_re.sub(f"{MARK_START}\\g<0>{MARK_END}", obj)
    if isinstance(obj, dict):
        return {k: mark_control_tokens(v, tokens_re) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [mark_control_tokens(v, tokens_re) for v in obj]
    return obj
