"""Anthropic's Messages API (`POST /v1/messages`) as the anthropic SDK and Claude Code call it:
the same tokens as the chat completion the request means, streamed events that add up to the
whole message, tool calls as `tool_use` blocks and their results sent back, stop sequences,
Claude Code's recorded request, and what the server cannot do refused by name."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import json

from tests.optional import require

require("serve", "structured")

import pytest

from loopserve.engine.llm_engine import LLMEngine
from tests.server_utils import in_process_calls, recorded_requests

QUESTION = "What is the weather in Paris?"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 24}}, "required": ["city"]}}  # fmt: skip


@pytest.fixture(scope="module")
def engine():
    # No prefix cache: a request that hit its predecessor's prompt blocks would run a shorter
    # chunk (another GEMM shape), and a near-tie could take another greedy token.
    return LLMEngine.from_engine_args(
        dtype="float32", num_blocks=1024, max_num_seqs=8, enable_prefix_caching=False
    )


def _post_all(engine, requests: list[tuple[str, dict]], **app_options) -> list:
    async def calls(client):
        return [await client.post(path, json=body) for path, body in requests]

    return in_process_calls(engine, "m", calls, **app_options)


def _events(response) -> list[tuple[str, dict]]:
    """An Anthropic stream's (event name, data) pairs."""
    assert response.headers["content-type"].startswith("text/event-stream")
    out, name = [], None
    for line in response.text.splitlines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: ") :])
            assert data["type"] == name
            out.append((name, data))
    return out


def _assembled(events: list[tuple[str, dict]]) -> tuple[list[dict], dict]:
    """The content blocks a stream builds (as the anthropic SDK accumulates them) and its
    closing `message_delta`."""
    blocks: list[dict] = []
    for name, data in events:
        if name == "content_block_start":
            assert data["index"] == len(blocks)
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            else:
                assert delta["type"] == "input_json_delta"
                block["input"] = json.loads(delta["partial_json"])
    (closing,) = [data for name, data in events if name == "message_delta"]
    return blocks, closing


def test_a_message_is_the_chat_completion_it_means_streamed_and_not(engine):
    """System text blocks and a user turn of text blocks: the chat completion's text, exit
    depths and token counts; streamed, Anthropic's events in order add up to it."""
    body = {"model": "m", "max_tokens": 12, "temperature": 0,
            "system": [{"type": "text", "text": "Answer briefly.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]}  # fmt: skip
    chat = {"model": "m", "max_tokens": 12, "temperature": 0, "messages": [
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]}  # fmt: skip
    chat_r, whole_r, streamed_r = _post_all(engine, [
        ("/v1/chat/completions", chat), ("/v1/messages", body),
        ("/v1/messages", {**body, "stream": True})])  # fmt: skip
    choice, whole = chat_r.json()["choices"][0], whole_r.json()
    assert (whole["type"], whole["role"], whole["model"]) == ("message", "assistant", "m")
    assert whole["content"] == [{"type": "text", "text": choice["message"]["content"]}]
    assert whole["exit_depths"] == choice["exit_depths"]
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("max_tokens", None)
    assert whole["usage"]["output_tokens"] == 12 == chat_r.json()["usage"]["completion_tokens"]
    assert whole["usage"]["output_loops"] == sum(choice["exit_depths"])
    events = _events(streamed_r)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1:-2] == ["content_block_start"] + ["content_block_delta"] * (len(names) - 5) + [
        "content_block_stop"]  # fmt: skip
    blocks, closing = _assembled(events)
    assert blocks == whole["content"]
    assert closing["delta"]["stop_reason"] == "max_tokens"
    assert closing["usage"]["output_tokens"] == 12


def test_a_tool_use_block_and_its_result_sent_back(engine):
    """`tool_choice` any: a `tool_use` block whose input parses under the tool's schema, the
    call the chat completion over the same function makes, streamed as one input delta;
    `stop_reason` tool_use. The next turn, the assistant's content sent back and a
    `tool_result` in the user's, runs as the chat completion with the call and a tool
    message does."""
    asked = {"model": "m", "max_tokens": 80, "temperature": 0, "tools": [WEATHER],
             "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": QUESTION}]}  # fmt: skip
    chat_tools = [{"type": "function", "function": {
        "name": WEATHER["name"], "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"]}}]  # fmt: skip
    chat = {"model": "m", "max_tokens": 80, "temperature": 0, "tools": chat_tools,
            "tool_choice": "required", "messages": [{"role": "user", "content": QUESTION}]}  # fmt: skip
    chat_r, whole_r, streamed_r = _post_all(engine, [
        ("/v1/chat/completions", chat), ("/v1/messages", asked),
        ("/v1/messages", {**asked, "stream": True})])  # fmt: skip
    (call,) = chat_r.json()["choices"][0]["message"]["tool_calls"]
    whole = whole_r.json()
    (block,) = whole["content"]
    assert (block["type"], block["name"], whole["stop_reason"]) == (
        "tool_use",
        "get_weather",
        "tool_use",
    )
    assert block["input"] == json.loads(call["function"]["arguments"])
    assert block["id"].startswith("toolu_") and len(block["input"]["city"]) <= 24
    blocks, closing = _assembled(_events(streamed_r))
    assert [(b["name"], b["input"]) for b in blocks] == [(block["name"], block["input"])]
    assert closing["delta"]["stop_reason"] == "tool_use"

    result = [{"type": "tool_result", "tool_use_id": block["id"], "content": [
        {"type": "text", "text": "22 C, sunny"}]}, {"type": "text", "text": "And tomorrow?"}]  # fmt: skip
    turn = {**asked, "max_tokens": 10, "tool_choice": {"type": "auto"}, "messages": [
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": whole["content"]},
        {"role": "user", "content": result}]}  # fmt: skip
    chat_turn = {**chat, "max_tokens": 10, "tool_choice": "auto", "messages": [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {**call, "function": {**call["function"], "arguments": json.dumps(block["input"])}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "22 C, sunny"},
        {"role": "user", "content": "And tomorrow?"}]}  # fmt: skip
    turn_r, chat_turn_r = _post_all(engine, [("/v1/messages", turn),
                                             ("/v1/chat/completions", chat_turn)])  # fmt: skip
    assert turn_r.status_code == 200, turn_r.text
    assert turn_r.json()["exit_depths"] == chat_turn_r.json()["choices"][0]["exit_depths"]


