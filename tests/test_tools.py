"""Tool calling's text layer (`loopserve.text.tools`): call blocks read from whole and
streamed output, the history and tools rendered for templates that read tools and for
those that do not, and the grammar that enforces a call."""

from __future__ import annotations

import json
import random

import pytest

from loopserve.errors import InvalidRequestError
from loopserve.text.tools import (
    JSON_SAFE_INTEGER,
    PARSERS,
    ToolCallStream,
    call_grammar,
    closed,
    render,
    template_reads_tools,
)

NAMES = ("get_weather", "add")
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
]  # fmt: skip
OUTPUT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
)


def _history() -> list[dict]:
    """A call, its tool's answer (a fresh copy: a test may change it)."""
    return [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]  # fmt: skip


def test_call_blocks_become_calls_and_the_rest_content():
    content, calls = PARSERS["hermes"].parse(OUTPUT, NAMES)
    assert content == "Let me check.\n\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("add", {"a": 1, "b": 2}),
    ]
    only_calls = OUTPUT.removeprefix("Let me check.\n")
    assert PARSERS["hermes"].parse(only_calls, NAMES)[0] is None  # OpenAI's null content
    # Not a call: unknown function, not JSON, arguments not an object; an unclosed block.
    for text in (
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        "<tool_call>{name: add}</tool_call>",
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": 1',
    ):
        assert PARSERS["hermes"].parse(text, NAMES) == (text, []), text
    # Arguments given as JSON text are kept as they are.
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert PARSERS["hermes"].parse(text, NAMES)[1][0].arguments == '{"a": 1}'


@pytest.mark.parametrize("seed", range(20))
def test_streamed_output_cut_anywhere_gives_the_whole_outputs_split(seed):
    """Deltas cut at random places (tags included) give the same content and calls as the
    whole output, and no call before its block closes."""
    rng = random.Random(seed)
    text = OUTPUT + " trailing <tool_ca" if seed % 2 else OUTPUT
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream = ToolCallStream(NAMES)
    content, calls = "", []
    for piece in pieces:
        more, new = stream.feed(piece)
        content, calls = content + more, calls + new
        assert len(calls) <= content.count("\n") + 2
    rest, _ = stream.finish()
    whole = PARSERS["hermes"].parse(text, NAMES)
    assert (content + rest, calls) == ((whole[0] or ""), whole[1])


def test_parallel_calls_streamed_send_no_content_for_the_newline_between_them():
    """The newline an enforced answer writes between parallel call blocks is not content,
    streamed as whole (`parse` gives None), wherever the deltas are cut; whitespace before
    text still is."""
    blocks = OUTPUT[OUTPUT.index("<tool_call>") :]
    for text, content in ((blocks, ""), ("\n " + blocks, ""), ("\n Hi " + blocks, "\n Hi \n")):
        assert (PARSERS["hermes"].parse(text, NAMES)[0] or "") == content
        for cut in range(1, len(text)):
            stream = ToolCallStream(NAMES)
            first, calls = stream.feed(text[:cut])
            second, more = stream.feed(text[cut:])
            rest, _ = stream.finish()
            assert (first + second + rest, len(calls + more)) == (content, 2), (text, cut)


