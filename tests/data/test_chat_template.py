"""Chat templates: our ids == transformers' apply_chat_template, and the assistant mask.

Every conversation below is rendered and tokenized by tunesmith and by ``transformers`` from
the same tiny tokenizer folder (see ``tokenizer_factory``). The assistant mask is checked
against replies written out by hand here, and against transformers'
``return_assistant_tokens_mask`` on copies of the templates with ``{% generation %}`` tags.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
import pytest
import transformers
from transformers.utils.chat_template_utils import render_jinja_template

from tests.data.tokenizer_factory import CHAT_FAMILIES, make_tokenizer_folder
from tunesmith.data.chat_template import (
    TEMPLATE_NAMES,
    has_generation_tags,
    load_template,
    normalize_messages,
    render,
    render_chat,
)
from tunesmith.data.tokenizer import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def call(name: str, arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str | None, **fields: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": text, **fields}


def system(text: str, **fields: Any) -> dict[str, Any]:
    return {"role": "system", "content": text, **fields}


# Which families' formats can express what (a case outside a format lists the others only).
TOOL_CALLS = ("llama3", "qwen2_5", "qwen3")  # assistant tool calls and tool results
TOOL_LISTS = (*TOOL_CALLS, "phi4")  # tool schemas in the prompt
FREE_ORDER = tuple(f for f in CHAT_FAMILIES if f != "gemma")  # Gemma: user/model alternate


@dataclass
class Case:
    name: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)
    families: tuple[str, ...] = CHAT_FAMILIES
    qwen3_replies: list[str] | None = None  # hand-written when the generic rule does not apply


EMPTY_THINK = "<think>\n\n</think>\n\n"

CASES = [
    Case("single_turn", [user("What is 2 + 3?"), assistant("2 + 3 = 5.")]),
    Case(
        "multi_turn",
        [
            user("Hi there"),
            assistant("Hello! How can I help?"),
            user("Count to three."),
            assistant("One, two, three."),
        ],
    ),
    Case(
        "system_prompt",
        [
            {"role": "system", "content": "You are terse."},
            user("Capital of France?"),
            assistant("Paris."),
        ],
    ),
    Case("generation_prompt", [user("Say hi.")], add_generation_prompt=True),
    Case(
        "generation_prompt_after_history",
        [{"role": "system", "content": "Be kind."}, user("Hi"), assistant("Hey!"), user("Bye")],
        add_generation_prompt=True,
    ),
    Case(
        "unicode", [user("Grüße aus Köln 🌍 — 日本語は？"), assistant("Ça va très bien ✓ — 谢谢！")]
    ),
    Case("whitespace", [user("  padded question  \n"), assistant("\n line one\n\nline two  ")]),
    Case("empty_reply", [user("Say nothing."), assistant("")]),
    Case(
        "assistant_speaks_first",
        [assistant("Welcome!"), user("Hi"), assistant("Hello.")],
        families=FREE_ORDER,
    ),
    Case(
        "consecutive_replies",
        [user("Hi"), assistant("One."), assistant("Two.")],
        families=FREE_ORDER,
    ),
    Case(
        "system_multi_turn",
        [
            system("Answer in one line."),
            user("First question?"),
            assistant("First answer."),
            user("Second question?"),
            assistant("Second answer."),
            user("Third?"),
            assistant("Third answer."),
        ],
    ),
    Case(
        "multiline_reply",
        [
            user("Show code."),
            assistant("Here:\n\n```python\nprint('hi')\n```\n\n- one\n- two\n"),
            user("Thanks"),
        ],
        add_generation_prompt=True,
    ),
    Case(
        "tools_listed",
        [
            {"role": "system", "content": "Use tools when useful."},
            user("Weather in Paris?"),
            assistant("I cannot check right now."),
        ],
        tools=[WEATHER, ADD],
        families=TOOL_LISTS,
    ),
    Case(
        "tools_no_system",
        [user("Add 2 and 40."), assistant("42")],
        tools=[ADD],
        families=TOOL_LISTS,
    ),
    Case(
        "tool_call_and_result",
        [
            user("Weather in Paris?"),
            assistant("", tool_calls=[call("get_weather", {"city": "Paris", "unit": "C"})]),
            {"role": "tool", "content": "18 degrees, sunny"},
            assistant("It is 18°C and sunny in Paris."),
        ],
        tools=[WEATHER],
        families=TOOL_CALLS,
    ),
    Case(
        "tool_result_then_prompt",
        [
            {"role": "system", "content": "Helper."},
            user("Add 1 and 2"),
            assistant(None, tool_calls=[call("add", {"a": 1, "b": 2})]),
            {"role": "tool", "content": "3"},
        ],
        tools=[ADD],
        add_generation_prompt=True,
        families=TOOL_CALLS,
    ),
    Case(
        "parallel_tool_calls",
        [
            user("Weather in Paris and Rome?"),
            assistant(
                "Checking both.",
                tool_calls=[
                    call("get_weather", {"city": "Paris"}),
                    call("get_weather", {"city": "Rome"}),
                ],
            ),
            {"role": "tool", "content": "18C"},
            {"role": "tool", "content": "25C"},
            assistant("Paris 18C, Rome 25C."),
        ],
        tools=[WEATHER],
        families=("qwen2_5", "qwen3"),
    ),
    Case(
        "json_string_arguments",
        [
            user("Add 5 and 6"),
            assistant(None, tool_calls=[call("add", '{"a": 5, "b": 6}')]),
            {"role": "tool", "content": "11"},
            assistant("11"),
        ],
        tools=[ADD],
        families=("qwen2_5", "qwen3"),
    ),
    Case(
        "llama_tools_in_system",
        [
            {"role": "system", "content": "Sys"},
            user("Weather in Oslo?"),
            assistant(None, tool_calls=[call("get_weather", {"city": "Oslo"})]),
            {"role": "ipython", "content": "-3C"},
            assistant("It is -3C."),
        ],
        tools=[WEATHER],
        kwargs={"tools_in_user_message": False},
        families=("llama3",),
    ),
    Case(
        "llama_date_and_builtin_tool",
        [
            user("Search cats"),
            assistant(None, tool_calls=[call("brave_search", {"query": "cats"})]),
            {"role": "ipython", "content": "cats are mammals"},
            assistant("Cats are mammals."),
        ],
        kwargs={
            "builtin_tools": ["brave_search", "code_interpreter"],
            "date_string": "01 Jan 2025",
        },
        families=("llama3",),
    ),
    Case(
        "reasoning_in_history",
        [
            user("2+2?"),
            assistant("4", reasoning_content="Two plus two is four."),
            user("3+3?"),
            assistant("6", reasoning_content="Three plus three."),
        ],
        families=("qwen3",),
        qwen3_replies=["4<|im_end|>", "<think>\nThree plus three.\n</think>\n\n6<|im_end|>"],
    ),
    Case(
        "think_inline_and_reasoning_alias",
        [
            user("Hi"),
            assistant("<think>\nGreet back.\n</think>\n\nHello!"),
            user("Again"),
            assistant("Hello again!", reasoning="Once more."),
        ],
        families=("qwen3",),
        qwen3_replies=[
            "Hello!<|im_end|>",
            "<think>\nOnce more.\n</think>\n\nHello again!<|im_end|>",
        ],
    ),
    Case(
        "thinking_disabled",
        [user("Hi"), assistant("Hello."), user("Bye"), assistant("Goodbye.")],
        kwargs={"enable_thinking": False},
        families=("qwen3",),
        qwen3_replies=["Hello.<|im_end|>", "Goodbye.<|im_end|>"],
    ),
    Case(
        "thinking_disabled_with_reasoning",
        [user("Hi"), assistant("Hello.", reasoning_content="Be brief.")],
        kwargs={"enable_thinking": False},
        families=("qwen3",),
        qwen3_replies=["<think>\nBe brief.\n</think>\n\nHello.<|im_end|>"],
    ),
    Case(
        "thinking_disabled_prompt",
        [user("Hi")],
        add_generation_prompt=True,
        kwargs={"enable_thinking": False},
        families=("qwen3",),
        qwen3_replies=[],
    ),
    Case(
        # Multi-step tool use, then a new question: the template drops the reasoning of the
        # earlier steps, so rendering a prefix of the conversation is not a prefix of the text.
        "agent_steps_then_new_query",
        [
            user("Weather in Paris?"),
            assistant(
                "",
                reasoning_content="Need the tool.",
                tool_calls=[call("get_weather", {"city": "Paris"})],
            ),
            {"role": "tool", "content": "18C"},
            assistant("18C in Paris.", reasoning_content="Report it."),
            user("Thanks!"),
            assistant("You're welcome.", reasoning_content="Be polite."),
        ],
        tools=[WEATHER],
        families=("qwen3",),
        qwen3_replies=[
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
            "18C in Paris.<|im_end|>",
            "<think>\nBe polite.\n</think>\n\nYou're welcome.<|im_end|>",
        ],
    ),
    Case(
        "agent_steps_open",
        [
            user("Weather in Rome?"),
            assistant(
                "Let me check.",
                reasoning_content="Use tool.",
                tool_calls=[call("get_weather", {"city": "Rome"})],
            ),
            {"role": "tool", "content": "25C"},
            assistant("25C in Rome.", reasoning_content="Done."),
        ],
        tools=[WEATHER],
        families=("qwen3",),
        qwen3_replies=[
            "<think>\nUse tool.\n</think>\n\nLet me check.\n"
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>',
            "<think>\nDone.\n</think>\n\n25C in Rome.<|im_end|>",
        ],
    ),
    Case(
        # Gemma 3's content parts: text parts trimmed, an image part as <start_of_image>; the
        # system text (from its first part) opens the first user turn.
        "gemma_content_parts",
        [
            {"role": "system", "content": [{"type": "text", "text": "Describe briefly."}]},
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": " What is this? "}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "A cat.\n"}]},
        ],
        families=("gemma",),
    ),
    Case(
        # Microsoft's way: the system message carries its tools as a JSON string.
        "phi4_tools_in_system_message",
        [
            system("Use tools.", tools=json.dumps([WEATHER["function"]])),
            user("Weather in Oslo?"),
            assistant("Let me check."),
        ],
        families=("phi4",),
    ),
]


def family_cases(family: str) -> list[Case]:
    return [case for case in CASES if family in case.families]


def all_cases() -> list[Any]:
    return [
        pytest.param(family, case, id=f"{family}-{case.name}")
        for family in CHAT_FAMILIES
        for case in family_cases(family)
    ]


def test_enough_cases_per_family() -> None:
    for family in CHAT_FAMILIES:
        assert len(family_cases(family)) >= 10, family


def expected_replies(family: str, case: Case) -> list[str]:
    """The text of each assistant reply, written from the messages with the family's format."""
    if family == "qwen3" and case.qwen3_replies is not None:
        return case.qwen3_replies
    replies = []
    replies_to = [m for m in case.messages if m["role"] == "assistant"]
    if family in ("gemma", "phi4", "olmo2"):  # no tool calls; the content, then the end token
        for message in replies_to:
            content = message["content"]
            if family == "gemma":  # trimmed, text parts too
                parts = (
                    content if isinstance(content, list) else [{"type": "text", "text": content}]
                )
                content = "".join(p["text"].strip() for p in parts if p["type"] == "text")
            end = {"gemma": "<end_of_turn>", "phi4": "<|end|>", "olmo2": "<|endoftext|>"}[family]
            replies.append(content + end)
        return replies
    for k, message in enumerate(replies_to):
        content = message.get("content") or ""
        calls = [c["function"] for c in message.get("tool_calls", [])]
        if family == "llama3":
            if not calls:
                replies.append(content.strip() + "<|eot_id|>")
            elif "builtin_tools" in case.kwargs:
                args = ", ".join(f'{k}="{v}"' for k, v in calls[0]["arguments"].items())
                replies.append(f"<|python_tag|>{calls[0]['name']}.call({args})<|eom_id|>")
            else:
                arguments = json.dumps(calls[0]["arguments"])
                replies.append(
                    f'{{"name": "{calls[0]["name"]}", "parameters": {arguments}}}<|eot_id|>'
                )
            continue
        # Qwen3 gives the final reply (after the last question) a <think> block, empty here,
        # and strips leading newlines off the content after it.
        think = family == "qwen3" and k == len(replies_to) - 1 and case.messages[-1] is message
        if think:
            content = content.lstrip("\n")
        parts = [content] if content else []
        for c in calls:
            raw = c["arguments"]
            arguments = raw if family == "qwen3" and isinstance(raw, str) else json.dumps(raw)
            parts.append(
                f'<tool_call>\n{{"name": "{c["name"]}", "arguments": {arguments}}}\n</tool_call>'
            )
        replies.append((EMPTY_THINK if think else "") + "\n".join(parts) + "<|im_end|>")
    return replies


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Tokenizer, Any]]:
    out = {}
    for family in CHAT_FAMILIES:
        folder = make_tokenizer_folder(tmp_path_factory.mktemp(family), family)
        out[family] = (
            Tokenizer.from_pretrained(folder),
            transformers.AutoTokenizer.from_pretrained(folder),
        )
    return out


