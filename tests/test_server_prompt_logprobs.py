"""lm-eval's `local-completions` payloads against the server: loglikelihood (and rolling)
requests are scored prompts (`echo` + `logprobs`, `max_tokens` 1), their values equal to the
dense reference's; a score-only request (`max_tokens` 0 with `echo`) returns the prompt
alone; generate_until works alongside."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import asyncio
import math
from functools import partial

import pytest

from tests.optional import require

require("serve")
import httpx

from loopserve.engine.async_llm import AsyncLLM
from loopserve.engine.llm_engine import LLMEngine
from loopserve.reference import prompt_exit_loops, prompt_logprob_rows, prompt_logprobs
from loopserve.server.api_server import build_app

approx = partial(pytest.approx, abs=1e-4)


def _post_all(tiny_tok_dir, bodies, path="/v1/completions", **app_options):
    """Each body posted to `path`, or to its own path given as a (path, body) pair."""
    engine = LLMEngine.from_engine_args(
        model=str(tiny_tok_dir), dtype="float32", num_blocks=64, prefill_chunk_size=8
    )

    async def main():
        async_llm = AsyncLLM(engine)
        async_llm.start()
        assert await async_llm.wait_ready(timeout_s=30)
        transport = httpx.ASGITransport(app=build_app(async_llm, "tiny", **app_options))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                posts = [b if isinstance(b, tuple) else (path, b) for b in bodies]
                return await asyncio.gather(
                    *(client.post(p, json=body, timeout=60) for p, body in posts)
                )
        finally:
            await async_llm.shutdown(1.0)

    return engine, asyncio.run(main())


def _lm_eval_parse(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval's `LocalCompletionsAPI.parse_logprobs` for one choice, as it reads it."""
    logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
    tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs))
    return logprobs, is_greedy


def test_lm_eval_loglikelihood_payloads_match_the_dense_reference(tiny_tok_dir):
    contexts = [[17, 250, 3, 99, 41, 7, 300, 12, 88], [5, 6, 7, 8], [44, 1, 250, 250, 8, 91]]
    continuations = [[61, 140, 9], [100], [3, 14, 15, 92, 65]]
    requests = [c + x for c, x in zip(contexts, continuations)]
    loglikelihood = {  # lm-eval's payload for loglikelihood, batched, token-id prompts
        "model": "tiny", "prompt": requests, "temperature": 0, "max_tokens": 1,
        "logprobs": 1, "seed": 1234, "echo": True,
    }  # fmt: skip
    rolling = dict(loglikelihood, prompt=[requests[0]])  # loglikelihood_rolling: same shape
    generate_until = {
        "model": "tiny", "prompt": [contexts[0]], "max_tokens": 8, "temperature": 0,
        "stop": ["\n"], "seed": 1234,
    }  # fmt: skip
    engine, (scored, rolled, generated) = _post_all(
        tiny_tok_dir, [loglikelihood, rolling, generate_until]
    )
    assert scored.status_code == 200, scored.text
    choices = sorted(scored.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 3
    for choice, tokens, ctxlen in zip(choices, requests, map(len, contexts)):
        expected = prompt_logprobs(engine.model, tokens)
        got = choice["logprobs"]["token_logprobs"]
        assert len(got) == len(tokens) + 1 and got[0] is None  # prompt + the one new token
        assert choice["logprobs"]["top_logprobs"][0] is None
        for value, want in zip(got[1 : len(tokens)], expected[1:]):
            assert math.isclose(value, want, abs_tol=1e-4)
        total, _ = _lm_eval_parse(choice, ctxlen)
        assert math.isclose(total, sum(expected[ctxlen:]), abs_tol=1e-3)
        assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])
    rolled_choice = rolled.json()["choices"][0]
    assert rolled_choice["logprobs"]["token_logprobs"][1:-1] == approx(
        choices[0]["logprobs"]["token_logprobs"][1:-1]
    )
    assert generated.status_code == 200 and generated.json()["choices"][0]["logprobs"] is None


def test_score_only_returns_the_prompt_alone(tiny_tok_dir):
    body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 0, "echo": True,
            "logprobs": 0}  # fmt: skip
    no_echo = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 0}
    engine, (scored, refused) = _post_all(tiny_tok_dir, [body, no_echo])
    assert scored.status_code == 200, scored.text
    choice = scored.json()["choices"][0]
    prompt_ids = engine.tokenizer.encode("the quick brown fox")
    assert choice["text"] == "the quick brown fox"
    assert len(choice["logprobs"]["token_logprobs"]) == len(prompt_ids)
    assert scored.json()["usage"]["completion_tokens"] == 0
    assert scored.json()["usage"]["prompt_tokens"] == len(prompt_ids)
    expected = prompt_logprobs(engine.model, prompt_ids)
    assert choice["logprobs"]["token_logprobs"][1:] == approx(expected[1:])
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def _check_vllm_entries(engine, entries, prompt_ids, top):
    """vLLM's `prompt_logprobs` against the dense reference: per prompt token after the first,
    the token's logprob and rank, and the `top` most likely tokens with ranks 1..top."""
    rows = prompt_logprob_rows(engine.model, prompt_ids)
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for p, entry in enumerate(entries[1:]):
        row, token = rows[p], prompt_ids[p + 1]
        best = row.topk(top).indices.tolist() if top else []
        assert set(entry) == {str(token), *map(str, best)}
        assert entry[str(token)]["logprob"] == approx(float(row[token]))
        assert entry[str(token)]["rank"] == 1 + int((row > row[token]).sum())
        for rank, token_id in enumerate(best, start=1):
            assert entry[str(token_id)]["rank"] == rank
            assert entry[str(token_id)]["logprob"] == approx(float(row[token_id]))
            assert entry[str(token_id)]["decoded_token"] == engine.tokenizer.decode(
                [token_id], skip_special_tokens=False
            )


