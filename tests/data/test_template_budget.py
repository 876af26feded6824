"""A chat template renders within a budget: loop steps, the size of what it outputs and of
every string it builds, the widths and indents it asks for, recursion. A hostile template (a
model folder is someone else's code) stops in well under a second with one line; the error
from a tokenizer names the file the template came from. Real templates are untouched (the
shipped ones still render as transformers does: test_chat_template.py)."""

from __future__ import annotations

import json
import time

import jinja2.sandbox
import pytest

from tests.data.tokenizer_factory import make_tokenizer_folder
from tunesmith.data.chat_template import (
    MAX_RENDER_CHARS,
    MAX_RENDER_STEPS,
    TemplateBudgetError,
    load_template,
    render,
    render_chat,
)
from tunesmith.data.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]

HOSTILE = {  # id -> (template, words of the error)
    "nested-range": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "loop steps",
    ),
    "nested-lists": (
        "{% for a in messages * 1500 %}{% for b in messages * 1500 %}{% endfor %}{% endfor %}",
        "loop steps",
    ),
    "tojson-indent": ("{{ messages|tojson(indent=10**8) }}", "indent of filter 'tojson'"),
    "center": ("{{ 'x'|center(10**9) }}", "width of filter 'center'"),
    "indent": ("{{ 'a\nb'|indent(10**9) }}", "width of filter 'indent'"),
    "ljust": ("{{ 'x'.ljust(10**9) }}", "str.ljust"),
    "format-method": ("{{ '{:>999999999}'.format(1) }}", "str.format"),
    "format-filter": ("{{ '%999999999s'|format(1) }}", "filter 'format'"),
    "percent": ("{{ '%0999999999d' % 1 }}", "'%' format width"),
    "repeat": ("{{ 'x' * 10**10 }}", "repeated string"),
    "repeat-list": ("{{ (messages * 10**9)|length }}", "repeated string or list"),
    "power": ("{{ 2 ** 10000000 }}", "integer"),
    "tilde-doubling": (
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "'~'",
    ),
    "plus-doubling": (
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
        "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
        "'+'",
    ),
    "macro-doubling": ("{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('ab') }}", "'~'"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recurse too deep"),
    "output": ("{% for i in range(1000) %}{{ 'x' * 100000 }}{% endfor %}", "rendered text"),
    "block-set": (
        "{% set s %}{% for i in range(1000) %}{{ 'x' * 100000 }}{% endfor %}"
        "{% endset %}{{ s|length }}",
        "rendered text",
    ),
    "replace": ("{{ ('x' * 10**6)|replace('', 'y' * 1000) }}", "filter 'replace'"),
    "lipsum": ("{{ lipsum(10**7) }}", "lipsum"),
}


@pytest.mark.parametrize("template, words", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_template_stops_quickly_with_one_line(template, words):
    started = time.monotonic()
    with pytest.raises(TemplateBudgetError) as error:
        render(template, MESSAGES)
    assert time.monotonic() - started < 5
    message = str(error.value)
    assert message.startswith("chat template stopped: ") and "\n" not in message
    assert words in message, message


@pytest.mark.parametrize("key", ["nested-range", "recursion"])
def test_render_chat_stops_too(key):
    with pytest.raises(TemplateBudgetError):
        render_chat(HOSTILE[key][0], MESSAGES, end_tokens=["x"])


def test_plain_jinja_would_run_the_nested_loops_for_ever():
    """The nested-range template is live: plain jinja2's sandbox runs it far past our budget
    (counted here on a bounded generator, not run to the end)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment()
    steps = 0
    template = "{% for i in range(100000) %}{% for j in range(100000) %}.{% endfor %}{% endfor %}"
    for _ in env.from_string(template).generate():
        steps += 1
        if steps > MAX_RENDER_STEPS:
            break
    assert steps > MAX_RENDER_STEPS


def test_within_the_budget_renders_as_before():
    assert render("{% for i in range(1000) %}{{ i % 10 }}{% endfor %}", MESSAGES) == (
        "0123456789" * 100
    )
    assert render("{{ messages|tojson(indent=2) }}", MESSAGES) == json.dumps(MESSAGES, indent=2)
    assert render("{{ 'ab' * 3 }}{{ 'x'|center(5) }}{{ 2 ** 10 }}", MESSAGES) == "ababab  x  1024"
    assert len(render("{{ 'x' * 1000000 }}", MESSAGES)) == 10**6
    assert MAX_RENDER_CHARS >= 2**26


def test_each_render_has_its_own_budget():
    template = "{% for i in range(300000) %}{% endfor %}ok"  # 60% of one budget (range + loop)
    for _ in range(3):
        assert render(template, MESSAGES) == "ok"


@pytest.mark.parametrize("layout", ["chat_template.jinja", "tokenizer_config.json"])
def test_the_tokenizer_error_names_the_template_file(tmp_path, layout):
    folder = make_tokenizer_folder(
        tmp_path / "tok",
        chat_template=HOSTILE["nested-range"][0],
        template_file=layout == "chat_template.jinja",
    )
    tok = Tokenizer.from_pretrained(folder)
    for call in (tok.apply_chat_template, tok.tokenize_conversation):
        with pytest.raises(TemplateBudgetError) as error:
            call(MESSAGES)
        assert str(error.value).startswith(f"{folder / layout}: chat template stopped: ")


def test_a_chosen_template_file_is_named(tmp_path):
    folder = make_tokenizer_folder(tmp_path / "tok")
    chosen = tmp_path / "mine.jinja"
    chosen.write_text(HOSTILE["recursion"][0])
    tok = Tokenizer.from_pretrained(folder, chat_template=chosen)
    with pytest.raises(TemplateBudgetError, match=rf"^{chosen}: chat template stopped"):
        tok.apply_chat_template(MESSAGES)
    shipped = Tokenizer.from_pretrained(folder, chat_template="qwen2_5")
    assert shipped.apply_chat_template(MESSAGES) == render(load_template("qwen2_5"), MESSAGES)