def hf_ids(out: Any) -> list[int]:
    """transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x a list."""
    ids = out if isinstance(out, list) else out["input_ids"]
    return [int(i) for i in ids]


@pytest.mark.parametrize("family, case", all_cases())
def test_ids_and_text_match_transformers(tokenizers: dict, family: str, case: Case) -> None:
    ours, hf = tokenizers[family]
    common = dict(tools=case.tools, add_generation_prompt=case.add_generation_prompt, **case.kwargs)
    expected = hf_ids(hf.apply_chat_template(case.messages, tokenize=True, **common))
    ids, mask = ours.tokenize_conversation(case.messages, **common)
    assert ids == expected
    assert len(mask) == len(ids)
    assert ours.apply_chat_template(case.messages, **common) == hf.apply_chat_template(
        case.messages, tokenize=False, **common
    )


@pytest.mark.parametrize("family, case", all_cases())
def test_mask_covers_exactly_the_replies(tokenizers: dict, family: str, case: Case) -> None:
    ours, _ = tokenizers[family]
    common = dict(tools=case.tools, add_generation_prompt=case.add_generation_prompt, **case.kwargs)
    replies = expected_replies(family, case)

    # Character level: the located replies are exactly the hand-written ones.
    chat = render_chat(
        ours.chat_template,
        case.messages,
        control_tokens=ours.added_tokens,
        end_tokens=[ours.id_to_token(i) for i in ours.stop_token_ids],
        **{**ours.special_tokens, **common},
    )
    assert [chat.text[s:e] for s, e in chat.assistant_spans] == replies

    # Token level: the mask is the union of the reply spans, and each span decodes to its
    # reply (a token that straddles the header/reply boundary brings header whitespace along).
    ids, mask, spans = ours.tokenize_conversation(case.messages, return_spans=True, **common)
    assert len(spans) == len(replies)
    in_spans = [0] * len(ids)
    for (start, end), reply in zip(spans, replies):
        in_spans[start:end] = [1] * (end - start)
        text = ours.decode(ids[start:end])
        assert text.endswith(reply) and not text[: len(text) - len(reply)].strip(), (text, reply)
    assert mask == in_spans


