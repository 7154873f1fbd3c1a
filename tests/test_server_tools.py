"""Tool calling through the API, as the openai SDK's tool loop drives it: a call, the tool's
answer, the final message; `required` and named calls enforced by a grammar so their
arguments always parse against the function's schema (50 of 50 on the embedded model,
greedy and sampled, with bounded fields: a small model may write an unbounded string
until max_tokens); streamed calls reassemble to the non-streamed ones; the parser turns
an `auto` answer's call blocks into `tool_calls`; bad tool requests are 400s naming the
parameter."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import asyncio
import json

from tests.optional import require

require("serve", "structured")

import openai
import pytest

from loopserve.engine.llm_engine import LLMEngine
from tests.server_utils import in_process_calls, recorded_requests, replay

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"]}}}  # fmt: skip
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}  # fmt: skip
TOOLS = [WEATHER, ADD]
QUESTIONS = ["What is the weather in Paris?", "Add 2 and 3.", "Is it cold in Oslo?",
             "What's 40 plus 2?", "Weather in Lima, in fahrenheit?"]  # fmt: skip


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_engine_args(dtype="float32", num_blocks=512, max_num_seqs=16)


def _serve(engine, calls, **app_options):
    async def run(client):
        sdk = openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=client)
        return await calls(sdk, client)

    return in_process_calls(engine, "m", run, **app_options)


def _valid(call) -> bool:
    """The call names a tool and its arguments parse and satisfy that tool's schema."""
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        return (set(arguments) == {"city", "unit"} and isinstance(arguments["city"], str)
                and arguments["unit"] in ("c", "f"))  # fmt: skip
    assert call.function.name == "add"
    return set(arguments) == {"a", "b"} and all(type(v) is int for v in arguments.values())


def test_the_openai_sdk_tool_loop_runs_a_call_the_answer_and_the_final_message(engine):
    async def calls(sdk, _client):
        messages = [{"role": "user", "content": QUESTIONS[0]}]
        first = await sdk.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, tool_choice="required",
            max_tokens=300, temperature=0,
        )  # fmt: skip
        message = first.choices[0].message
        messages.append(message)  # the SDK object, as the cookbook's loop appends it
        for call in message.tool_calls or ():
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "22 C, sunny"})
        final = await sdk.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=12,
            temperature=0,
        )  # fmt: skip
        return first, final

    first, final = _serve(engine, calls)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls and all(_valid(c) for c in choice.message.tool_calls)
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    answer = final.choices[0]
    assert answer.message.tool_calls is None and isinstance(answer.message.content, str)
    assert answer.finish_reason in ("stop", "length")


def test_required_and_named_calls_always_parse_greedy_and_sampled(engine):
    """24 requests: `required` and a named function, greedy and sampled (seeded), over five
    questions; every answer is calls only, each valid under its function's schema."""
    choices = ["required", {"type": "function", "function": {"name": "add"}}]

    async def calls(sdk, _client):
        requests = [
            sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": QUESTIONS[i % 5]}],
                tools=TOOLS, tool_choice=choices[i % 2], max_tokens=400,
                temperature=0.0 if i < 6 else 1.0, seed=i,
            )
            for i in range(24)
        ]  # fmt: skip
        return await asyncio.gather(*requests)

    responses = _serve(engine, calls)
    for i, response in enumerate(responses):
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", (i, choice)
        calls_made = choice.message.tool_calls
        assert calls_made and all(_valid(c) for c in calls_made), (i, calls_made)
        if i % 2:  # the named function, once
            assert [c.function.name for c in calls_made] == ["add"]
        else:  # at most one call per tool
            assert len(calls_made) <= len(TOOLS)


