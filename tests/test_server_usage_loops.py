"""Loop accounting in `usage` (looped-model extension fields): `completion_loops` is the sum of
the loops every output token used, as the responses' own `exit_depths` report them, and
`mean_loops` that per output token; whole responses, streamed usage (deltas added up) and
chat alike."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
from tests.optional import require

require("serve")
from loopserve.engine.llm_engine import LLMEngine
from tests.server_utils import in_process_calls, sse_payloads


def test_usage_counts_the_loops_the_responses_report(tiny_tok_dir):
    engine = LLMEngine.from_engine_args(model=str(tiny_tok_dir), dtype="float32", num_blocks=64)
    common = {"model": "tiny", "max_tokens": 9, "temperature": 0.7, "seed": 2,
              "exit_threshold": 0.5, "ignore_eos": True}  # fmt: skip
    completion = common | {"prompt": "a red fox", "n": 2}
    chat = common | {"messages": [{"role": "user", "content": "hello"}]}
    stream = {"stream": True, "stream_options": {"include_usage": True}}

    async def calls(client):
        return [
            await client.post("/v1/completions", json=completion),
            await client.post("/v1/chat/completions", json=chat),
            await client.post("/v1/completions", json=completion | stream),
            await client.post("/v1/chat/completions", json=chat | stream),
        ]

    whole_completion, whole_chat, streamed_completion, streamed_chat = in_process_calls(
        engine, "tiny", calls
    )
    for response in (whole_completion, whole_chat):
        body = response.json()
        depths = [d for choice in body["choices"] for d in choice["exit_depths"]]
        usage = body["usage"]
        assert usage["completion_tokens"] == len(depths)
        assert usage["completion_loops"] == sum(depths)
        assert usage["mean_loops"] == sum(depths) / len(depths)
        assert min(depths) < 4  # early exits happened: the loops are not tokens x D
    for response in (streamed_completion, streamed_chat):
        events = [e for e in sse_payloads(response.text.splitlines()) if e != "[DONE]"]
        depths = [d for e in events for c in e["choices"] for d in c.get("exit_depths") or []]
        usage = events[-1]["usage"]
        assert usage["completion_tokens"] == len(depths) > 0
        assert usage["completion_loops"] == sum(depths)
