"""What agent frameworks send, replayed: each framework's requests over chat completions and
over the Responses API, recorded against `loopserve serve`, are served in the shape the
framework parses, and each Responses request gives the tokens of its chat counterpart.

- The Vercel AI SDK (`ai` 7.0.185; scripts/ai_sdk/ai_sdk_loops.mjs `--record`):
  `@ai-sdk/openai-compatible` 3.0.97 (chat completions; `@ai-sdk/openai`'s `.chat()` sent
  the same bodies) and `@ai-sdk/openai` 4.0.126's default model (Responses): plain and
  streamed text, a tool loop (a required call, then the tool's result sent back with
  `tool_choice` none), structured output.
- Pydantic AI 2.78.0 (scripts/agents_tools.py `--loops pydantic-ai --record`) over its chat
  and Responses models: an agent with a Pydantic output (its `final_result` tool, required)
  and a function tool, run (parallel calls, their results sent back) and streamed, and
  native structured output.
- The openai SDK's own structured-output helpers (`parse`, `stream`, over both APIs, with a
  Pydantic response format and a strict `pydantic_function_tool`), live."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import json

from tests.optional import require

require("serve", "structured")

import openai
import pytest
from pydantic import BaseModel, Field

from loopserve.engine.llm_engine import LLMEngine
from tests.server_utils import in_process_calls, recorded_requests, replay, sse_payloads

# The bounds the frameworks' schemas set, by tool (or response format) and field.
BOUNDS = {"get_weather": {"city": 24}, "final_result": {"city": 24, "summary": 40},
          "response": {"city": 12}, "Weather": {"city": 24, "summary": 40}}  # fmt: skip


@pytest.fixture(scope="module")
def engine():
    # No prefix cache: a request that hit its predecessor's prompt blocks would run a shorter
    # chunk (another GEMM shape), and a near-tie could take another greedy token.
    return LLMEngine.from_engine_args(
        dtype="float32", num_blocks=512, max_num_seqs=8, enable_prefix_caching=False
    )


def _served(engine, name: str, num_requests: int):
    """The recording's requests (chat completions first, then as many to /v1/responses) and
    the answers to them, each read as (text, [(name, arguments)], finish)."""
    entries = recorded_requests(name)
    half = num_requests // 2
    assert [e["path"] for e in entries] == ["/v1/chat/completions"] * half + [
        "/v1/responses"
    ] * half
    responses = in_process_calls(engine, "m", lambda client: replay(client, entries, "m"))
    for entry, response in zip(entries, responses):
        assert response.status_code == 200, (entry, response.text)
    answers = [_chat(r) for r in responses[:half]] + [_response(r) for r in responses[half:]]
    return entries, answers


def _events(response) -> list[dict]:
    return [p for p in sse_payloads(response.text.splitlines()) if p != "[DONE]"]


def _chat(response) -> tuple[str, list, str]:
    if not response.headers["content-type"].startswith("text/event-stream"):
        choice = response.json()["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        named = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        return choice["message"]["content"] or "", named, choice["finish_reason"]
    chunks = _events(response)
    assert response.text.rstrip().endswith("data: [DONE]")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    deltas = [chunk["choices"][0] for chunk in chunks[:-1]]
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta["delta"].get("tool_calls") or ():
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += call["function"].get("name") or ""
            entry[1] += call["function"].get("arguments") or ""
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    finish = next(d["finish_reason"] for d in deltas if d["finish_reason"])
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def _response(response) -> tuple[str, list, str]:
    if response.headers["content-type"].startswith("text/event-stream"):
        events = _events(response)
        # `incomplete` where the text ran to `max_output_tokens`, as a chat's "length"
        assert events[-1]["type"] in ("response.completed", "response.incomplete")
        body = events[-1]["response"]
    else:
        body = response.json()
    text = "".join(part["text"] for item in body["output"] if item["type"] == "message"
                   for part in item["content"])  # fmt: skip
    calls = [(item["name"], item["arguments"]) for item in body["output"]
             if item["type"] == "function_call"]  # fmt: skip
    return text, calls, body["status"]


def _within_bounds(name: str, arguments: str) -> bool:
    value = json.loads(arguments)
    bounds = BOUNDS[name]
    return set(value) == set(bounds) and all(
        isinstance(value[k], str) and len(value[k]) <= most for k, most in bounds.items()
    )


def _format_name(body: dict) -> str | None:
    """The name of a request's JSON schema response format, if it asks for one."""
    fmt = body.get("response_format") or body.get("text", {}).get("format")
    if fmt is None:
        return None
    return fmt.get("json_schema", fmt).get("name")


