"""OpenAI's Responses API (`POST /v1/responses`) as the openai SDK calls it: the same tokens as
the chat completion the request means, streamed events that add up to the non-streamed
response, function calls and their outputs over two turns, structured output through
`text.format`, and what the stateless server cannot do refused by name."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import json

from tests.optional import require

require("serve", "structured")

import httpx
import openai
import pytest

from loopserve.engine.llm_engine import LLMEngine
from tests.server_utils import (
    in_process_calls,
    recorded_requests,
    replay,
    sse_payloads,
    thinking_model,
)

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Oslo"]}},
               "required": ["city"], "additionalProperties": False}}  # fmt: skip
ADD = {"type": "function", "name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer", "maximum": 99}, "b": {"type": "integer", "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}  # fmt: skip
INSTRUCTIONS, QUESTION = "Answer briefly.", "What is the weather in Paris?"


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_engine_args(dtype="float32", num_blocks=512, max_num_seqs=8)


def _serve(engine, calls):
    async def run(client):
        sdk = openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=client)
        return await calls(sdk, client)

    return in_process_calls(engine, "m", run)


def test_a_text_response_equals_the_chat_completion_it_means_streamed_and_not(engine):
    async def calls(sdk, _client):
        messages = [{"role": "system", "content": INSTRUCTIONS},
                    {"role": "user", "content": QUESTION}]  # fmt: skip
        chat = await sdk.chat.completions.create(
            model="m", messages=messages, max_tokens=12, temperature=0
        )
        plain = await sdk.responses.create(
            model="m", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=12,
            temperature=0,
        )  # fmt: skip
        as_items = await sdk.responses.create(
            model="m", input=[{"role": "developer", "content": INSTRUCTIONS},
                              {"type": "message", "role": "user",
                               "content": [{"type": "input_text", "text": QUESTION}]}],
            max_output_tokens=12, temperature=0,
        )  # fmt: skip
        chat_developer = await sdk.chat.completions.create(
            model="m", max_tokens=12, temperature=0,
            messages=[{"role": "developer", "content": INSTRUCTIONS}, messages[1]],
        )  # fmt: skip
        stream = await sdk.responses.create(
            model="m", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=12,
            temperature=0, stream=True,
        )  # fmt: skip
        events = [event async for event in stream]
        return chat, plain, (as_items, chat_developer), events

    chat, plain, (as_items, chat_developer), events = _serve(engine, calls)
    choice = chat.choices[0]
    assert plain.object == "response" and plain.id.startswith("resp_")
    assert plain.output_text == choice.message.content
    assert plain.model_extra["exit_depths"] == choice.exit_depths
    assert choice.finish_reason == "length"  # 12 tokens: cut, as the response says
    assert plain.status == "incomplete"
    assert plain.incomplete_details.reason == "max_output_tokens"
    assert plain.usage.input_tokens == chat.usage.prompt_tokens
    assert plain.usage.output_tokens == chat.usage.completion_tokens == 12
    assert plain.usage.total_tokens == plain.usage.input_tokens + 12
    assert [item.type for item in plain.output] == ["message"]
    # Input items (a developer message, text parts) are the messages they say.
    assert as_items.output_text == chat_developer.choices[0].message.content
    assert as_items.model_extra["exit_depths"] == chat_developer.choices[0].exit_depths
    # The stream: OpenAI's events in order, numbered, adding up to the same response.
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == plain.output_text == events[-1].response.output_text
    assert events[-1].response.model_extra["exit_depths"] == choice.exit_depths


def test_a_function_call_and_its_output_run_two_turns_as_chat_completions_does(engine):
    """The call the grammar enforces (`tool_choice` required) comes back as a
    `function_call` item, streamed or not; sent back with its output, the next turn's
    tokens equal the chat completion of the same history."""
    chat_tool = {"type": "function", "function": WEATHER}

    async def calls(sdk, _client):
        first = await sdk.responses.create(
            model="m", input=QUESTION, tools=[{"type": "function", **WEATHER}],
            tool_choice="required", max_output_tokens=80, temperature=0,
        )  # fmt: skip
        stream = await sdk.responses.create(
            model="m", input=QUESTION, tools=[{"type": "function", **WEATHER}],
            tool_choice="required", max_output_tokens=80, temperature=0, stream=True,
        )  # fmt: skip
        events = [event async for event in stream]
        call = first.output[0]
        second = await sdk.responses.create(
            model="m", tools=[{"type": "function", **WEATHER}], max_output_tokens=10,
            temperature=0,
            input=[{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
                   {"type": "function_call_output", "call_id": call.call_id,
                    "output": "22 C, sunny"}],
        )  # fmt: skip
        chat_second = await sdk.chat.completions.create(
            model="m", tools=[chat_tool], max_tokens=10, temperature=0,
            messages=[{"role": "user", "content": QUESTION},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": call.call_id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}]},
                      {"role": "tool", "tool_call_id": call.call_id, "content": "22 C, sunny"}],
        )  # fmt: skip
        named = await sdk.responses.create(
            model="m", input=QUESTION, tools=[{"type": "function", **WEATHER}, ADD],
            tool_choice={"type": "function", "name": "add"}, parallel_tool_calls=False,
            max_output_tokens=80, temperature=0,
        )  # fmt: skip
        return first, events, second, chat_second, named

    first, events, second, chat_second, named = _serve(engine, calls)
    assert [(item.type, item.name) for item in named.output] == [("function_call", "add")]
    assert set(json.loads(named.output[0].arguments)) == {"a", "b"}
    assert first.status == "completed"
    assert [item.type for item in first.output] == ["function_call"]
    call = first.output[0]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    assert call.call_id and call.status == "completed"
    kinds = [event.type for event in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]  # fmt: skip
    streamed = events[-1].response.output[0]
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    assert second.model_extra["exit_depths"] == chat_second.choices[0].exit_depths
    assert second.output_text == (chat_second.choices[0].message.content or "")


def test_text_format_json_schema_is_structured_output(engine):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip

    async def calls(sdk, _client):
        return await sdk.responses.create(
            model="m", input="Name a city.", max_output_tokens=60, temperature=0,
            text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                             "strict": True}},
        )  # fmt: skip

    response = _serve(engine, calls)
    assert response.status == "completed"
    assert set(json.loads(response.output_text)) == {"city"}
    assert response.text.format.type == "json_schema"


def test_included_logprobs_equal_the_chat_completions_streamed_and_not(engine):
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: the output text's
    tokens with their alternatives, as chat completions reports them; the stream's text
    deltas carry them in order, and its done event carries them all."""

    async def calls(sdk, _client):
        chat = await sdk.chat.completions.create(
            model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=6,
            temperature=0, logprobs=True, top_logprobs=2,
        )  # fmt: skip
        asked = dict(model="m", input=QUESTION, max_output_tokens=6, temperature=0,
                     include=["message.output_text.logprobs"], top_logprobs=2)  # fmt: skip
        plain = await sdk.responses.create(**asked)
        events = [event async for event in await sdk.responses.create(**asked, stream=True)]
        return chat, plain, events

    chat, plain, events = _serve(engine, calls)
    want = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    assert len(want) == 6 and all(len(entry["top_logprobs"]) == 2 for entry in want)
    _assert_logprobs_equal(plain.output[0].content[0].logprobs, want)
    deltas = [entry for e in events if e.type == "response.output_text.delta"
              for entry in e.logprobs]  # fmt: skip
    _assert_logprobs_equal(deltas, want)
    done = next(e for e in events if e.type == "response.output_text.done")
    _assert_logprobs_equal(done.logprobs, want)