def test_streamed_calls_reassemble_to_the_non_streamed_calls(engine):
    async def calls(sdk, _client):
        args = dict(model="m", messages=[{"role": "user", "content": QUESTIONS[2]}],
                    tools=TOOLS, tool_choice="required", max_tokens=400, temperature=0.8,
                    seed=11)  # fmt: skip
        whole = await sdk.chat.completions.create(**args)
        stream = await sdk.chat.completions.create(**args, stream=True)
        chunks = [chunk async for chunk in stream]
        return whole, chunks

    whole, chunks = _serve(engine, calls)
    assembled: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or ():
                entry = assembled.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
                assert call.id is None or call.id.startswith("call_")
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.choices[0].message.tool_calls
    ]
    assert [assembled[i] for i in sorted(assembled)] == expected
    assert finish == "tool_calls" == whole.choices[0].finish_reason


def test_a_call_cut_at_max_tokens_comes_back_as_a_call_cut_short():
    """As OpenAI returns one: finish reason "length" and `tool_calls` with the arguments as
    far as they got (not the block's markup as content), streamed and not, and over the
    Responses API a `function_call` item in an incomplete response. Cut before the
    function's name is whole, the output stays content. (An engine without a prefix cache:
    a repeated prompt that hit it would run a shorter chunk, another GEMM shape, and a
    near-tie could take another greedy token, so a cut might not be the whole call's
    prefix.)"""
    engine = LLMEngine.from_engine_args(
        dtype="float32", num_blocks=512, max_num_seqs=4, enable_prefix_caching=False
    )
    unbounded = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
    args = dict(model="m", messages=[{"role": "user", "content": QUESTIONS[0]}], tools=[unbounded],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                temperature=0)  # fmt: skip

    async def calls(sdk, client):
        whole = await sdk.chat.completions.create(**args, max_tokens=300)
        cuts = {}  # every sixth cut from the whole call's length down to the first non-call
        for max_tokens in range(whole.usage.completion_tokens - 1, 0, -6):
            cut = await sdk.chat.completions.create(**args, max_tokens=max_tokens)
            cuts[max_tokens] = cut.choices[0]
            if not cut.choices[0].message.tool_calls:
                break
        inside = next(m for m, c in cuts.items() if c.message.tool_calls and  # in the string
                      c.message.tool_calls[0].function.arguments.startswith('{"city": "') and
                      not c.message.tool_calls[0].function.arguments.endswith("}"))  # fmt: skip
        chunks = [c async for c in await sdk.chat.completions.create(
            **args, max_tokens=inside, stream=True)]  # fmt: skip
        responses = await client.post("/v1/responses", json={
            "model": "m", "input": QUESTIONS[0], "max_output_tokens": inside, "temperature": 0,
            "tools": [{"type": "function", **unbounded["function"]}],
            "tool_choice": {"type": "function", "name": "get_weather"}})  # fmt: skip
        return whole, cuts, inside, chunks, responses.json()

    whole, cuts, inside, chunks, responses = _serve(engine, calls)
    assert whole.choices[0].finish_reason == "tool_calls"
    (call,) = whole.choices[0].message.tool_calls
    made = [choice for choice in cuts.values() if choice.message.tool_calls]
    assert len(made) >= 4
    for choice in made:
        (cut,) = choice.message.tool_calls
        assert choice.finish_reason == "length" and choice.message.content is None
        assert cut.function.name == "get_weather"
        assert call.function.arguments.startswith(cut.function.arguments)
    cut_inside = cuts[inside].message.tool_calls[0].function.arguments
    assert cut_inside != call.function.arguments  # inside the string: not JSON yet
    first = list(cuts.values())[-1]  # the name not yet whole: content, as before
    assert first.finish_reason == "length" and first.message.content.startswith("<tool_call>")

    streamed = [call for chunk in chunks for choice in chunk.choices
                for call in choice.delta.tool_calls or ()]  # fmt: skip
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        ("get_weather", cut_inside)
    ]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(not choice.delta.content for chunk in chunks for choice in chunk.choices)
    assert responses["status"] == "incomplete"
    assert [(i["type"], i["name"], i["arguments"]) for i in responses["output"]] == [
        ("function_call", "get_weather", cut_inside)
    ]


