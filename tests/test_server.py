"""The OpenAI-compatible server, end to end, against a real server process.

One server process (tiny seeded checkpoint with a tokenizer, float32, 512 KV blocks of 16)
serves most tests; its outputs must equal the offline `LLM` on the same checkpoint token for
token (batch invariance makes this exact; both sides run one torch thread). A second,
short-lived server checks the SIGTERM shutdown. `AsyncLLM` and the engine-failure paths are
tested in-process in `test_async_engine.py`.
"""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import asyncio
import json
import time

import pytest

from tests.optional import require

require("serve", "openai")
import httpx
import openai
import torch

from loopserve.exit import ExitRule
from loopserve.llm import LLM
from loopserve.reference import prompt_exit_loops
from loopserve.sampling_params import SamplingParams
from tests.server_utils import ServerProcess, metrics, sse_payloads, wait_all_blocks_free

MODEL = "tiny"
NUM_BLOCKS = 512
MAX_BODY_BYTES = 65536
MAX_PENDING = 256
SERVER_FLAGS = [
    "--dtype", "float32", "--num-blocks", str(NUM_BLOCKS), "--block-size", "16",
    "--served-model-name", MODEL, "--max-body-bytes", str(MAX_BODY_BYTES),
    "--max-pending-requests", str(MAX_PENDING), "--log-level", "warning",
]  # fmt: skip
PROMPTS = [
    "The quick brown fox",
    "A looped language model reads a sequence of tokens and predicts the next one.",
    "Q: What is the capital of France?\nA:",
    "Numbers appear everywhere: 0, 1, 2, 3",
    "Good software is simple to read. Write small functions that do one thing. Name things.",
    "Hi",
]