def _swap(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, f"template fragment not found once: {old!r}"
    return source.replace(old, new)


def tagged_template(family: str) -> str:
    """The shipped template with ``{% generation %}`` around each reply (after the header,
    through the end-of-turn token); it renders the same text."""
    s = load_template(family)
    if family == "llama3":
        s = _swap(
            s,
            "        {{- header('assistant') }}\n        {%- if builtin_tools is defined and call.name",
            "        {{- header('assistant') }}\n        {%- generation %}\n"
            "        {%- if builtin_tools is defined and call.name",
        )
        s = _swap(
            s,
            "        {{- '<|eom_id|>' if builtin_tools is defined else '<|eot_id|>' }}\n",
            "        {{- '<|eom_id|>' if builtin_tools is defined else '<|eot_id|>' }}\n"
            "        {%- endgeneration %}\n",
        )
        s = _swap(
            s,
            "        {{- header(message['role']) + (message['content'] | trim) + '<|eot_id|>' }}\n",
            "        {{- header(message['role']) }}\n"
            "        {%- if message.role == 'assistant' %}\n"
            "            {%- generation %}{{- (message['content'] | trim) + '<|eot_id|>' }}"
            "{%- endgeneration %}\n"
            "        {%- else %}\n"
            "            {{- (message['content'] | trim) + '<|eot_id|>' }}\n"
            "        {%- endif %}\n",
        )
    elif family == "qwen2_5":
        s = _swap(
            s,
            "        {{- '<|im_start|>assistant' }}\n"
            "        {%- if message.content %}\n"
            "            {{- '\\n' + message.content }}\n"
            "        {%- endif %}\n"
            "        {%- for call in message.tool_calls %}\n"
            "            {%- set call = call.function if call.function is defined else call %}\n"
            "            {{- '\\n<tool_call>",
            "        {{- '<|im_start|>assistant\\n' }}\n"
            "        {%- generation %}\n"
            "        {{- message.content or '' }}\n"
            "        {%- for call in message.tool_calls %}\n"
            "            {%- set call = call.function if call.function is defined else call %}\n"
            "            {%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}\n"
            "            {{- '<tool_call>",
        )
        s = _swap(
            s,
            "        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n",
            "        {%- endfor %}\n        {{- '<|im_end|>' }}\n        {%- endgeneration %}\n"
            "        {{- '\\n' }}\n",
        )
        s = _swap(
            s,
            "    {%- elif message.role in ['user', 'assistant'] %}",
            "    {%- elif message.role == 'assistant' %}\n"
            "        {{- '<|im_start|>assistant\\n' }}\n"
            "        {%- generation %}{{- message.content + '<|im_end|>' }}{%- endgeneration %}\n"
            "        {{- '\\n' }}\n"
            "    {%- elif message.role == 'user' %}",
        )
    elif family == "qwen3":
        s = _swap(
            s,
            "        {{- '<|im_start|>assistant\\n' }}\n        {%- if loop.index0 > state.last_query",
            "        {{- '<|im_start|>assistant\\n' }}\n        {%- generation %}\n"
            "        {%- if loop.index0 > state.last_query",
        )
        s = _swap(
            s,
            "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == 'tool' %}",
            "        {{- '<|im_end|>' }}\n        {%- endgeneration %}\n        {{- '\\n' }}\n"
            "    {%- elif message.role == 'tool' %}",
        )
    elif family == "gemma":
        s = _swap(
            s,
            "    {{- state.text + '<end_of_turn>\\n' }}\n",
            "    {%- if role == 'model' %}\n"
            "        {%- generation %}{{- state.text + '<end_of_turn>' }}{%- endgeneration %}\n"
            "        {{- '\\n' }}\n"
            "    {%- else %}\n"
            "        {{- state.text + '<end_of_turn>\\n' }}\n"
            "    {%- endif %}\n",
        )
    elif family == "phi4":
        s = _swap(
            s,
            "        {{- message.content + '<|end|>' }}\n",
            "        {%- generation %}{{- message.content + '<|end|>' }}{%- endgeneration %}\n",
        )
    elif family == "olmo2":
        s = _swap(
            s,
            "        {{- message.content + eos_token }}\n",
            "        {%- generation %}{{- message.content + eos_token }}{%- endgeneration %}\n",
        )
    assert has_generation_tags(s)
    return s


@pytest.mark.parametrize("family, case", all_cases())
def test_mask_matches_transformers_generation_tags(
    tokenizers: dict, family: str, case: Case
) -> None:
    ours, hf = tokenizers[family]
    tagged = tagged_template(family)
    ours_tagged = Tokenizer(ours.backend, special_tokens=ours.special_tokens, chat_template=tagged)
    common = dict(tools=case.tools, add_generation_prompt=case.add_generation_prompt, **case.kwargs)
    out = hf.apply_chat_template(
        case.messages,
        chat_template=tagged,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        **common,
    )
    ids, mask = ours.tokenize_conversation(case.messages, **common)
    tagged_ids, tagged_mask = ours_tagged.tokenize_conversation(case.messages, **common)
    assert hf_ids(out) == ids == tagged_ids  # the tags do not change the text
    assert tagged_mask == list(out["assistant_masks"])  # our {% generation %} == transformers'
    if case.kwargs.get("enable_thinking") is not False or case.add_generation_prompt:
        # Without tags we find the same replies. (With enable_thinking=False the generation
        # prompt holds the empty <think> block, which we leave out of the reply; the tagged
        # copy keeps it, see test_mask_covers_exactly_the_replies.)
        assert mask == list(out["assistant_masks"])


def test_last_turn_span(tokenizers: dict) -> None:
    ours, _ = tokenizers["qwen2_5"]
    messages = [user("Hi"), assistant("Hello!"), user("Bye"), assistant("Goodbye!")]
    ids, mask, spans = ours.tokenize_conversation(messages, return_spans=True)
    start, end = spans[-1]
    assert ours.decode(ids[start:end]) == "Goodbye!<|im_end|>"
    assert sum(mask) == (spans[0][1] - spans[0][0]) + (end - start)


# ---------------------------------------------------------------------------------------------
# The Jinja environment behaves like transformers'


def hf_render(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    rendered, _ = render_jinja_template([messages], chat_template=template, **kwargs)
    return rendered[0]


ENV_TEMPLATES = {
    "tojson": "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}|"
    "{{ {'b': 1, 'a': '<&>é'} | tojson }}",
    "trim_blocks": "{% for m in messages %}\n  {% if m.role == 'user' %}\n{{ m.content }}\n  {% endif %}\n{% endfor %}",
    "loop_controls": "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
    "{{ m.content }}{% continue %}X{% endfor %}",
    "namespace_and_dict": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% endfor %}{{ ns.n }}{{ dict(a=1) | tojson }}",
    "defaults": "{{ bos_token }}{% if tools is none %}no tools{% endif %}{{ add_generation_prompt }}",
    "generation": "{% for m in messages %}{{ m.role }}:{% generation %}{{ m.content }}{% endgeneration %};{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(ENV_TEMPLATES))
def test_environment_matches_transformers(name: str) -> None:
    messages = [user("Grüße <b>&</b>"), assistant("ok", weird_key="é")]
    template = ENV_TEMPLATES[name]
    assert render(template, messages, bos_token="<s>") == hf_render(
        template, normalize_messages(messages), bos_token="<s>"
    )


def test_tojson_keeps_text_and_key_order() -> None:
    assert render("{{ {'b': 1, 'a': 'é<'} | tojson }}", [user("x")]) == '{"b": 1, "a": "é<"}'


def test_raise_exception_and_strftime_now() -> None:
    with pytest.raises(jinja2.TemplateError, match="only user turns"):
        render("{{ raise_exception('only user turns') }}", [user("x")])
    assert render("{{ strftime_now('%Y') }}", [user("x")]) == str(datetime.now().year)


def test_sandbox_refuses_underscore_namespace_attributes() -> None:
    with pytest.raises(jinja2.exceptions.SecurityError):
        render("{% set ns = namespace(_secret=1) %}", [user("x")])


def test_generation_tag_spans() -> None:
    template = ENV_TEMPLATES["generation"]
    chat = render_chat(template, [user("ab"), assistant("cde")])
    assert chat.text == "user:ab;assistant:cde;"
    assert [chat.text[s:e] for s, e in chat.assistant_spans] == ["ab", "cde"]


def test_normalize_messages_like_transformers() -> None:
    messages = [
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": "4", "thinking": "2+2", "tool_calls": None},
    ]
    assert normalize_messages(messages) == [
        {"role": "user", "content": "hi"},
        {"thinking": "2+2", "role": "assistant", "content": "4", "reasoning_content": "2+2"},
    ]
    with pytest.raises(TypeError, match=r"messages\[1\]"):
        normalize_messages([user("x"), "not a dict"])
    with pytest.raises(TypeError, match=r"messages\[0\]\['content'\]"):
        normalize_messages([{"role": "user", "content": object()}])


def test_shipped_templates() -> None:
    assert TEMPLATE_NAMES == ("gemma", "llama3", "olmo2", "phi4", "qwen2_5", "qwen3")
    for name in TEMPLATE_NAMES:
        assert not has_generation_tags(load_template(name))
    with pytest.raises(FileNotFoundError, match="neither a shipped template"):
        load_template("no_such_template")


# The Gemma, Phi-4-mini and OLMo 2 formats written out by hand (the tests above compare our
# tokens with transformers' on the same template; these pin the template's text itself).
FORMAT_CONVERSATION = [system("Be brief."), user("Hi"), assistant("Hello!"), user("Bye")]
FORMAT_TEXTS = {  # family: (the conversation with a generation prompt, its first three messages)
    "gemma": (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n",
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n",
    ),
    "phi4": (
        "<|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>Hello!<|end|>"
        "<|user|>Bye<|end|><|assistant|>",
        "<|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>Hello!<|end|>",
    ),
    "olmo2": (  # the last message, when it is a reply, has no newline after its EOS
        "<|endoftext|><|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello!<|endoftext|>\n"
        "<|user|>\nBye\n<|assistant|>\n",
        "<|endoftext|><|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello!<|endoftext|>",
    ),
}


@pytest.mark.parametrize("family", sorted(FORMAT_TEXTS))
def test_added_formats_render_the_documented_text(tokenizers: dict, family: str) -> None:
    ours, _ = tokenizers[family]
    with_prompt, first_three = FORMAT_TEXTS[family]
    assert ours.apply_chat_template(FORMAT_CONVERSATION, add_generation_prompt=True) == with_prompt
    assert ours.apply_chat_template(FORMAT_CONVERSATION[:3]) == first_three


def test_phi4_writes_tools_in_the_system_turn(tokenizers: dict) -> None:
    ours, hf = tokenizers["phi4"]
    listed = json.dumps([WEATHER["function"], ADD["function"]])
    for messages, tools, expected in [
        # the tools given to the template: their function objects, after the system content
        (
            [system("Sys"), user("Hi")],
            [WEATHER, ADD],
            f"<|system|>Sys<|tool|>{listed}<|/tool|><|end|>",
        ),
        # no system message: a system turn of their own
        ([user("Hi")], [WEATHER, ADD], f"<|system|><|tool|>{listed}<|/tool|><|end|>"),
        # the system message's own tools (a JSON string, as is) win over the template's
        (
            [system("Sys", tools="[1]"), user("Hi")],
            [ADD],
            "<|system|>Sys<|tool|>[1]<|/tool|><|end|>",
        ),
    ]:
        text = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        assert text == expected + "<|user|>Hi<|end|><|assistant|>"
        assert text == hf.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )


TOOL_CALL_REPLY = [user("Add 1 and 2"), assistant("", tool_calls=[call("add", {"a": 1, "b": 2})])]


@pytest.mark.parametrize(
    "family, messages, match",
    [
        ("gemma", [assistant("Hi"), user("Hello")], r"roles must alternate.*messages\[0\]"),
        ("gemma", [system("S"), user("a"), user("b")], r"roles must alternate.*messages\[2\]"),
        ("gemma", TOOL_CALL_REPLY, "no tool calls"),
        ("phi4", TOOL_CALL_REPLY, "no tool calls"),
        ("olmo2", TOOL_CALL_REPLY, "no tool calls"),
        ("olmo2", [user("a"), {"role": "tool", "content": "3"}], "only system, user and assistant"),
    ],
)
def test_added_formats_refuse_what_they_cannot_write(
    tokenizers: dict, family: str, messages: list[dict[str, Any]], match: str
) -> None:
    ours, hf = tokenizers[family]
    with pytest.raises(jinja2.TemplateError, match=match):
        ours.tokenize_conversation(messages)
    with pytest.raises(jinja2.TemplateError, match=match):
        hf.apply_chat_template(messages, tokenize=False)


def test_template_without_generation_prompt_is_an_error() -> None:
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}<|end|>{% endfor %}"
    with pytest.raises(ValueError, match="generation"):
        render_chat(template, [user("a"), assistant("b")], end_tokens=["<|end|>"])


