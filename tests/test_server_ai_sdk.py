"""What the Vercel AI SDK (`ai` 7.0.185) sends, replayed: its requests over chat completions
(`@ai-sdk/openai-compatible` 3.0.97; `@ai-sdk/openai`'s `.chat()` sent the same bodies) and
over the Responses API (`@ai-sdk/openai` 4.0.126's default model), recorded by
scripts/ai_sdk/ai_sdk_loops.mjs `--record` against `loopserve serve`: plain and streamed
text, a tool loop (a required call, then the tool's result sent back with `tool_choice`
none), and structured output. Each is served, and each Responses request gives the tokens
its chat completion gives."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import json

from tests.optional import require

require("serve", "structured")

import pytest

from loopserve.engine.llm_engine import LLMEngine
from tests.server_utils import in_process_calls, recorded_requests, replay


@pytest.fixture(scope="module")
def served():
    """The recorded requests and the responses to them, replayed in order."""
    entries = recorded_requests("ai_sdk_requests.jsonl")
    # No prefix cache: a request that hit its predecessor's prompt blocks would run a shorter
    # chunk (another GEMM shape), and a near-tie could take another greedy token.
    engine = LLMEngine.from_engine_args(
        dtype="float32", num_blocks=512, max_num_seqs=8, enable_prefix_caching=False
    )
    responses = in_process_calls(engine, "m", lambda client: replay(client, entries, "m"))
    for entry, response in zip(entries, responses):
        assert response.status_code == 200, (entry, response.text)
    return entries, responses


def _events(response) -> list[dict]:
    return [json.loads(line[len("data: ") :]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip


def _chat(response) -> tuple[str | None, list, str]:
    """(content, tool calls, finish reason) of a chat completion, streamed or not."""
    if not response.headers["content-type"].startswith("text/event-stream"):
        choice = response.json()["choices"][0]
        message = choice["message"]
        return message["content"], message.get("tool_calls") or [], choice["finish_reason"]
    chunks = _events(response)
    assert response.text.rstrip().endswith("data: [DONE]")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    deltas = [chunk["choices"][0] for chunk in chunks[:-1]]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    return content, [], next(d["finish_reason"] for d in deltas if d["finish_reason"])


def _response(response) -> tuple[str, list]:
    """(output text, function calls) of a Responses answer, streamed or not."""
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
    return text, calls


def test_every_request_is_served_in_the_sdks_shape(served):
    entries, responses = served
    assert [e["path"] for e in entries] == ["/v1/chat/completions"] * 5 + ["/v1/responses"] * 5
    for entry, response in zip(entries[:5], responses[:5]):
        content, calls, finish = _chat(response)
        if entry["body"].get("tool_choice") == "required":
            assert finish == "tool_calls" and content is None and len(calls) == 1
            arguments = json.loads(calls[0]["function"]["arguments"])
            assert calls[0]["function"]["name"] == "get_weather"
            assert set(arguments) == {"city"} and len(arguments["city"]) <= 12
        elif "response_format" in entry["body"]:  # the SDK's `Output.object`
            city = json.loads(content)["city"]
            assert isinstance(city, str) and len(city) <= 12
        else:
            assert content and not calls


def test_the_responses_requests_give_their_chat_completions_tokens(served):
    """The SDK's Responses provider sends its tool with `strict: false` and the tool's result
    as a `function_call_output` item; the chat provider neither. The same question gives the
    same text and the same call either way."""
    _entries, responses = served
    for chat_response, responses_response in zip(responses[:5], responses[5:]):
        content, calls, _finish = _chat(chat_response)
        text, function_calls = _response(responses_response)
        assert text == (content or "")
        assert function_calls == [(c["function"]["name"], c["function"]["arguments"])
                                  for c in calls]  # fmt: skip