def _assert_logprobs_equal(entries, want):
    """Tokens and alternatives exactly, values to 1e-5: a repeated prompt hits the prefix
    cache, so its last position's logits come from a shorter chunk (another GEMM shape) and
    may differ from the first request's in the last bits."""
    got = [entry.model_dump() for entry in entries]

    def split(entries):
        tokens = [[(e["token"], e["bytes"])] + [(t["token"], t["bytes"]) for t in e["top_logprobs"]]
                  for e in entries]  # fmt: skip
        values = [
            v for e in entries for v in [e["logprob"]] + [t["logprob"] for t in e["top_logprobs"]]
        ]
        return tokens, values

    (got_tokens, got_values), (want_tokens, want_values) = split(got), split(want)
    assert got_tokens == want_tokens
    assert got_values == pytest.approx(want_values, abs=1e-5)


def test_what_the_agents_sdk_sends_is_served(engine):
    """The request bodies the OpenAI Agents SDK 0.25.0 sent over its default Responses model
    (recorded by scripts/agents_tools.py `--loops agents-responses`): the forced first turn,
    plain and streamed, comes back as a call that parses under the tool's schema; the second
    turn (the call and its output sent back as items, `id` and `status` included) is served."""
    entries = recorded_requests("agent_responses_requests.jsonl")
    assert len(entries) == 4

    async def calls(_sdk, client):
        return await replay(client, entries, "m")

    for entry, response in zip(entries, _serve(engine, calls)):
        assert response.status_code == 200, response.text
        body = entry["body"]
        if body.get("stream"):
            events = sse_payloads(response.text.splitlines())
            final = events[-1]["response"]
        else:
            final = response.json()
        if body.get("tool_choice") == "required":
            assert final["status"] == "completed"
            (call,) = final["output"]
            assert call["type"] == "function_call" and call["name"] == "get_weather"
            arguments = json.loads(call["arguments"])
            assert set(arguments) == {"city"} and len(arguments["city"]) <= 24
        else:  # the answer to the tool's result: free text
            assert any(item.get("type") == "function_call_output" for item in body["input"])
            assert final["status"] in ("completed", "incomplete")
            assert final["output"][-1]["type"] in ("message", "function_call")


