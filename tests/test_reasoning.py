"""Reasoning output (`--reasoning-parser think`): the text between <think> and </think> moves
into `reasoning_content`, on messages and stream deltas, and its tokens are counted in
`usage.completion_tokens_details.reasoning_tokens`.

The tiny model writes the tags because a structured-output regex makes it; the template that
opens the block in the prompt (as DeepSeek-R1's and Qwen3's do) is a fixture tokenizer's."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import pytest

from loopserve.text.reasoning import THINK, ReasoningStream

CASES = [  # (text, started) -> (reasoning, content)
    ("<think>a plan</think>The answer.", False, ("a plan", "The answer.")),
    ("  \n<think>x</think>", False, ("x", "")),
    ("No thinking here.", False, (None, "No thinking here.")),
    ("<think>cut by max_tokens", False, ("cut by max_tokens", "")),
    ("a plan</think>The answer.", True, ("a plan", "The answer.")),
    ("Answer with <think> inside", False, (None, "Answer with <think> inside")),
    ("<thi", False, (None, "<thi")),
]


@pytest.mark.parametrize("text, started, expected", CASES)
def test_split_and_every_cut_of_the_stream_agree(text, started, expected):
    assert THINK.split(text, started=started) == expected
    for cut in range(len(text) + 1):  # a tag cut anywhere across two deltas
        stream = ReasoningStream(THINK, started=started)
        parts = [stream.feed(text[:cut]), stream.feed(text[cut:]), stream.finish()]
        reasoning = "".join(r for r, _ in parts)
        content = "".join(c for _, c in parts)
        assert (reasoning if stream.saw_reasoning else None, content) == expected, cut


from tests.optional import require

require("serve", "structured")
from loopserve.engine.llm_engine import LLMEngine  # noqa: E402
from tests.server_utils import sse_payloads, thinking_model  # noqa: E402

THINKING = r"<think>[a-z]{2,6}( [a-z]{2,6}){1,3}</think>[A-Z][a-z]{2,8}\."


def _serve(model_dir, posts, reasoning_parser="think"):
    import asyncio

    import httpx

    from loopserve.engine.async_llm import AsyncLLM
    from loopserve.server.api_server import build_app

    engine = LLMEngine.from_engine_args(model=str(model_dir), dtype="float32", num_blocks=64)

    async def main():
        client = AsyncLLM(engine)
        client.start()
        assert await client.wait_ready(timeout_s=30)
        app = build_app(client, "tiny", reasoning_parser=reasoning_parser)
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                return [await http.post("/v1/chat/completions", json=body) for body in posts]
        finally:
            await client.shutdown(1.0)

    return engine, asyncio.run(main())


def _reasoning_tokens_by_scan(tokenizer, token_ids, started):
    """An independent count: the shortest prefix whose text has closed the block."""
    for k in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:k])
        if "</think>" in text and (started or text.lstrip().startswith("<think>")):
            return k
    return len(token_ids)


def _chat(regex, stream=False, seed=4):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Think first."}],
            "max_tokens": 60, "temperature": 0.8, "seed": seed, "guided_regex": regex,
            "return_token_ids": True}  # fmt: skip
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def _check(engine, responses, started):
    plain, streamed = responses
    assert plain.status_code == 200 and streamed.status_code == 200, plain.text
    message = plain.json()["choices"][0]["message"]
    token_ids = plain.json()["choices"][0]["token_ids"]
    text = engine.tokenizer.decode(token_ids)
    reasoning = message["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert message["content"] and message["content"] in text and reasoning in text
    assert text.endswith("</think>" + message["content"])
    details = plain.json()["usage"]["completion_tokens_details"]
    expected = _reasoning_tokens_by_scan(engine.tokenizer, token_ids, started)
    assert details["reasoning_tokens"] == expected < len(token_ids)
    events = [e for e in sse_payloads(streamed.text.splitlines()) if e != "[DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert events[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == expected


def test_think_output_moves_into_reasoning_content_whole_and_streamed(tiny_tok_dir):
    engine, responses = _serve(tiny_tok_dir, [_chat(THINKING), _chat(THINKING, stream=True)])
    _check(engine, responses, started=False)


def test_a_template_that_opens_the_block_in_the_prompt(tiny_tok_dir, tmp_path):
    """The generation prompt ends with <think>: the output starts inside the block."""
    model_dir = thinking_model(tiny_tok_dir, tmp_path)
    opened = THINKING.removeprefix("<think>")
    engine, responses = _serve(model_dir, [_chat(opened), _chat(opened, stream=True)])
    _check(engine, responses, started=True)


def test_without_a_parser_the_text_is_as_written(tiny_tok_dir):
    _, (plain,) = _serve(tiny_tok_dir, [_chat(THINKING)], reasoning_parser=None)
    message = plain.json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"].startswith("<think>")
    assert "completion_tokens_details" not in plain.json()["usage"]