def test_a_stop_sequence_is_named_where_it_stopped(engine):
    body = {"model": "m", "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": QUESTION}]}  # fmt: skip
    (free,) = _post_all(engine, [("/v1/messages", body)])
    text = free.json()["content"][0]["text"]
    word = text.split()[2]  # a word the answer writes
    (stopped,) = _post_all(engine, [("/v1/messages", {**body, "stop_sequences": [word]})])
    message = stopped.json()
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", word)
    assert (
        text.startswith(message["content"][0]["text"]) and word not in message["content"][0]["text"]
    )


def test_what_claude_code_sends_is_served(engine):
    """Claude Code 2.1's request (`claude -p` with `ANTHROPIC_BASE_URL` at `loopserve serve`,
    `--system-prompt` and `--tools Read` to keep its prompt small, recorded with its texts
    and descriptions shortened): system text blocks with `cache_control`, a `?beta=true`
    path, `thinking` adaptive, `context_management` clearing thinking, `output_config`
    effort, `metadata.user_id`, streamed."""
    (entry,) = recorded_requests("claude_code_requests.jsonl")
    body = entry["body"]
    assert entry["path"] == "/v1/messages?beta=true" and body["stream"]
    assert {"thinking", "context_management", "output_config", "metadata"} <= set(body)
    (response,) = _post_all(engine, [(entry["path"], {**body, "model": "m", "max_tokens": 8})])
    assert response.status_code == 200, response.text
    blocks, closing = _assembled(_events(response))
    # Claude Code sends no temperature: the server samples with a fresh seed, and the answer
    # may end before max_tokens (Codex's replay did, once in six runs); the stop says which.
    tokens, stop = closing["usage"]["output_tokens"], closing["delta"]["stop_reason"]
    assert blocks and 1 <= tokens <= 8
    assert stop in ("max_tokens", "end_turn", "tool_use"), closing
    assert stop != "max_tokens" or tokens == 8, closing


def test_the_anthropic_key_header_passes_the_servers_key_check(engine):
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}

    async def calls(client):
        return [await client.post("/v1/messages", json=body, headers=headers)
                for headers in ({"x-api-key": "k"}, {"x-api-key": "wrong"}, {})]  # fmt: skip

    statuses = [r.status_code for r in in_process_calls(engine, "m", calls, api_key="k")]
    assert statuses == [200, 401, 401]


def test_count_tokens_counts_the_prompt_the_message_runs(engine):
    """`/v1/messages/count_tokens` (no `max_tokens`): the prompt tokens the same message runs
    with, system and tools included (the tools listed in the prompt add tokens)."""
    asked = {"model": "m", "system": "Answer briefly.", "tools": [WEATHER],
             "messages": [{"role": "user", "content": QUESTION}]}  # fmt: skip
    counted, bare, ran, refused = _post_all(engine, [
        ("/v1/messages/count_tokens", asked),
        ("/v1/messages/count_tokens", {**asked, "tools": None}),
        ("/v1/messages", {**asked, "max_tokens": 2}),
        ("/v1/messages/count_tokens", {**asked, "tools": [{"type": "web_search_20250305", "name": "w"}]})])  # fmt: skip
    usage = ran.json()["usage"]
    assert counted.json() == {
        "input_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"]
    }
    assert bare.json()["input_tokens"] < counted.json()["input_tokens"]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


REFUSED = {  # body fields -> the field the 400 names
    "thinking_enabled": ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    "server_tool": ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    "image": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}
                    ],
                }
            ]
        },
        "messages",
    ),  # fmt: skip
    "tool_use_in_a_user_turn": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}
                    ],
                }
            ]
        },
        "messages",
    ),  # fmt: skip
    "no_max_tokens": ({"max_tokens": None}, "max_tokens"),
    "no_messages": ({"messages": []}, "messages"),
    "unknown_field": ({"container": "c"}, "container"),
    "other_context_edit": (
        {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
        "context_management",
    ),  # fmt: skip
    "empty_stop": ({"stop_sequences": [""]}, "stop_sequences"),
}


def test_what_the_server_cannot_do_is_a_400_naming_the_field(engine):
    base = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    bodies = []
    for fields, _ in REFUSED.values():
        body = {**base, **fields}
        bodies.append(("/v1/messages", {k: v for k, v in body.items() if v is not None}))
    for case, response in zip(REFUSED, _post_all(engine, bodies)):
        assert response.status_code == 400, (case, response.text)
        assert response.json()["error"]["param"] == REFUSED[case][1], (case, response.text)