def test_turn_without_end_token_is_an_error() -> None:
    # Only user turns are closed: the first end token after the reply is the next user's,
    # which must not be taken as the end of the reply.
    template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
        "{% if m.role == 'user' %}<|end|>{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    messages = [user("a"), assistant("b"), user("c")]
    with pytest.raises(ValueError, match="not closed by an end-of-turn token"):
        render_chat(template, messages, end_tokens=["<|end|>"])
    with pytest.raises(ValueError, match="not closed by an end-of-turn token"):
        render_chat(template, messages[:2], end_tokens=["<|end|>"])
    # With every turn closed, the reply stops at its own end token.
    closed = template.replace("{% if m.role == 'user' %}<|end|>{% endif %}", "<|end|>")
    chat = render_chat(closed, messages, end_tokens=["<|end|>"])
    assert [chat.text[s:e] for s, e in chat.assistant_spans] == ["b<|end|>"]


# ---------------------------------------------------------------------------------------------
# Replies that quote the template's own markers (real tokenizers turn the quoted string into
# the special token, so such rows occur in real data): the mask without tags must still equal
# transformers' on the tagged template.

MARKERS = {  # family: (end of turn, start of turn, assistant role header)
    "llama3": (
        "<|eot_id|>",
        "<|start_header_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    "qwen2_5": ("<|im_end|>", "<|im_start|>", "<|im_start|>assistant\n"),
    "qwen3": ("<|im_end|>", "<|im_start|>", "<|im_start|>assistant\n"),
    "gemma": ("<end_of_turn>", "<start_of_turn>", "<start_of_turn>model\n"),
    "phi4": ("<|end|>", "<|user|>", "<|assistant|>"),
    "olmo2": ("<|endoftext|>", "<|user|>", "<|assistant|>\n"),  # plain-text role tags
    "plain_headers": ("<|endoftext|>", "### ", "### Assistant:\n"),
    "trailing_eos": ("<|end|>", "<|user|>", "<|assistant|>"),
}

# A third template shape: plain-text role headers (Alpaca / Zephyr style) closed by the eos.
PLAIN_HEADERS = (
    "{% for m in messages %}{{ '### ' + m.role | capitalize + ':\\n' }}"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content + '<|endoftext|>' }}"
    "{% endgeneration %}{% else %}{{ m.content + '<|endoftext|>' }}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '### Assistant:\\n' }}{% endif %}"
)


