"""Chat templates: render a conversation the way ``transformers`` does, and find the replies.

A chat template is the model's own Jinja program (``tokenizer_config.json`` or
``chat_template.jinja``). :func:`render` runs it in a sandbox that behaves like the one
``transformers`` uses (``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, ``tojson`` that keeps
non-ASCII text, ``raise_exception``, ``strftime_now``, the ``{% generation %}`` tag), so the text
is byte-for-byte what a server rendering the same template sees.

:func:`render_chat` also returns the character span of every assistant reply. A reply is what
the model generates after the generation prompt: it starts right after the assistant header and
ends after the end-of-turn token (``<|eot_id|>``, ``<|im_end|>``, ...) that closes it. With
``{% generation %}`` tags the spans are the tagged blocks; without them they are found from the
rendered text alone (see :func:`render_chat`). Tokens are not involved here; the tokenizer maps
the spans onto tokens.

Example::

    >>> template = load_template("qwen2_5")
    >>> chat = render_chat(template, [{"role": "user", "content": "Hi"},
    ...                               {"role": "assistant", "content": "Hello!"}],
    ...                    control_tokens=["<|im_start|>", "<|im_end|>"], end_tokens=["<|im_end|>"])
    >>> [chat.text[s:e] for s, e in chat.assistant_spans]
    ['Hello!<|im_end|>']
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from importlib import resources
from os import PathLike
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import jinja2.visitor
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "MAX_RENDER_CHARS",
    "MAX_RENDER_STEPS",
    "MAX_SIZE_ARGUMENT",
    "TEMPLATE_NAMES",
    "TemplateBudgetError",
    "chat_template_hint",
    "control_tokens",
    "RenderedChat",
    "compile_template",
    "has_generation_tags",
    "load_template",
    "normalize_messages",
    "render",
    "render_chat",
]

TEMPLATE_NAMES: tuple[str, ...] = tuple(
    sorted(
        entry.name.removesuffix(".jinja")
        for entry in resources.files("tunesmith.data").joinpath("templates").iterdir()
        if entry.name.endswith(".jinja")
    )
)
"""Chat templates shipped with tunesmith: every ``tunesmith/data/templates/<name>.jinja``
(a family's ``template`` names one; adding the file is all it takes)."""


def chat_template_hint(choice: str = "<name or .jinja file>") -> str:
    """How to give a tokenizer a chat template, first as the override a config and the command
    line take, then in Python: the hint of every error about a missing template.

    >>> chat_template_hint()  # doctest: +ELLIPSIS
    'set tokenizer.chat_template=<name or .jinja file> (shipped: ...; in Python: ...)'
    """
    return (
        f"set tokenizer.chat_template={choice} (shipped: "
        f"{', '.join(TEMPLATE_NAMES)}; in Python: Tokenizer.from_pretrained(folder, "
        "chat_template=...))"
    )


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation and the ``[start, end)`` character span of each assistant reply."""

    text: str
    assistant_spans: list[tuple[int, int]]


def load_template(name_or_path: str | PathLike[str]) -> str:
    """Source of a shipped template (``"llama3"``, ``"qwen2_5"``, ``"qwen3"``) or of a ``.jinja`` file.

    Example::

        >>> "<|im_start|>" in load_template("qwen3")
        True
    """
    if isinstance(name_or_path, str) and name_or_path in TEMPLATE_NAMES:
        return (
            resources.files("tunesmith.data")
            .joinpath(f"templates/{name_or_path}.jinja")
            .read_text("utf-8")
        )
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"chat template {str(name_or_path)!r} is neither a shipped template "
            f"({', '.join(TEMPLATE_NAMES)}) nor an existing .jinja file"
        )
    return path.read_text(encoding="utf-8")


_CONTROL_TOKEN = re.compile(r"<\|[^\s<>|]+\|>|<(?:start|end)_of_turn>")


def control_tokens(template: str) -> list[str]:
    """The control tokens a template writes literally (``<|im_start|>``, ``<|eot_id|>``,
    ``<start_of_turn>``...), in order of first use: a vocabulary that lacks one of them
    belongs to another family (the template would render it as plain text pieces).

    Example::

        >>> control_tokens(load_template("qwen2_5"))
        ['<|im_start|>', '<|im_end|>']
    """
    return list(dict.fromkeys(_CONTROL_TOKEN.findall(template)))


def has_generation_tags(template: str) -> bool:
    """Whether the template marks assistant text with ``{% generation %}`` blocks."""
    return _GENERATION_TAG.search(template) is not None


# ---------------------------------------------------------------------------------------------
# The rendering budget: a template from a model folder is a program; it must end, and small.

MAX_RENDER_CHARS = 2**26
"""Characters one render may output, and the longest string a template may build (64 Mi)."""
MAX_RENDER_STEPS = 1_000_000
"""Loop iterations plus ``range()`` items one render may run (real templates run hundreds)."""
MAX_SIZE_ARGUMENT = 4096
"""The largest width, indent or count a template may give a filter or string method."""


class TemplateBudgetError(ValueError):
    """A chat template went over its rendering budget (steps, output size, recursion).

    Example::

        >>> render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
        ...        "{% endfor %}", [{"role": "user", "content": "hi"}])
        Traceback (most recent call last):
        tunesmith.data.chat_template.TemplateBudgetError: chat template stopped: it ran more ...
    """


class _Budget:
    """What is left of one render's budget (loop steps)."""

    def __init__(self) -> None:
        self.steps = MAX_RENDER_STEPS

    def charge(self, steps: int) -> None:
        self.steps -= steps
        if self.steps < 0:
            raise TemplateBudgetError(
                f"chat template stopped: it ran more than {MAX_RENDER_STEPS} loop steps "
                "(nested loops or a huge range(); a chat template needs a few hundred)"
            )