def test_vllm_prompt_logprobs_field_on_completions_and_chat(tiny_tok_dir):
    prompt = [17, 250, 3, 99, 41, 7, 300, 12, 88]
    field = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0,
             "prompt_logprobs": 3}  # fmt: skip
    with_echo = dict(field, echo=True, logprobs=1)  # both shapes, each with its own width
    messages = [{"role": "user", "content": "the quick brown fox"}]
    chat = {"model": "tiny", "messages": messages, "max_tokens": 2, "prompt_logprobs": 0}
    plain = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    engine, (scored, echoed, chatted, neither, streamed, too_many) = _post_all(
        tiny_tok_dir,
        [
            field,
            with_echo,
            ("/v1/chat/completions", chat),
            plain,
            dict(field, stream=True),
            dict(field, prompt_logprobs=21),
        ],
    )
    assert scored.status_code == echoed.status_code == chatted.status_code == 200
    choice = scored.json()["choices"][0]
    _check_vllm_entries(engine, choice["prompt_logprobs"], prompt, 3)
    assert choice["logprobs"] is None  # the legacy shape only with echo + logprobs
    echo_choice = echoed.json()["choices"][0]
    _check_vllm_entries(engine, echo_choice["prompt_logprobs"], prompt, 3)
    legacy_tops = echo_choice["logprobs"]["top_logprobs"]
    assert legacy_tops[0] is None and all(len(top) == 1 for top in legacy_tops[1:])
    chat_ids = engine.input_processor.process_chat(messages).token_ids
    body = chatted.json()
    assert body["usage"]["prompt_tokens"] == len(chat_ids)
    _check_vllm_entries(engine, body["prompt_logprobs"], list(chat_ids), 0)
    assert neither.json()["choices"][0]["prompt_logprobs"] is None
    for refused in (streamed, too_many):
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "prompt_logprobs"


def test_prompt_scored_at_the_exit_rules_loops_through_the_api(tiny_tok_dir):
    from loopserve.exit import ExitRule

    prompt = [17, 250, 3, 99, 41, 7, 300, 12, 88, 5, 61, 140, 9, 33, 2, 71, 8, 19, 27]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0,
            "exit_threshold": 0.5, "prompt_logprobs_loop": "exit"}  # fmt: skip
    engine, (at_exit, at_last, bad) = _post_all(
        tiny_tok_dir,
        [body, dict(body, prompt_logprobs_loop="last"), dict(body, prompt_logprobs_loop="first")],
    )
    rule = ExitRule(1, engine.model.num_loops, 0.5)
    for response, expected in (
        (at_exit, prompt_logprobs(engine.model, prompt, exit_rule=rule)),
        (at_last, prompt_logprobs(engine.model, prompt)),
    ):
        assert response.status_code == 200, response.text
        got = response.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert got[0] is None and got[1:] == approx(expected[1:])
    exit_values = at_exit.json()["choices"][0]["logprobs"]["token_logprobs"][1:]
    last_values = at_last.json()["choices"][0]["logprobs"]["token_logprobs"][1:]
    assert exit_values != approx(last_values)  # the threshold moves some positions' loops
    # Each choice says which loop scored each prompt token.
    loops = prompt_exit_loops(engine.model, prompt, rule)
    assert at_exit.json()["choices"][0]["prompt_exit_depths"] == [None, *loops]
    depth = engine.model.num_loops
    assert at_last.json()["choices"][0]["prompt_exit_depths"] == [None] + [depth] * len(loops)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs_loop"


def test_request_defaults_let_an_unchanged_client_score_at_the_exit_loops(tiny_tok_dir):
    from loopserve.exit import ExitRule

    prompt = [17, 250, 3, 99, 41, 7, 300, 12, 88, 5, 61, 140, 9, 33, 2, 71, 8, 19, 27]
    lm_eval = {"model": "tiny", "prompt": [prompt], "temperature": 0, "max_tokens": 1,
               "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip
    defaults = {"exit_threshold": 0.5, "prompt_logprobs_loop": "exit"}
    engine, (plain, overridden) = _post_all(
        tiny_tok_dir,
        [lm_eval, dict(lm_eval, prompt_logprobs_loop="last")],  # the client's own value wins
        request_defaults=defaults,
    )
    rule = ExitRule(1, engine.model.num_loops, 0.5)
    at_exit = prompt_logprobs(engine.model, prompt, exit_rule=rule)
    at_last = prompt_logprobs(engine.model, prompt)
    got = plain.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert got[1 : len(prompt)] == approx(at_exit[1:]) and at_exit != approx(at_last)
    got = overridden.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert got[1 : len(prompt)] == approx(at_last[1:])


@pytest.mark.parametrize(
    "text",
    ['{"temperature": 0.5}', '{"exit_threshold": 2}', '[1]', "not json",
     '{"prompt_logprobs_loop": "middle"}'],
)  # fmt: skip
def test_bad_request_defaults_are_a_usage_error(text):
    import argparse

    from loopserve.server.args import add_server_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--request-defaults", text])
    assert info.value.code == 2
    good = parser.parse_args(["--request-defaults", '{"exit_threshold": 0.6, "min_loops": 2}'])
    assert good.request_defaults == {"exit_threshold": 0.6, "min_loops": 2}