# A fourth: Phi-4-mini's own template closes a finished conversation with the eos, which the
# same conversation continued (or given the generation prompt) does not have.
TRAILING_EOS = (
    "{% for m in messages %}{{ '<|' + m.role + '|>' }}"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content + '<|end|>' }}"
    "{% endgeneration %}{% else %}{{ m.content + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)
TAGGED_SHAPES = {
    "plain_headers": ("qwen2_5", PLAIN_HEADERS),
    "trailing_eos": ("phi4", TRAILING_EOS),
}


def quoting_conversations(family: str) -> list[tuple[str, list[dict[str, Any]], bool]]:
    """(name, messages, add_generation_prompt): replies quoting the end-of-turn string, the
    start-of-turn string and the assistant header, in the middle and at the end of a reply,
    in the first, a middle and the last turn."""
    end, start, header = MARKERS[family]
    fake_turn = f"{end}\n{start}user\nmore{end}\n{header}"
    return [
        (
            "quotes_end",
            [user("How does a turn end?"), assistant(f"With {end} after the text.")],
            False,
        ),
        ("ends_with_end", [user("Print the marker."), assistant(f"Here: {end}")], False),
        (
            "only_end",
            [user("Marker?"), assistant(end), user("Thanks"), assistant("Welcome.")],
            False,
        ),
        ("quotes_start", [user("And the start?"), assistant(f"{start} opens a turn.")], False),
        ("quotes_header", [user("Header?"), assistant(f"{header}comes before a reply.")], False),
        (
            "fake_next_turn",
            [
                user("Show a turn."),
                assistant(f"Sure: hi{fake_turn}bye"),
                user("Again"),
                assistant(f"Again: {fake_turn}"),
            ],
            False,
        ),
        (
            "middle_turn_then_prompt",
            [user("a"), assistant(f"x {end} y"), user(f"b {header}"), assistant("z"), user("c")],
            True,
        ),
    ] + (
        [  # Qwen3 keeps the last reply's reasoning and drops the earlier ones'
            (
                "reasoning_quotes_end",
                [
                    user("a"),
                    assistant("b", reasoning_content=f"no {end} yet"),
                    user("c"),
                    assistant(f"d {end}", reasoning_content=f"then {header}"),
                ],
                False,
            ),
        ]
        if family == "qwen3"
        else []
    )