@pytest.fixture(scope="module")
def server(tiny_tok_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    proc = ServerProcess(["--model", str(tiny_tok_dir), *SERVER_FLAGS], log_path)
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def llm(tiny_tok_dir):
    return LLM(model=str(tiny_tok_dir), dtype="float32", num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def reference(llm: LLM, prompts, params) -> list:
    """Offline outputs, computed with one torch thread like the server process."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        torch.set_num_threads(num_threads)


def greedy(max_tokens: int, **extra: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)


# ---- OpenAI client: completions and chat ---------------------------------------------------


def test_completion_matches_offline_engine_token_for_token(client, llm):
    expected = reference(llm, PROMPTS[1], greedy(12, ignore_eos=True))[0]
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[1],
        max_tokens=12,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = response.choices[0]
    assert choice.token_ids == expected.token_ids
    assert choice.text == expected.text
    assert choice.exit_depths == expected.exit_depths
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == 12


def test_sampling_controls_match_the_offline_engine(client, llm):
    """The openai client's own fields (presence/frequency penalty, logit_bias) and vLLM's
    extras (repetition_penalty, min_tokens) reach the engine with their values."""
    params = greedy(
        12, ignore_eos=True, presence_penalty=1.2, frequency_penalty=0.5,
        repetition_penalty=1.3, logit_bias={40: 2.5}, min_tokens=4,
    )  # fmt: skip
    expected = reference(llm, PROMPTS[1], params)[0]
    plain = reference(llm, PROMPTS[1], greedy(12, ignore_eos=True))[0]
    assert expected.token_ids != plain.token_ids  # the controls matter for this prompt
    response = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0.0,
        presence_penalty=1.2, frequency_penalty=0.5, logit_bias={"40": 2.5},
        extra_body={"ignore_eos": True, "return_token_ids": True, "repetition_penalty": 1.3,
                    "min_tokens": 4},
    )  # fmt: skip
    assert response.choices[0].token_ids == expected.token_ids


def test_streaming_completion_concatenates_to_offline_output(client, llm):
    params = greedy(10, exit_threshold=0.5, ignore_eos=True)
    expected = reference(llm, PROMPTS[2], params)[0]
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[2],
        max_tokens=10,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"exit_threshold": 0.5, "ignore_eos": True},
    )
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert [d for c in text_chunks for d in c.choices[0].exit_depths] == expected.exit_depths
    assert min(expected.exit_depths) < 4  # the threshold made some tokens exit early
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_matches_offline_engine_streaming_and_not(client, llm):
    tokenizer = llm.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    params = greedy(16, stop_token_ids=tokenizer.end_of_turn_token_ids)
    expected = reference(llm, [prompt_ids], params)[0]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0.0
    )
    choice = response.choices[0]
    assert response.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.exit_depths == expected.exit_depths
    assert choice.finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == len(prompt_ids)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0.0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert [d for c in chunks for d in c.choices[0].exit_depths] == expected.exit_depths
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_openai_fields_that_ask_nothing_of_generation_are_accepted(client):
    """What OpenAI's SDK and agent frameworks may send beside the prompt (`store`,
    `metadata`, `service_tier`, `safety_identifier`, `prompt_cache_key`) is served, and the
    tokens equal the same request without them."""
    messages = [{"role": "user", "content": "Name a colour."}]
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0.0
    )
    tagged = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0.0, store=False,
        metadata={"session": "s-1", "team": "evals"}, service_tier="auto",
        extra_body={"safety_identifier": "user-hash-1", "prompt_cache_key": "colours"},
    )  # fmt: skip
    assert tagged.choices[0].message.content == plain.choices[0].message.content
    assert tagged.choices[0].exit_depths == plain.choices[0].exit_depths


def test_n2_with_seed_is_reproducible_and_uses_seed_plus_index(client, llm):
    def sample() -> list[str]:
        response = client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=2, seed=7
        )
        return [c.text for c in sorted(response.choices, key=lambda c: c.index)]

    first, second = sample(), sample()
    assert first == second
    expected = [
        reference(llm, PROMPTS[0], SamplingParams(max_tokens=8, seed=seed))[0].text
        for seed in (7, 8)
    ]
    assert first == expected


def test_n8_runs_one_prefill_and_equals_eight_independent_requests(server, client, llm):
    prompt = "Eight samples of one prompt, one prefill: no other test sends this text."
    before = metrics(server.base_url)  # (a prompt of its own: no prefix-cache hit)
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, n=8, seed=40,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    texts = [c.text for c in sorted(response.choices, key=lambda c: c.index)]
    expected = [
        reference(llm, prompt, SamplingParams(max_tokens=6, seed=40 + i, ignore_eos=True))
        for i in range(8)
    ]
    assert texts == [e[0].text for e in expected]
    after = metrics(server.base_url)
    prompt_len = len(expected[0][0].prompt_token_ids)
    loops = "loopserve_prompt_row_loops_total"
    assert after[loops] - before[loops] == prompt_len * 4  # one prefill at the tiny model's D
    forked = "loopserve_forked_requests_total"
    assert after[forked] - before[forked] == 7
    assert response.usage.prompt_tokens == prompt_len  # counted once per prompt, as OpenAI does


def test_batch_prompts_index_choices_per_prompt_times_n(client, llm):
    prompts = [PROMPTS[0], PROMPTS[3]]
    response = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=4, temperature=0.0, n=2, echo=True
    )
    expected = reference(llm, prompts, greedy(4))
    texts = {c.index: c.text for c in response.choices}
    assert texts == {
        0: prompts[0] + expected[0].text,
        1: prompts[0] + expected[0].text,
        2: prompts[1] + expected[1].text,
        3: prompts[1] + expected[1].text,
    }
    prompt_tokens = sum(len(e.prompt_token_ids) for e in expected)
    assert response.usage.prompt_tokens == prompt_tokens


def test_logprobs_report_chosen_token_and_alternatives(client, llm):
    expected = reference(llm, PROMPTS[0], greedy(5, logprobs=3, ignore_eos=True))[0]
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=5,
        temperature=0.0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs])
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.base_url + "/v1/models/other").status_code == 404
    assert httpx.get(server.base_url + "/health").status_code == 200
    client.completions.create(
        model=MODEL, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True}
    )
    values = metrics(server.base_url)
    assert values["loopserve_kv_blocks_total"] == NUM_BLOCKS
    assert values["loopserve_ready"] == 1
    assert values["loopserve_generation_tokens_total"] > 0
    assert values['loopserve_requests_finished_total{finish_reason="length"}'] > 0
    assert values['loopserve_time_to_first_token_seconds_bucket{le="+Inf"}'] > 0
    assert 1.0 <= values["loopserve_mean_loops_per_token"] <= 4.0


def test_repeated_prompt_reports_cached_tokens_in_usage_and_metrics(server, client):
    prompt = "a system prompt long enough to fill two blocks of sixteen tokens, " * 2
    hits_before = metrics(server.base_url)["loopserve_prefix_cache_hits_total"]
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 32
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Whole blocks of 16, never the last prompt position.
    assert cached == (second.usage.prompt_tokens - 1) // 16 * 16
    values = metrics(server.base_url)
    assert values["loopserve_prefix_cache_hits_total"] - hits_before == cached
    assert values['loopserve_preemptions_total{mode="recompute"}'] == 0


def test_scored_prompt_positions_and_their_loops_are_counted_in_metrics(server, llm):
    before = metrics(server.base_url)
    body = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog", "echo": True,
            "logprobs": 0, "max_tokens": 0, "exit_threshold": 0.5,
            "prompt_logprobs_loop": "exit"}  # fmt: skip
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    depths = response.json()["choices"][0]["prompt_exit_depths"][1:]
    # the loops the exit rule picks per position, from the dense oracle
    prompt_ids = llm.engine.tokenizer.encode(body["prompt"])
    assert depths == prompt_exit_loops(llm.engine.model, prompt_ids, ExitRule(1, 4, 0.5))
    values = metrics(server.base_url)  # the snapshot is taken after every step
    positions = values["loopserve_prompt_positions_scored_total"]
    loops = values["loopserve_prompt_scored_loops_total"]
    assert positions - before["loopserve_prompt_positions_scored_total"] == len(depths)
    assert loops - before["loopserve_prompt_scored_loops_total"] == sum(depths)


# ---- load ----------------------------------------------------------------------------------


def load_case(i: int) -> tuple[str, SamplingParams, dict]:
    """Request i of the load test: mixed prompts, lengths, stops and seeded sampling."""
    prompt = PROMPTS[i % len(PROMPTS)] * (1 + i % 3)
    max_tokens = (3, 9, 17, 30)[i % 4]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    if i % 5 == 0:
        body |= {"temperature": 0.8, "seed": 1000 + i}
        params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1000 + i)
    else:
        body |= {"temperature": 0.0, "ignore_eos": i % 2 == 0}
        params = greedy(max_tokens, ignore_eos=i % 2 == 0)
    return prompt, params, body


async def stream_completion(client: httpx.AsyncClient, body: dict) -> tuple[str, list[int]]:
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        events = sse_payloads([line async for line in response.aiter_lines()])
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    assert chunks[-1]["finish_reason"] in ("stop", "length")
    return "".join(c["text"] for c in chunks), [d for c in chunks for d in c["exit_depths"]]


def test_64_concurrent_streams_match_offline_and_free_every_block(server, llm):
    cases = [load_case(i) for i in range(64)]
    expected = reference(llm, [c[0] for c in cases], [c[1] for c in cases])

    async def run() -> list[tuple[str, list[int]]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60.0, limits=limits) as c:
            return await asyncio.gather(*(stream_completion(c, case[2]) for case in cases))

    results = asyncio.run(run())
    for (text, depths), want in zip(results, expected):
        assert text == want.text
        assert depths == want.exit_depths
    values = wait_all_blocks_free(server.base_url)
    assert values["loopserve_num_requests_waiting"] == 0


# ---- errors --------------------------------------------------------------------------------

GOOD = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_INPUTS = {
    "malformed_json": ("/v1/completions", b'{"prompt": "x",', 400, None),
    "not_an_object": ("/v1/completions", [1, 2], 400, None),
    "wrong_type": ("/v1/completions", GOOD | {"max_tokens": "16"}, 400, "max_tokens"),
    "prompt_wrong_type": ("/v1/completions", GOOD | {"prompt": 5}, 400, "prompt"),
    "negative_max_tokens": ("/v1/completions", GOOD | {"max_tokens": -1}, 400, "max_tokens"),
    "negative_temperature": ("/v1/completions", GOOD | {"temperature": -0.5}, 400, "temperature"),
    "top_p_out_of_range": ("/v1/completions", GOOD | {"top_p": 1.5}, 400, "top_p"),
    "max_loops_over_depth": ("/v1/completions", GOOD | {"max_loops": 9}, 400, "max_loops"),
    "oversize_prompt": ("/v1/completions", GOOD | {"prompt": [5] * 3000}, 400, "max_tokens"),
    "unknown_model": ("/v1/completions", GOOD | {"model": "gpt-4"}, 404, "model"),
    "huge_body": ("/v1/completions", GOOD | {"prompt": "x" * (2 * MAX_BODY_BYTES)}, 413, None),
    "unsupported_field": ("/v1/completions", GOOD | {"best_of": 2}, 400, "best_of"),
    "penalty_out_of_range": (
        "/v1/completions",
        GOOD | {"presence_penalty": 2.5},
        400,
        "presence_penalty",
    ),  # fmt: skip
    "repetition_penalty_zero": (
        "/v1/completions",
        GOOD | {"repetition_penalty": 0.0},
        400,
        "repetition_penalty",
    ),  # fmt: skip
    "logit_bias_key_not_a_token_id": (
        "/v1/completions",
        GOOD | {"logit_bias": {"hello": 1.0}},
        400,
        "logit_bias",
    ),  # fmt: skip
    # D11: Unicode digits passed str.isdigit() ("١٢" was read as 12), a 5,000-digit key
    # overflowed int(), and a penalty of 1e-300 is 0 in float32: each was a 500.
    "logit_bias_superscript_digit": (
        "/v1/completions",
        GOOD | {"logit_bias": {"\u00b2": 1.0}},
        400,
        "logit_bias",
    ),
    "logit_bias_arabic_indic_digits": (
        "/v1/completions",
        GOOD | {"logit_bias": {"\u0661\u0662": 1.0}},
        400,
        "logit_bias",
    ),
    "logit_bias_5000_digit_key": (
        "/v1/completions",
        GOOD | {"logit_bias": {"9" * 5000: 1.0}},
        400,
        "logit_bias",
    ),
    "repetition_penalty_below_float32": (
        "/v1/completions",
        GOOD | {"repetition_penalty": 1e-300},
        400,
        "repetition_penalty",
    ),
    "logit_bias_outside_vocabulary": (
        "/v1/completions",
        GOOD | {"logit_bias": {"99999999": 1.0}},
        400,
        "logit_bias",
    ),  # fmt: skip
    "min_tokens_over_max_tokens": (
        "/v1/completions",
        GOOD | {"min_tokens": 500},
        400,
        "min_tokens",
    ),  # fmt: skip
    "empty_messages": ("/v1/chat/completions", CHAT | {"messages": []}, 400, "messages"),
    "bad_role": (
        "/v1/chat/completions",
        CHAT | {"messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages",
    ),
    "tools_empty": ("/v1/chat/completions", CHAT | {"tools": []}, 400, "tools"),
    "chat_unknown_model": ("/v1/chat/completions", CHAT | {"model": "x"}, 404, "model"),
    # Item 4: more sequences than can ever be in flight is a 400 naming the limit, not a 429.
    "never_admissible": ("/v1/completions", GOOD | {"prompt": ["a"] * 5, "n": 64}, 400, "n"),
    # Item 1: seeds torch cannot take are rejected at submission (they used to fail the step).
    "seed_over_2_64": ("/v1/completions", GOOD | {"seed": 2**64, "temperature": 1.0}, 400, "seed"),
    "seed_under_minus_2_63": ("/v1/completions", GOOD | {"seed": -(2**63) - 1}, 400, "seed"),
    "seed_plus_n_overflows": ("/v1/completions", GOOD | {"seed": 2**64 - 1, "n": 2}, 400, "seed"),
    "chat_seed_over_2_64": ("/v1/chat/completions", CHAT | {"seed": 2**64}, 400, "seed"),
    # Item 9: priority needs --allow-client-priority.
    "priority_not_allowed": ("/v1/completions", GOOD | {"priority": -5}, 400, "priority"),
    # Accepted OpenAI fields, with what this server cannot do refused by name.
    "store_true": ("/v1/chat/completions", CHAT | {"store": True}, 400, "store"),
    "service_tier_flex": ("/v1/chat/completions", CHAT | {"service_tier": "flex"}, 400,
                          "service_tier"),
    "metadata_17_pairs": ("/v1/chat/completions",
                          CHAT | {"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
    "metadata_long_value": ("/v1/chat/completions", CHAT | {"metadata": {"k": "v" * 513}}, 400,
                            "metadata"),
    "metadata_not_a_string": ("/v1/chat/completions", CHAT | {"metadata": {"k": 5}}, 400,
                              "metadata"),
}  # fmt: skip
# Item 8: (path, body, headers, status, code), sent with these headers instead of JSON ones.
BAD_HEADERS = {
    "text_plain_body": ("/v1/completions", GOOD, {"content-type": "text/plain"}, 415, None),
    "form_body": (
        "/v1/chat/completions",
        CHAT,
        {"content-type": "application/x-www-form-urlencoded"},
        415,
        None,
    ),
    "no_content_type": ("/v1/completions", GOOD, {}, 415, None),
    "rebound_host": (
        "/v1/completions",
        GOOD,
        {"content-type": "application/json", "host": "evil.example:8000"},
        400,
        "host_not_allowed",
    ),
    "rebound_host_get": ("/v1/models", None, {"host": "attacker.test"}, 400, "host_not_allowed"),
}


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gets_status_and_openai_error_shape(server, case):
    path, body, status, param = BAD_INPUTS[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    response = httpx.post(server.base_url + path, content=content, headers=headers, timeout=30.0)
    error = assert_openai_error(response, status)
    if param is not None:
        assert error["param"] == param
    assert httpx.get(server.base_url + "/health").status_code == 200


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_bad_headers_get_status_and_openai_error_shape(server, case):
    path, body, headers, status, code = BAD_HEADERS[case]
    with httpx.Client(base_url=server.base_url, timeout=30.0) as http:
        if body is None:
            request = http.build_request("GET", path)
        else:
            request = http.build_request("POST", path, content=json.dumps(body).encode())
        request.headers.pop("content-type", None)
        request.headers.update(headers)
        response = http.send(request)
    error = assert_openai_error(response, status)
    if code is not None:
        assert error["code"] == code
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_a_large_seed_still_samples_like_its_torch_equivalent(client):
    """2**64 - 1 and -1 are the same torch seed, and both are accepted."""
    texts = [
        client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=seed
        )
        .choices[0]
        .text
        for seed in (2**64 - 1, -1)
    ]
    assert texts[0] == texts[1]


def test_models_endpoint_has_no_cors_headers_without_allowed_origins(server):
    response = httpx.get(
        server.base_url + "/v1/models", headers={"origin": "https://evil.example"}, timeout=10.0
    )
    assert response.status_code == 200
    assert "access-control-allow-origin" not in response.headers


STREAMS = {  # endpoint -> a long streamed request, and what its first generated text's line has
    "/v1/completions": (GOOD | {"max_tokens": 1500, "ignore_eos": True, "stream": True}, '"text"'),
    # Greedy: sampled, the demo model may end at once (these APIs have no ignore_eos). The
    # first generated text's line, not `response.created`, which goes out before the engine
    # schedules the request.
    "/v1/responses": (
        {"model": MODEL, "input": "hi", "max_output_tokens": 1500, "stream": True, "temperature": 0},
        '"response.output_text.delta"',
    ),
    "/v1/messages": (
        {"model": MODEL, "max_tokens": 1500, "stream": True, "temperature": 0,
         "messages": [{"role": "user", "content": "hi"}]},
        '"text_delta"',
    ),
}  # fmt: skip


@pytest.mark.parametrize("path", sorted(STREAMS))
def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server, path):
    aborted_before = metrics(server.base_url)[
        'loopserve_requests_finished_total{finish_reason="abort"}'
    ]
    body, generated = STREAMS[path]
    with httpx.stream("POST", server.base_url + path, json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:") and generated in line)
        held = metrics(server.base_url)
        assert held["loopserve_kv_blocks_free"] < NUM_BLOCKS
    values = wait_all_blocks_free(server.base_url)
    assert values['loopserve_requests_finished_total{finish_reason="abort"}'] == aborted_before + 1


# ---- shutdown ------------------------------------------------------------------------------


def test_sigterm_finishes_or_aborts_in_flight_and_exits_zero(tiny_tok_dir, tmp_path):
    shutdown_timeout_s = 2.0
    flags = [*SERVER_FLAGS, "--shutdown-timeout-s", str(shutdown_timeout_s)]
    proc = ServerProcess(["--model", str(tiny_tok_dir), *flags], tmp_path / "server.log")
    try:
        proc.wait_healthy()
        body = GOOD | {"max_tokens": 1900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", proc.base_url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            proc.terminate()
            try:  # new work is refused: the socket is closed, or the engine answers 503
                late = httpx.post(proc.base_url + "/v1/completions", json=GOOD, timeout=5)
                assert late.status_code == 503, late.text
            except httpx.TransportError:
                pass
            events = sse_payloads(list(lines))  # finished in time, or aborted at the timeout
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] in ("length", "abort")
        # the wait bounds how long a hung shutdown may hold the test; no speed is asserted
        returncode = proc.process.wait(timeout=shutdown_timeout_s + 15)
    finally:
        proc.stop()
    assert returncode == 0, proc.log()


# ---- payloads mainstream benchmark clients send (guidellm, vllm bench serve) -------------

# guidellm 0.8.x's OpenAI backend and `vllm bench serve` always send these stream options;
# `vllm bench serve` also sends the neutral repetition penalty.
STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
CLIENT_PAYLOADS = {
    "guidellm-completions": (
        "/v1/completions",
        {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "stream": True,
         "stream_options": STREAM_OPTIONS, "ignore_eos": True},
    ),
    "guidellm-chat": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[2]}],
         "max_completion_tokens": 6, "stream": True, "stream_options": STREAM_OPTIONS,
         "ignore_eos": True},
    ),
    "vllm-bench-completions": (
        "/v1/completions",
        {"model": MODEL, "prompt": PROMPTS[3], "temperature": 0.0, "repetition_penalty": 1.0,
         "max_tokens": 6, "stream": True, "stream_options": STREAM_OPTIONS, "ignore_eos": True},
    ),
    "guidellm-completions-no-stream": (
        "/v1/completions",
        {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "ignore_eos": True},
    ),
    "guidellm-chat-no-stream": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[2]}],
         "max_completion_tokens": 6, "ignore_eos": True},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CLIENT_PAYLOADS))
def test_benchmark_client_payloads_are_served_with_usage_in_every_chunk(server, name):
    path, payload = CLIENT_PAYLOADS[name]
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        response = http.post(path, json=payload)
    assert response.status_code == 200, response.text
    if not payload.get("stream"):
        body = response.json()
        assert body["usage"]["completion_tokens"] == 6
        return
    events = sse_payloads(response.text.splitlines())
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    content = [
        c
        for c in chunks
        if c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content")
    ]
    assert content, "no content was streamed"
    # continuous_usage_stats: every content chunk carries the choice's usage so far.
    counts = [c["usage"]["completion_tokens"] for c in content]
    assert all(c["usage"]["prompt_tokens"] > 0 for c in content)
    assert counts == sorted(counts) and counts[-1] <= 6
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 6
    if "chat" in name:  # the role comes once, in the first delta; never "role": null
        deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
        assert deltas[0]["role"] == "assistant"
        assert all("role" not in delta for delta in deltas[1:])


def test_chat_max_completion_tokens_zero_is_a_400_not_unlimited(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 0}  # fmt: skip
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert "max_tokens" in response.json()["error"]["message"]


def test_a_rejected_request_is_logged_with_its_reason(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                       "bogus_field_for_the_log": 1})  # fmt: skip
    assert response.status_code == 400
    deadline = time.monotonic() + 10
    while "bogus_field_for_the_log" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    line = next(x for x in server.log().splitlines() if "bogus_field_for_the_log" in x)
    assert "/v1/completions -> 400: unsupported field" in line