def _check(entries, answers) -> None:
    """Each answer in the shape its request asks for (forced calls to the request's tools,
    within their schemas' bounds, but for a last one `max_tokens` cut), and each Responses
    answer the same text and calls as its chat counterpart's."""
    half = len(entries) // 2
    for entry, (text, calls, finish) in zip(entries, answers):
        body = entry["body"]
        if body.get("tool_choice") == "required":
            assert calls and not text, entry
            names = {t.get("name") or t["function"]["name"] for t in body["tools"]}
            assert {name for name, _ in calls} <= names
            whole = calls if finish in ("tool_calls", "completed") else calls[:-1]
            assert finish in ("tool_calls", "completed", "length", "incomplete")
            assert all(_within_bounds(name, arguments) for name, arguments in whole)
        elif _format_name(body) is not None:
            assert _within_bounds(_format_name(body), text) and not calls
        else:
            assert text and not calls
    for (text, calls, _), (r_text, r_calls, _) in zip(answers[:half], answers[half:]):
        assert (r_text, r_calls) == (text, calls)


def test_what_the_vercel_ai_sdk_sends_is_served(engine):
    """Its Responses provider sends its tool with `strict: false` and the tool's result as a
    `function_call_output` item; its chat provider neither."""
    entries, answers = _served(engine, "ai_sdk_requests.jsonl", 10)
    _check(entries, answers)
    assert [bool(calls) for _, calls, _ in answers[:5]] == [False, False, True, False, False]


def test_what_pydantic_ai_sends_is_served(engine):
    """Its tools come with `strict: true` and `max_completion_tokens`; the run's first turn
    makes parallel calls whose results go back as tool messages or `function_call_output`
    items; its output tool and its native output parse under the output model."""
    entries, answers = _served(engine, "pydantic_ai_requests.jsonl", 8)
    _check(entries, answers)
    assert [bool(calls) for _, calls, _ in answers[:4]] == [True, True, True, False]


class City(BaseModel):
    city: str = Field(max_length=12)


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=24)


def test_the_openai_sdks_parse_and_stream_helpers_parse_what_is_served(engine):
    """`chat.completions.parse` / `.stream` and `responses.parse` / `.stream` with a Pydantic
    format, and a strict `pydantic_function_tool` (its schema closed, `strict: true`), parse
    into the models; the four ways give one answer, the two tool ways one call."""
    question = [{"role": "user", "content": "Name a city."}]
    weather = dict(messages=[{"role": "user", "content": "Weather in Paris?"}],
                   tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
                   max_tokens=80, temperature=0)  # fmt: skip

    async def calls(client):
        sdk = openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=client)
        chat = sdk.chat.completions
        parsed = (await chat.parse(model="m", messages=question, response_format=City,
                                   max_tokens=60, temperature=0)).choices[0].message.parsed  # fmt: skip
        async with chat.stream(model="m", messages=question, response_format=City, max_tokens=60,
                               temperature=0) as stream:  # fmt: skip
            streamed = (await stream.get_final_completion()).choices[0].message.parsed
        asked = dict(model="m", input="Name a city.", text_format=City, max_output_tokens=60,
                     temperature=0)  # fmt: skip
        responses_parsed = (await sdk.responses.parse(**asked)).output_parsed
        async with sdk.responses.stream(**asked) as stream:
            responses_streamed = (await stream.get_final_response()).output_parsed
        tool = (await chat.parse(model="m", **weather)).choices[0].message.tool_calls
        async with chat.stream(model="m", **weather) as stream:
            tool_streamed = (await stream.get_final_completion()).choices[0].message.tool_calls
        return (parsed, streamed, responses_parsed, responses_streamed), tool, tool_streamed

    cities, tool, tool_streamed = in_process_calls(engine, "m", calls)
    assert all(isinstance(city, City) for city in cities) and all(c == cities[0] for c in cities)
    (call,) = tool
    assert isinstance(call.function.parsed_arguments, GetWeather)
    assert [c.function.parsed_arguments for c in tool_streamed] == [call.function.parsed_arguments]