def quoting_cases() -> list[Any]:
    return [
        pytest.param(family, name, messages, prompt, id=f"{family}-{name}")
        for family in MARKERS
        for name, messages, prompt in quoting_conversations(family)
    ]


def _tokenizer_pair(tokenizers: dict, family: str) -> tuple[Tokenizer, Any, str]:
    """Ours without tags, transformers', and the tagged template, for ``family``."""
    if family not in TAGGED_SHAPES:
        ours, hf = tokenizers[family]
        return ours, hf, tagged_template(family)
    base, tagged = TAGGED_SHAPES[family]
    ours, hf = tokenizers[base]
    untagged = tagged.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    plain = Tokenizer(ours.backend, special_tokens=ours.special_tokens, chat_template=untagged)
    return plain, hf, tagged


@pytest.mark.parametrize("family, name, messages, prompt", quoting_cases())
def test_mask_of_replies_quoting_the_markers_matches_transformers(
    tokenizers: dict, family: str, name: str, messages: list[dict[str, Any]], prompt: bool
) -> None:
    ours, hf, tagged = _tokenizer_pair(tokenizers, family)
    out = hf.apply_chat_template(
        messages,
        chat_template=tagged,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        add_generation_prompt=prompt,
    )
    ids, mask = ours.tokenize_conversation(messages, add_generation_prompt=prompt)
    assert ids == hf_ids(out)
    end = MARKERS[family][0]
    if any(end in m["content"] for m in messages):  # the quoted marker is the special token
        assert ids.count(ours.token_to_id(end)) == ours.decode(ids).count(end)
    assert mask == list(out["assistant_masks"])