REFUSED = {  # body fields -> the field the 400 names
    "previous_response_id": ({"previous_response_id": "resp_1"}, "previous_response_id"),
    "conversation": ({"conversation": "conv_1"}, "conversation"),
    "store_true": ({"store": True}, "store"),
    "include": ({"include": ["file_search_call.results"]}, "include"),
    "top_logprobs_alone": ({"top_logprobs": 2}, "top_logprobs"),
    "hosted_tool": ({"tools": [{"type": "web_search"}]}, "tools"),
    "image_input": (
        {
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "http://x/a.png"}],
                }
            ]
        },
        "input",
    ),  # fmt: skip
    "no_input": ({"input": []}, "input"),
    "zero_max_output_tokens": ({"max_output_tokens": 0}, "max_output_tokens"),
    "reasoning_summary": ({"reasoning": {"summary": "verbose"}}, "reasoning"),
    "unknown_field": ({"background": True}, "background"),
    "metadata_long_key": ({"metadata": {"k" * 65: "v"}}, "metadata"),
}


def test_what_a_stateless_server_cannot_do_is_a_400_naming_the_field(engine):
    async def calls(_sdk, client: httpx.AsyncClient):
        out = {}
        for case, (fields, _) in REFUSED.items():
            body = {"model": "m", "input": "hi", "max_output_tokens": 4, **fields}
            out[case] = await client.post("/v1/responses", json=body)
        out["accepted"] = await client.post("/v1/responses", json={
            "model": "m", "input": "hi", "max_output_tokens": 4, "store": False, "include": [],
            "metadata": {"k": "v"}, "truncation": "disabled", "parallel_tool_calls": True,
            # what Codex sends: nothing to do differently (effort ignored, nothing encrypted)
            "reasoning": {"summary": "auto", "effort": "high"}, "client_metadata": {"k": "v"},
        })  # fmt: skip
        out["encrypted_reasoning"] = await client.post("/v1/responses", json={
            "model": "m", "input": "hi", "max_output_tokens": 4,
            "include": ["reasoning.encrypted_content", "message.output_text.logprobs"]})  # fmt: skip
        return out

    out = _serve(engine, calls)
    for case, (_, param) in REFUSED.items():
        response = out[case]
        assert response.status_code == 400, (case, response.text)
        assert response.json()["error"]["param"] == param, (case, response.text)
    assert out["accepted"].status_code == 200, out["accepted"].text
    assert out["accepted"].json()["store"] is False
    assert out["encrypted_reasoning"].status_code == 200, out["encrypted_reasoning"].text
    (message,) = out["encrypted_reasoning"].json()["output"]
    assert len(message["content"][0]["logprobs"]) == 4


def test_what_codex_sends_is_served():
    """Codex CLI 0.171.0's request (`codex exec` over a provider with `wire_api =
    "responses"`, run with `-c web_search=disabled`: its hosted search is a 400 here),
    recorded against `loopserve serve` with its texts and tool descriptions shortened and
    two of its seven function tools and two of its namespace's five kept: developer
    messages of several text parts, function tools with `strict: false`, its sub-agent
    tools in a `namespace` tool, `reasoning: {"summary": "auto"}`, `include:
    ["reasoning.encrypted_content"]`, `store: false`, `prompt_cache_key` and
    `client_metadata`. It streams OpenAI's events in order, numbered, to a final response."""
    (entry,) = recorded_requests("codex_responses_requests.jsonl")
    body = entry["body"]
    assert body["stream"] and "client_metadata" in body
    assert {tool["type"] for tool in body["tools"]} == {"function", "namespace"}
    engine = LLMEngine.from_engine_args(dtype="float32", num_blocks=1024, max_num_seqs=2)

    async def calls(client):
        return await client.post(
            "/v1/responses", json={**body, "model": "m", "max_output_tokens": 8}
        )

    response = in_process_calls(engine, "m", calls)
    assert response.status_code == 200, response.text
    events = sse_payloads(response.text.splitlines())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    final = events[-1]["response"]
    # Codex sends no temperature, so the server's default samples with a fresh seed and the
    # answer may end before the cap (it did in 1 of 6 runs): the status says which.
    tokens = final["usage"]["output_tokens"]
    assert final["output"] and 1 <= tokens <= 8
    if final["status"] == "incomplete":
        assert tokens == 8 and final["incomplete_details"] == {"reason": "max_output_tokens"}
    else:
        assert final["status"] == "completed" and final["incomplete_details"] is None, final
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]