_BUDGET: ContextVar[_Budget | None] = ContextVar("tunesmith_template_budget", default=None)


def _charge(steps: int) -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.charge(steps)


def _too_big(what: str, size: int, limit: int = MAX_RENDER_CHARS) -> TemplateBudgetError:
    return TemplateBudgetError(f"chat template stopped: {what}: {size}, over the limit of {limit}")


def _check_size(value: Any, what: str) -> Any:
    """``value`` itself, unless it is a string or sequence over :data:`MAX_RENDER_CHARS`."""
    if isinstance(value, (str, list, tuple)) and len(value) > MAX_RENDER_CHARS:
        raise _too_big(what, len(value))
    return value


def _check_argument(value: Any, what: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and value > MAX_SIZE_ARGUMENT:
        raise _too_big(what, value, MAX_SIZE_ARGUMENT)


_FORMAT_WIDTH = re.compile(r"[%{:][^%{}:]{0,8}?(\d{5,})")


def _check_format(template: Any, what: str) -> None:
    """Refuse a format string with a width or precision over :data:`MAX_SIZE_ARGUMENT`."""
    if isinstance(template, str):
        for digits in _FORMAT_WIDTH.findall(template):
            _check_argument(int(digits), what)


def _check_replace(text: Any, old: Any, new: Any, what: str) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        pieces = len(text) + 1 if not old else len(text) // len(old)
        _check_size_of(len(text) + pieces * len(new), what)


def _check_size_of(size: int, what: str) -> None:
    if size > MAX_RENDER_CHARS:
        raise _too_big(what, size)


def _checked_join(pieces: Any) -> str:
    """``"".join(pieces)`` that stops once the text would pass :data:`MAX_RENDER_CHARS`."""
    out: list[str] = []
    size = 0
    for piece in pieces:
        size += len(piece)
        if size > MAX_RENDER_CHARS:
            raise _too_big("the rendered text", size)
        out.append(piece)
    return "".join(out)


def _counted(iterable: Any) -> Any:
    """A ``{% for %}`` loop's iterable, charging one step per iteration."""
    for item in iterable:
        _charge(1)
        yield item


def _concat(values: Sequence[Any]) -> str:
    """The ``~`` operator, refusing a string over :data:`MAX_RENDER_CHARS`."""
    texts = [str(v) for v in values]
    _check_size_of(sum(map(len, texts)), "a string joined with '~'")
    return "".join(texts)


class _Metered(jinja2.visitor.NodeTransformer):
    """Rewrites a parsed template so every loop counts its steps and every ``~`` its size."""

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:
        node = self.generic_visit(node)
        node.iter = jinja2.nodes.Filter(node.iter, "_tunesmith_counted", [], [], None, None)
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:
        node = self.generic_visit(node)
        items = jinja2.nodes.List(node.nodes)
        return jinja2.nodes.Filter(items, "_tunesmith_concat", [], [], None, None)


def _budget_range(*args: Any) -> range:
    """``range()`` for templates: charges its length to the budget up front."""
    numbers = range(*args)
    _charge(len(numbers))
    return numbers


def _sequence_times(left: Any, right: Any) -> None:
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
            _check_size_of(len(seq) * max(n, 0), "a repeated string or list ('*')")
    if isinstance(left, int) and isinstance(right, int):
        _check_bits(left.bit_length() + right.bit_length())


def _check_bits(bits: int) -> None:
    if bits > 8 * MAX_SIZE_ARGUMENT * 2:
        raise _too_big("an integer (in bits)", bits, 8 * MAX_SIZE_ARGUMENT * 2)


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        _sequence_times(left, right)
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        _check_bits(max(left.bit_length() - 1, 0) * right)
    elif operator == "+" and isinstance(left, (str, list, tuple)):
        if isinstance(right, type(left)):
            _check_size_of(len(left) + len(right), "a string or list joined with '+'")
    elif operator == "%" and isinstance(left, str):
        _check_format(left, "a '%' format width")


_SIZE_ARGUMENTS = {  # filter -> (position after the value, keyword) of its size argument
    "center": (0, "width"),
    "indent": (0, "width"),
    "slice": (0, "slices"),
    "batch": (0, "linecount"),
    "tojson": (1, "indent"),
    "truncate": (0, "length"),
    "wordwrap": (0, "width"),
}
_STR_METHODS = {"center", "ljust", "rjust", "zfill", "expandtabs"}


def _check_filter_call(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    if name in _SIZE_ARGUMENTS:
        position, keyword = _SIZE_ARGUMENTS[name]
        value = args[position + 1] if len(args) > position + 1 else kwargs.get(keyword)
        _check_argument(value, f"the {keyword} of filter '{name}'")
    elif name == "format" and args:
        _check_format(args[0], "a width in filter 'format'")
    elif name == "replace" and len(args) >= 3:
        _check_replace(args[0], args[1], args[2], "the text of filter 'replace'")


def _guarded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (a filter) with its size arguments and its result checked."""

    @functools.wraps(function)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        plain = args[1:] if getattr(function, "jinja_pass_arg", None) else args
        _check_filter_call(name, plain, kwargs)
        return _check_size(function(*args, **kwargs), f"the result of filter '{name}'")

    return guarded


def _check_method_call(function: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    method = getattr(function, "__wrapped__", function)  # the sandbox wraps str.format
    owner = getattr(method, "__self__", None)
    name = getattr(method, "__name__", "")
    if not isinstance(owner, str):
        return
    if name in _STR_METHODS:
        for value in (*args, *kwargs.values()):
            _check_argument(value, f"the width of str.{name}")
    elif name in ("format", "format_map"):
        _check_format(owner, f"a width in str.{name}")
    elif name == "replace" and len(args) >= 2:
        _check_replace(owner, args[0], args[1], "the text of str.replace")


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    for value in (n, min, max):
        _check_argument(value, "an argument of lipsum")
    return jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max)


# ---------------------------------------------------------------------------------------------
# The sandboxed Jinja environment (same behaviour as transformers' chat template environment).

# (rendered pieces so far, spans found) of the render in progress, if it tracks generation blocks
_TRACKING: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar(
    "tunesmith_generation_tracking", default=None
)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body and records where it landed."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_record", [])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _record(self, caller: Callable[[], str]) -> str:
        text = caller()
        tracking = _TRACKING.get()
        if tracking is not None:
            pieces, spans = tracking
            start = sum(len(piece) for piece in pieces)
            spans.append((start, start + len(text)))
        return text


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Plain json.dumps: Jinja's own filter escapes HTML characters and sorts keys.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _DictFactory:
    """``dict(...)`` for templates, without exposing the ``dict`` type object itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _check_attribute(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates may not store underscore attributes on a namespace (got {name!r})"
        )


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore attributes (no reach into Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_attribute(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_attribute(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with a budget: loops count their steps, strings and outputs their size."""

    intercepted_binops = frozenset(["*", "**", "+", "%"])
    concat = staticmethod(_checked_join)  # block ``set``s, macro bodies, ``render()``

    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        return _Metered().visit(super()._parse(source, name, filename))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return _check_size(super().call_binop(context, operator, left, right), repr(operator))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_method_call(__obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        return _check_size(result, f"the result of {getattr(__obj, '__name__', 'a call')}")


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = _BudgetedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _guarded_filter(name, f) for name, f in env.filters.items()}
    env.filters["_tunesmith_counted"] = _counted
    env.filters["_tunesmith_concat"] = _concat
    env.globals["range"] = _budget_range
    env.globals["lipsum"] = _lipsum
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _Namespace
    return env


_ENV = _make_environment()


@lru_cache(maxsize=64)
def compile_template(template: str) -> jinja2.Template:
    """Compile a chat template (cached by source). Raises ``jinja2.TemplateSyntaxError``."""
    return _ENV.from_string(template)


# ---------------------------------------------------------------------------------------------
# Template inputs


def _plain(value: Any, where: str) -> Any:
    """A copy of ``value`` made of plain JSON-like Python types only (safe to hand to a template)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, np.generic):
        return _plain(value.item(), where)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(_plain(v, f"{where}[{i}]") for i, v in enumerate(value))
    raise TypeError(
        f"{where}: a chat template input must be JSON-like (str, number, bool, None, dict, "
        f"list), got {type(value).__name__}"
    )


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as ``transformers`` hands them to a template.

    Keys whose value is ``None`` are dropped (templates test for a missing key, not for None),
    values become plain Python data, and a message with reasoning under any of
    ``reasoning_content`` / ``thinking`` / ``reasoning`` gets it under ``reasoning_content`` and
    ``thinking`` too.

    Example::

        >>> normalize_messages([{"role": "assistant", "content": "4", "tool_calls": None,
        ...                      "reasoning": "2+2"}])
        [{'thinking': '2+2', 'role': 'assistant', 'content': '4', 'reasoning': '2+2', 'reasoning_content': '2+2'}]
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        plain = _plain({k: v for k, v in message.items() if v is not None}, f"messages[{i}]")
        reasoning = next((plain[k] for k in _REASONING_KEYS if plain.get(k) is not None), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        out.append(plain)
    return out


def _plain_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise TypeError(f"tools must be a list of JSON schema dicts, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise TypeError(f"tools[{i}] must be a JSON schema dict, got {type(tool).__name__}")
    return _plain(list(tools), "tools")


class _Renderer:
    """Renders one conversation's template with fixed tools and kwargs, for any message list."""

    def __init__(
        self,
        template: str,
        tools: Sequence[Mapping[str, Any]] | None,
        kwargs: Mapping[str, Any],
    ) -> None:
        self.compiled = compile_template(template)
        self.context = {"documents": None, **_plain(dict(kwargs), "template kwargs")}
        self.context["tools"] = _plain_tools(tools)

    def __call__(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self._stream(messages, add_generation_prompt, [])

    def tracked(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool
    ) -> tuple[str, list[tuple[int, int]]]:
        pieces: list[str] = []
        spans: list[tuple[int, int]] = []
        token = _TRACKING.set((pieces, spans))
        try:
            text = self._stream(messages, add_generation_prompt, pieces)
        finally:
            _TRACKING.reset(token)
        return text, spans

    def _stream(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, pieces: list[str]
    ) -> str:
        """Render piece by piece into ``pieces`` within a fresh budget (see
        :data:`MAX_RENDER_STEPS`, :data:`MAX_RENDER_CHARS`); returns the text."""
        token = _BUDGET.set(_Budget())
        size = 0
        try:
            stream = self.compiled.generate(
                **self.context, messages=messages, add_generation_prompt=add_generation_prompt
            )
            for piece in stream:
                size += len(piece)
                if size > MAX_RENDER_CHARS:
                    raise _too_big("the rendered text", size)
                pieces.append(piece)
        except RecursionError:
            raise TemplateBudgetError(
                "chat template stopped: its macros or loops recurse too deep"
            ) from None
        except MemoryError:
            raise TemplateBudgetError("chat template stopped: it ran out of memory") from None
        finally:
            _BUDGET.reset(token)
        return "".join(pieces)

    def try_render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str | None:
        # Probe renders of a prefix may fail on templates that validate the whole conversation
        # (e.g. "roles must alternate"); the caller then locates turns by search instead.
        try:
            return self(messages, add_generation_prompt)
        except TemplateBudgetError:
            raise
        except Exception:
            return None


def render(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    **template_kwargs: Any,
) -> str:
    """Render ``messages`` with a chat template, exactly as ``transformers`` would.

    ``template_kwargs`` become template variables (``bos_token``, ``enable_thinking``, ...).

    Example::

        >>> render("{% for m in messages %}{{ m.role }}: {{ m.content }}\\n{% endfor %}",
        ...        [{"role": "user", "content": "hi"}])
        'user: hi\\n'
    """
    messages = normalize_messages(messages)
    if not messages:
        raise ValueError("cannot render an empty conversation")
    return _Renderer(template, tools, template_kwargs)(messages, add_generation_prompt)


# ---------------------------------------------------------------------------------------------
# Finding the assistant replies


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    control_tokens: Collection[str] = (),
    end_tokens: Collection[str] = (),
    **template_kwargs: Any,
) -> RenderedChat:
    """Render ``messages`` and locate each assistant reply in the text.

    With ``{% generation %}`` tags, the replies are the tagged blocks, as in ``transformers``.

    Otherwise, for the ``i``-th message when it is an assistant message:

    * **Header.** The generation prompt ``g`` is what ``add_generation_prompt=True`` appends to
      the conversation before the first assistant message. The reply's turn starts where the
      conversation before it ends: at ``len(render(messages[:i]))`` when that render is a prefix
      of the full text, else (templates that rewrite history, like Qwen3 dropping old
      ``<think>`` blocks) at the next occurrence of the assistant role header after the previous
      reply. The header is the longest prefix of ``g``, cut just before one of
      ``control_tokens`` (or all of ``g``), that the text repeats there: with Qwen3's
      ``enable_thinking=False`` prompt ``<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n``, a
      turn that has that empty think block excludes it, a turn with real reasoning starts at
      ``<think>``. Where the turn is found by search, it is the last header before the
      message's content, so a user turn quoting the header is not taken for it.
    * **End.** The reply runs to the end of the first of ``end_tokens`` after the message's
      content. Where the content is in the text is found by rendering the conversation again
      with a marker before and after it, so a reply that quotes the end-of-turn string (which
      a real tokenizer turns into the special token) is not cut there.

    So a reply is exactly what the model generates after the generation prompt, including the
    end-of-turn token and excluding what follows it (e.g. the newline after ``<|im_end|>``).

    Args:
        control_tokens: the tokenizer's added tokens (``<|im_start|>``, ``<think>``, ...).
        end_tokens: strings that end a turn (the tokenizer's stop tokens).

    Raises:
        ValueError: the template has no generation prompt, a reply is not closed by one of
            ``end_tokens``, or a reply cannot be located.
    """
    messages = normalize_messages(messages)
    if not messages:
        raise ValueError("cannot render an empty conversation")
    renderer = _Renderer(template, tools, template_kwargs)
    if has_generation_tags(template):
        text, spans = renderer.tracked(messages, add_generation_prompt)
        return RenderedChat(text, spans)
    text = renderer(messages, add_generation_prompt)
    spans = _infer_spans(
        renderer, messages, text, add_generation_prompt, control_tokens, end_tokens
    )
    return RenderedChat(text, spans)


def _infer_spans(
    renderer: _Renderer,
    messages: list[dict[str, Any]],
    text: str,
    add_generation_prompt: bool,
    control_tokens: Collection[str],
    end_tokens: Collection[str],
) -> list[tuple[int, int]]:
    replies = [i for i, message in enumerate(messages) if message.get("role") == "assistant"]
    if not replies:
        return []
    end_tokens = [token for token in end_tokens if token]
    if not end_tokens:
        raise ValueError(
            "cannot find where assistant replies end: no end-of-turn tokens given "
            "(the tokenizer has no eos / stop tokens)"
        )
    prefixes: dict[int, str | None] = {}

    def prefix(n: int) -> str | None:
        if n not in prefixes:
            prefixes[n] = renderer.try_render(messages[:n], False)
        return prefixes[n]

    headers = _header_candidates(
        _generation_prompt(renderer, messages, replies, prefix, end_tokens), control_tokens
    )
    spans = []
    cursor = 0
    for i in replies:
        rendered = prefix(i)
        for before in _open_ended(rendered, end_tokens) if rendered is not None else ():
            if len(before) >= cursor and text.startswith(before):
                cursor = len(before)  # the turn starts here, unless the header comes later
                break
        here = text.startswith(headers[-1], cursor)
        content_start = (
            None if here else _content_edge(renderer, messages, i, text, add_generation_prompt)
        )
        if here:
            turn = cursor
        elif content_start is not None:  # the last header before the content, not one quoted
            turn = text.rfind(headers[-1], cursor, content_start)  # in a user turn before it
        else:
            turn = text.find(headers[-1], cursor)
        if turn < 0:
            raise ValueError(
                f"messages[{i}]: cannot find the assistant header {headers[-1]!r} in the "
                "rendered conversation; add {% generation %} tags to the chat template"
            )
        limit = len(text) if content_start is None else content_start
        fits = (h for h in headers if text.startswith(h, turn) and turn + len(h) <= limit)
        header = next(fits, headers[-1])
        start = turn + len(header)
        # The reply's own end-of-turn token comes after its content, which may quote that token.
        content_end = _content_edge(renderer, messages, i, text, add_generation_prompt, end=True)
        end = _end_of_turn(text, max(start, content_end or 0), end_tokens)
        through = prefix(i + 1) if i + 1 < len(messages) else None
        turn_end = None
        for head in _open_ended(through, end_tokens) if through is not None else ():
            if text.startswith(head):
                turn_end = len(head)
                break
        if end is None or (turn_end is not None and end > turn_end):
            raise ValueError(
                f"messages[{i}]: the assistant turn is not closed by an end-of-turn token "
                f"({', '.join(map(repr, end_tokens))}); add {{% generation %}} tags to the "
                "chat template to mark the replies"
            )
        spans.append((start, end))
        cursor = end
    return spans


_MARK = "\ue000tunesmith\ue001"  # private-use characters: no template trims or escapes them


def _content_edge(
    renderer: _Renderer,
    messages: list[dict[str, Any]],
    i: int,
    text: str,
    add_generation_prompt: bool,
    *,
    end: bool = False,
) -> int | None:
    """Where message ``i``'s content starts (``end``: ends) in ``text``; None when unknown.

    The conversation is rendered again with a marker before (after) the content; the first
    character where that render differs from ``text`` is where the content starts (ends) as
    the template wrote it, trimmed or not. Unlike a search for the end-of-turn string, this
    does not stop at an end-of-turn token the reply quotes.

    Example::

        >>> r = _Renderer(load_template("qwen2_5"), None, {})
        >>> m = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b<|im_end|>c"}]
        >>> text = r(m, False)
        >>> text[_content_edge(r, m, 1, text, False, end=True) :]  # not the quoted one
        '<|im_end|>\\n'
    """
    content = messages[i].get("content")
    if not isinstance(content, str) or not content or _MARK in text:
        return None
    marked = content + _MARK if end else _MARK + content
    changed = [*messages[:i], {**messages[i], "content": marked}, *messages[i + 1 :]]
    other = renderer.try_render(changed, add_generation_prompt)
    if other is None:
        return None
    at = _common_prefix(text, other)
    # the marker is there, after at most the whitespace a trimming template dropped
    return at if other[at : at + len(marked)].lstrip().startswith(_MARK) else None


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (``"abc", "abd"`` -> 2)."""
    low, high = 0, min(len(a), len(b))
    while low < high:  # binary search with C-speed slice comparisons
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def _open_ended(rendered: str, end_tokens: Collection[str]) -> list[str]:
    """``rendered`` (a conversation without the generation prompt), then the same without a
    trailing end token: some templates close a finished conversation with the eos (Phi-4-mini),
    which the next turn's text does not have."""
    return [rendered] + [rendered[: -len(t)] for t in end_tokens if t and rendered.endswith(t)]


def _generation_prompt(
    renderer: _Renderer,
    messages: list[dict[str, Any]],
    replies: list[int],
    prefix: Callable[[int], str | None],
    end_tokens: Collection[str],
) -> str:
    for closed in (False, True):  # as rendered first; then without a closing eos, if any
        for i in replies:
            without = prefix(i)
            with_prompt = renderer.try_render(messages[:i], True)
            if without is None or with_prompt is None:
                continue
            heads = _open_ended(without, end_tokens)[1:] if closed else [without]
            for head in heads:
                if with_prompt.startswith(head) and len(with_prompt) > len(head):
                    return with_prompt[len(head) :]
    raise ValueError(
        "cannot locate the assistant replies: add_generation_prompt=True does not add an "
        "assistant header to this chat template's output; add {% generation %} tags to the "
        "chat template to mark the replies"
    )


def _header_candidates(prompt: str, control_tokens: Collection[str]) -> list[str]:
    """Prefixes of the generation prompt that may serve as a turn's header, longest first."""
    cuts = {len(prompt)}
    for token in control_tokens:
        if not token:
            continue
        at = prompt.find(token, 1)
        while at != -1:
            cuts.add(at)
            at = prompt.find(token, at + 1)
    return [prompt[:cut] for cut in sorted(cuts, reverse=True)]


def _end_of_turn(text: str, start: int, end_tokens: Sequence[str]) -> int | None:
    best: tuple[int, int] | None = None  # (position, -length): earliest, then longest
    for token in end_tokens:
        at = text.find(token, start)
        if at != -1 and (best is None or (at, -len(token)) < best):
            best = (at, -len(token))
    return None if best is None else best[0] - best[1]
