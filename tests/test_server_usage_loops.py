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


def test_metrics_count_the_loops_the_responses_report_and_speak_vllms_names(tiny_tok_dir):
    """/metrics: `loopserve_exit_depth` (a histogram of loops per output token) and
    `loopserve_generation_loops_total` equal the responses' exit depths, and
    `loopserve_rows_per_call{stage}` counts every sampled token once in its coda stage; the `vllm:` families
    a stock vLLM dashboard queries are there, with vLLM's types and the served model name."""
    from prometheus_client.parser import text_string_to_metric_families

    engine = LLMEngine.from_engine_args(model=str(tiny_tok_dir), dtype="float32", num_blocks=64)
    body = {"model": "tiny", "prompt": "a red fox", "max_tokens": 9, "temperature": 0.7,
            "seed": 3, "exit_threshold": 0.5, "ignore_eos": True, "n": 3}  # fmt: skip

    async def calls(client):
        response = await client.post("/v1/completions", json=body)
        return response, await client.get("/metrics")

    response, scraped = in_process_calls(engine, "tiny", calls)
    depths = [d for choice in response.json()["choices"] for d in choice["exit_depths"]]
    families = {f.name: f for f in text_string_to_metric_families(scraped.text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}  # fmt: skip
    assert samples[("loopserve_generation_loops_total", ())] == sum(depths)
    assert samples[("loopserve_exit_depth_count", ())] == len(depths)
    assert samples[("loopserve_exit_depth_sum", ())] == sum(depths)
    for le in (1, 2, 3, 4):
        expected = sum(d <= le for d in depths)
        assert samples[("loopserve_exit_depth_bucket", (("le", f"{float(le)}"),))] == expected
    assert 0 < samples[("loopserve_exit_depth_bucket", (("le", "3.0"),))] < len(depths)
    # Rows per call by stage: the coda sampled every output token once; core calls ran.
    assert families["loopserve_rows_per_call"].type == "histogram"
    assert samples[("loopserve_rows_per_call_sum", (("stage", "coda"),))] == len(depths)
    assert samples[("loopserve_rows_per_call_count", (("stage", "core"),))] > 0
    assert samples[("loopserve_rows_per_call_sum", (("stage", "prelude"),))] >= len(depths)
    model = (("model_name", "tiny"),)
    kinds = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:gpu_cache_usage_perc": "gauge",
        "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
        "vllm:time_per_output_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
    }  # fmt: skip
    for name, kind in kinds.items():
        assert families[name].type == kind, name
    assert samples[("vllm:generation_tokens_total", model)] == len(depths)
    prompt_tokens = response.json()["usage"]["prompt_tokens"]  # the one prompt, 3 samples
    assert samples[("vllm:prompt_tokens_total", model)] == 3 * prompt_tokens > 0
    finished = (("finished_reason", "length"), ("model_name", "tiny"))
    assert samples[("vllm:request_success_total", finished)] == 3
    assert samples[("vllm:time_to_first_token_seconds_count", model)] == 3
    assert 0 <= samples[("vllm:kv_cache_usage_perc", model)] <= 1