def test_reasoning_comes_as_a_reasoning_item_streamed_and_not(tiny_tok_dir, tmp_path):
    """A template that opens `<think>` in the prompt and the server's `think` parser: the
    answer's reasoning is a `reasoning` item equal to chat's `reasoning_content`, its
    streamed deltas add up to it, and usage counts the same reasoning tokens."""
    model_dir = thinking_model(tiny_tok_dir, tmp_path)
    engine = LLMEngine.from_engine_args(model=str(model_dir), dtype="float32", num_blocks=256)

    async def run(client):
        sdk = openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=client)
        chat = await sdk.chat.completions.create(
            model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=16,
            temperature=0,
        )  # fmt: skip
        plain = await sdk.responses.create(
            model="m", input=QUESTION, max_output_tokens=16, temperature=0
        )
        stream = await sdk.responses.create(
            model="m", input=QUESTION, max_output_tokens=16, temperature=0, stream=True
        )
        return chat, plain, [event async for event in stream]

    chat, plain, events = in_process_calls(engine, "m", run, reasoning_parser="think")
    reasoning = chat.choices[0].message.model_extra["reasoning_content"]
    assert reasoning  # the block opened in the prompt: the output starts inside it
    assert plain.output[0].type == "reasoning"
    assert plain.output[0].content[0].text == reasoning
    assert plain.output_text == (chat.choices[0].message.content or "")
    details = chat.usage.completion_tokens_details
    assert plain.usage.output_tokens_details.reasoning_tokens == details.reasoning_tokens > 0
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == reasoning
    assert events[-1].response.output[0].content[0].text == reasoning
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == (
        details.reasoning_tokens
    )


def test_a_namespaces_functions_are_offered_and_their_calls_name_it(engine):
    """A `namespace` tool's functions are offered as functions of their own: a required call
    to one comes back as the chat completion over the flattened functions calls it, with
    `namespace` on the `function_call` item, streamed and not; sent back with its output,
    the call is read as any other."""
    agents = {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [
        {"type": "function", "name": "close_agent", "parameters": {"type": "object",
         "properties": {"id": {"type": "string", "maxLength": 8}}, "required": ["id"]}}]}  # fmt: skip
    asked = dict(model="m", input=QUESTION, max_output_tokens=60, temperature=0,
                 tools=[{**WEATHER, "type": "function"}, agents],
                 tool_choice={"type": "function", "name": "close_agent"})  # fmt: skip

    async def calls(sdk, client):
        flat = [{"type": "function", "function": WEATHER},
                {"type": "function", "function": {k: v for k, v in agents["tools"][0].items()
                                                  if k != "type"}}]  # fmt: skip
        chat = await sdk.chat.completions.create(
            model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=60,
            temperature=0, tools=flat,
            tool_choice={"type": "function", "function": {"name": "close_agent"}},
        )  # fmt: skip
        plain = (await client.post("/v1/responses", json=asked)).json()
        streamed = await client.post("/v1/responses", json={**asked, "stream": True})
        (item,) = plain["output"]
        turn = await client.post("/v1/responses", json={**asked, "tool_choice": "none", "input": [
            {"role": "user", "content": QUESTION}, item,
            {"type": "function_call_output", "call_id": item["call_id"], "output": "closed"}]})  # fmt: skip
        return chat, plain, streamed, turn

    chat, plain, streamed, turn = _serve(engine, calls)
    (call,) = chat.choices[0].message.tool_calls
    (item,) = plain["output"]
    assert (item["type"], item["name"], item["namespace"]) == (
        "function_call",
        "close_agent",
        "agents",
    )
    assert item["arguments"] == call.function.arguments
    events = sse_payloads(streamed.text.splitlines())
    (done,) = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert {k: done[k] for k in ("name", "namespace", "arguments")} == {
        k: item[k] for k in ("name", "namespace", "arguments")}  # fmt: skip
    assert turn.status_code == 200, turn.text
    assert turn.json()["output"][-1]["type"] == "message"