def test_an_enforced_call_cut_at_max_tokens_is_a_call_once_it_has_named_its_function():
    """Every cut of an enforced call's output, read as cut at `max_tokens`: content while the
    function's name is not whole (an unknown name stays content too); then a call whose
    arguments are the text so far; the whole call once its JSON closed, the end tag begun or
    not. Streamed in two pieces, the same; not cut (`truncated` False), content as before."""
    block = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = f"<tool_call>{block}</tool_call>"
    named = text.index('"get_weather"') + len('"get_weather"')
    for end in range(1, len(text)):
        cut = text[:end]
        content, calls = PARSERS["hermes"].parse(cut, NAMES, truncated=True)
        if end < named:
            assert (content, calls) == (cut, []), cut
        else:
            assert content is None and [c.name for c in calls] == ["get_weather"], cut
            arguments = calls[0].arguments
            assert '{"city": "Paris"}'.startswith(arguments), cut
            whole = text.index('{"city"') + len('{"city": "Paris"}')  # where they close
            assert (arguments == '{"city": "Paris"}') == (end >= whole), cut
        assert PARSERS["hermes"].parse(cut, NAMES) == (cut, []) or end == len(text)
        stream = ToolCallStream(NAMES)
        streamed, calls_so_far = stream.feed(cut[: end // 2])
        more, new = stream.feed(cut[end // 2 :])
        rest, last = stream.finish(truncated=True)
        assert ((streamed + more + rest) or None, calls_so_far + new + last) == (content, calls)
    unknown = '<tool_call>{"name": "get_time", "arguments": {"z'
    assert PARSERS["hermes"].parse(unknown, NAMES, truncated=True) == (unknown, [])


def test_a_template_that_reads_tools_gets_them_and_the_history_as_objects():
    history = _history()
    messages, tools = render(history, TOOLS, native=True)
    assert tools == TOOLS
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == history[2]
    assert template_reads_tools("{% if tools %}...{% endif %}")
    assert not template_reads_tools("{% for m in messages %}{{ m.content }}{% endfor %}")


def test_a_template_without_tools_gets_the_hermes_convention_in_its_messages():
    history = [{"role": "system", "content": "Be brief."}, *_history()]
    messages, tools = render(history, TOOLS, native=False)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n") and json.dumps(TOOLS[1]) in system
    assert messages[2]["content"] == (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    assert messages[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    # A history call whose arguments are not JSON is the client's error.
    history[2]["tool_calls"][0]["function"]["arguments"] = "{city"
    with pytest.raises(InvalidRequestError, match="not JSON"):
        render(history, TOOLS, native=False)


def test_a_functions_strict_flag_stays_out_of_the_listed_tools():
    """`strict` is a flag to the server (the Responses API's clients send `strict: false` by
    default): a function lists the same with it, without it and with it true."""
    flagged = [
        {**t, "function": {**t["function"], "strict": s}} for t, s in zip(TOOLS, (False, True))
    ]
    plain, _ = render(_history(), TOOLS, native=False)
    assert render(_history(), flagged, native=False) == (plain, None)
    assert '"strict"' not in plain[0]["content"]
    # A template that reads tools gets them as sent.
    assert render(_history(), flagged, native=True)[1] == flagged


def test_enforced_calls_are_bounded_and_compile():
    llguidance = pytest.importorskip("llguidance")
    bounded = closed(TOOLS[1]["function"]["parameters"])
    assert bounded["additionalProperties"] is False
    assert bounded["properties"]["a"] == {
        "minimum": -JSON_SAFE_INTEGER, "maximum": JSON_SAFE_INTEGER, "type": "integer"
    }  # fmt: skip
    nested = closed({"type": "object", "properties": {"x": {"type": "array", "items": {
        "type": "object", "properties": {"y": {"type": "integer", "maximum": 3}}}}},
        "enum": [{"properties": {}}]})  # fmt: skip
    assert nested["properties"]["x"]["items"]["additionalProperties"] is False
    assert nested["properties"]["x"]["items"]["properties"]["y"]["maximum"] == 3
    assert nested["enum"] == [{"properties": {}}]  # values are not schemas
    for name, parallel in ((None, True), (None, False), ("add", True)):
        grammar = call_grammar(TOOLS, name, parallel=parallel)
        lark = llguidance.LLMatcher.grammar_from_lark(grammar)
        assert llguidance.LLMatcher.validate_grammar(lark) == "", grammar
    assert call_grammar(TOOLS, None, parallel=True).splitlines()[0] == (
        'start: call ("\\n" call)?'
    )  # at most one call per tool
    assert call_grammar(TOOLS, "add", parallel=True).splitlines()[0] == "start: call"
    assert '"get_weather"' not in call_grammar(TOOLS, "add", parallel=False)


QWEN_STYLE = (  # the tool part of Qwen2.5's template, as Hugging Face templates read tools
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{%- for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_the_tokenizer_passes_tools_to_a_template_that_reads_them(tiny_tok_dir):
    from loopserve.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_tok_dir)
    tokenizer.chat_template, tokenizer._compiled_template = QWEN_STYLE, None
    history = _history()
    assert template_reads_tools(tokenizer.chat_template)
    messages, tools = render(history, TOOLS, native=True)
    text, token_ids = tokenizer.encode_chat(messages, tools=tools)
    assert json.dumps(TOOLS[0]) in text.replace("\\u003c", "<")
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert token_ids and tokenizer.decode(token_ids, skip_special_tokens=False) == text
