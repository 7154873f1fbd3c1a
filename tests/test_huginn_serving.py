"""Huginn behind the OpenAI server (in-process ASGI): completions and streamed chat return
what the engine returns directly (text, tokens, steps per token in `exit_depths`), a
request's `max_loops` and `exit_threshold` extension fields reach the criterion, and
/metrics counts the requests."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import asyncio
import json

import pytest

from tests.optional import require

require("serve")

from loopserve.engine.llm_engine import LLMEngine
from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopserve.sampling_params import SamplingParams
from tests.engine_utils import run_steps
from tests.server_utils import in_process_calls

ENGINE_ARGS = dict(dtype="float32", num_blocks=256, block_size=4, exit_criterion="kl")


@pytest.fixture(scope="module")
def huginn_tok_dir(tmp_path_factory):
    return make_tiny_huginn_checkpoint(
        tmp_path_factory.mktemp("huginn_serve"), vocab_size=512, with_tokenizer=True
    )


@pytest.mark.parametrize("criterion, threshold", [("kl", 0.3), ("latent-diff", 0.6)])
def test_completions_and_streamed_chat_return_the_engines_tokens_and_steps(
    huginn_tok_dir, criterion, threshold
):
    """kl: leaves at exits; latent-diff: leaves batched in time (auto), counted in /metrics."""
    args = {**ENGINE_ARGS, "exit_criterion": criterion}
    direct_engine = LLMEngine.from_engine_args(model=str(huginn_tok_dir), **args)
    prompt_ids = direct_engine.tokenizer.encode("Once upon a time")
    params = SamplingParams(max_tokens=8, temperature=0.0, exit_threshold=threshold, max_loops=6,
                            ignore_eos=True)  # fmt: skip
    direct = run_steps(direct_engine, [("d", prompt_ids, params, 0)])["d"]
    assert max(direct.exit_depths) <= 6 and min(direct.exit_depths) < 6

    completion = {"model": "huginn", "prompt": prompt_ids, "max_tokens": 8, "temperature": 0,
                  "exit_threshold": threshold, "max_loops": 6, "ignore_eos": True}  # fmt: skip
    chat = {"model": "huginn", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 6, "temperature": 0.8, "seed": 5, "stream": True,
            "exit_threshold": threshold}  # fmt: skip

    async def calls(client):
        plain, streamed = await asyncio.gather(
            client.post("/v1/completions", json=completion, timeout=60),
            client.post("/v1/chat/completions", json=chat, timeout=60),
        )
        metrics = await client.get("/metrics")
        return plain, streamed, metrics

    engine = LLMEngine.from_engine_args(model=str(huginn_tok_dir), **args)
    assert engine.scheduler.rules.defers_leave == (criterion == "latent-diff")
    plain, streamed, metrics = in_process_calls(engine, "huginn", calls)
    assert plain.status_code == 200, plain.text
    choice = plain.json()["choices"][0]
    assert choice["text"] == direct.text
    assert choice["exit_depths"] == direct.exit_depths
    assert streamed.status_code == 200, streamed.text
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    depths = [d for c in chunks for ch in c["choices"] for d in ch.get("exit_depths") or []]
    assert len(depths) == 6 and all(1 <= d <= 8 for d in depths)
    finished = [
        line for line in metrics.text.splitlines()
        if line.startswith('loopserve_requests_finished_total{finish_reason="length"}')
    ]  # fmt: skip
    assert finished and float(finished[0].split()[-1]) == 2.0
    batches = [line for line in metrics.text.splitlines()
               if line.startswith("loopserve_leave_batches_total")]  # fmt: skip
    assert (float(batches[0].split()[-1]) > 0) == (criterion == "latent-diff")