def test_an_auto_answers_call_blocks_become_tool_calls(engine):
    """`auto` leaves the choice to the model; the parser reads what it wrote. A regex makes
    the embedded model write one call block, so the parser's path is exercised end to end;
    without a parser (`--tool-call-parser none`) `auto` is refused and `required` works."""
    block = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    body = {"model": "m", "messages": [{"role": "user", "content": QUESTIONS[1]}],
            "tools": TOOLS, "max_tokens": 60, "guided_regex": "Sure\\. " + block.replace(
                "{", "\\{").replace("}", "\\}")}  # fmt: skip

    async def calls(_sdk, client):
        return (await client.post("/v1/chat/completions", json=body)).json()

    message = _serve(engine, calls)["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"]["content"] == "Sure. "
    assert [c["function"] for c in message["message"]["tool_calls"]] == [
        {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    ]

    async def without_parser(_sdk, client):
        auto = (await client.post("/v1/chat/completions", json=body)).json()
        required = dict(body, tool_choice="required", max_tokens=200)
        del required["guided_regex"]
        return auto, (await client.post("/v1/chat/completions", json=required)).json()

    auto, required = _serve(engine, without_parser, tool_call_parser=None)
    assert (
        auto["error"]["param"] == "tool_choice" and "tool-call-parser" in auto["error"]["message"]
    )
    assert required["choices"][0]["finish_reason"] == "tool_calls"


BAD = {
    "choice_without_tools": ({"tool_choice": "required"}, "tool_choice"),
    "named_not_in_tools": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}},
        "tool_choice",
    ),
    "bad_function_name": (
        {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools"),
    "duplicate_names": ({"tools": [ADD, ADD]}, "tools"),
    "parameters_not_an_object": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "string"}}}]}, "tools"),
    "schema_that_does_not_compile": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "strin"}}}}}],
         "tool_choice": "required"}, "tools"),
    "unknown_tool_type": ({"tools": [{"type": "retrieval"}]}, "tools"),
    "tool_message_without_id": (
        {"messages": [{"role": "tool", "content": "22 C"}]}, "messages"),
    "tool_calls_on_a_user_message": (
        {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages"),
    "history_arguments_not_json": (
        {"tools": TOOLS, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
             "function": {"name": "add", "arguments": "{a"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "5"}]}, "messages"),
    "required_with_response_format": (
        {"tools": TOOLS, "tool_choice": "required",
         "response_format": {"type": "json_object"}}, "tool_choice"),
}  # fmt: skip


def test_bad_tool_requests_are_400s_naming_the_parameter(engine):
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    async def calls(_sdk, client):
        return {
            name: await client.post("/v1/chat/completions", json={**base, **fields})
            for name, (fields, _) in BAD.items()
        }

    responses = _serve(engine, calls)
    for name, (_, param) in BAD.items():
        response = responses[name]
        assert response.status_code == 400, (name, response.text)
        assert response.json()["error"]["param"] == param, (name, response.text)


def test_what_langchain_and_the_agents_sdk_send_is_served(engine):
    """The request bodies LangChain's `bind_tools` loop and the openai-agents SDK sent to
    `loopserve serve` (recorded by scripts/agents_tools.py): each is served; the forced
    first turns come back as calls that parse under the tools' schemas."""
    entries = recorded_requests("agent_tool_requests.jsonl")
    assert len(entries) == 4

    async def calls(_sdk, client):
        return await replay(client, entries, "m")

    for entry, response in zip(entries, _serve(engine, calls)):
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        if entry["body"].get("tool_choice") == "required":
            assert choice["finish_reason"] == "tool_calls"
            for call in choice["message"]["tool_calls"]:
                arguments = json.loads(call["function"]["arguments"])
                assert call["function"]["name"] == "get_weather"
                assert set(arguments) == {"city"} and len(arguments["city"]) <= 24
        else:
            assert "tool_calls" not in choice["message"]
