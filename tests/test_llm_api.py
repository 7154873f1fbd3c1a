"""The offline API and CLI: prompts in, ordered RequestOutputs out; stops and logprobs."""

from __future__ import annotations

import json

import pytest

from loopserve import LLM, SamplingParams
from loopserve.cli.main import main
from loopserve.errors import InvalidRequestError
from loopserve.reference import generate


@pytest.fixture(scope="module")
def llm(tiny_tok_dir):
    return LLM(str(tiny_tok_dir), dtype="float32", num_blocks=256, block_size=8)


def test_generate_returns_outputs_in_input_order_for_text_and_token_prompts(llm):
    params = SamplingParams(max_tokens=6, temperature=0, exit_threshold=0.5)
    prompts = ["hello world", [5, 6, 7], "the cat"]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == ["hello world", None, "the cat"]
    for output in outputs:
        ref = generate(
            llm.engine.model,
            output.prompt_token_ids,
            params,
            eos_token_ids=sorted(llm.engine.eos_token_ids),
        )
        assert (output.token_ids, output.exit_depths) == (ref.token_ids, ref.exit_depths)
        assert output.text == llm.tokenizer.decode(output.token_ids)
        assert output.metrics.ttft_s is not None and output.metrics.e2e_s >= output.metrics.ttft_s


def test_stop_string_ends_request_and_is_excluded_from_text(llm):
    free = llm.generate(
        "once upon", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False
    )[0]
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"need a visible stop string, text was {text!r}"
    stopped = llm.generate(
        "once upon",
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop
    assert stopped.text == text[: text.index(stop)]
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]


def test_stop_token_ids_and_max_tokens_set_finish_reason(llm):
    free = llm.generate(
        [1, 2, 3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False
    )[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 5
    stop_id = free.token_ids[2]
    out = llm.generate(
        [1, 2, 3],
        SamplingParams(max_tokens=5, temperature=0, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_id
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]


def test_logprobs_return_chosen_token_and_alternatives(llm):
    out = llm.generate(
        [4, 5], SamplingParams(max_tokens=3, temperature=0, logprobs=3), use_tqdm=False
    )[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token and lp.logprob <= 0
        assert len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0][0] == token  # greedy picks the most likely token


def test_bad_prompt_batch_leaves_engine_clean(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", [10**9]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats.kv_blocks_used == 0


def test_cli_generate_prints_json_with_exit_depths(tiny_tok_dir, capsys):
    code = main(["generate", "--model", str(tiny_tok_dir), "--dtype", "float32", "--num-blocks", "128",
                 "--prompt", "hi", "--prompt-token-ids", "1,2,3", "--max-tokens", "4", "--json",
                 "--exit-threshold", "0.5", "--no-progress"])  # fmt: skip
    assert code == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records] == ["hi", None]
    assert all(len(r["exit_depths"]) == len(r["token_ids"]) for r in records)


def test_cli_reports_user_errors_without_traceback(tiny_tok_dir, capsys):
    code = main(
        [
            "generate",
            "--model",
            str(tiny_tok_dir),
            "--max-loops",
            "9",
            "--no-progress",
            "--num-blocks",
            "64",
        ]
    )
    assert code == 2
    assert "max_loops" in capsys.readouterr().err


def test_num_loops_runs_an_ouro_checkpoint_at_another_depth(tiny_dir):
    """`num_loops=3` runs the 4-loop checkpoint at D = 3: three planes per position, no token
    past 3 loops, outputs equal the dense reference of the same weights at that depth; 0 is
    refused by name."""
    from loopserve.errors import ConfigError
    from loopserve.models.loader import load_model
    from tests.engine_utils import make_engine, run_steps

    engine = make_engine(tiny_dir, num_loops=3)
    assert engine.num_loops == 3 and engine.kv.num_planes == 3
    prompts = [[5, 17, 99, 3], [42, 7, 8, 9, 10, 11, 1]]
    params = SamplingParams(max_tokens=10, temperature=0.0, exit_threshold=0.9, ignore_eos=True)
    finished = run_steps(engine, [(f"o{i}", p, params, i) for i, p in enumerate(prompts)])
    shallow = load_model(tiny_dir, dtype="float32", num_loops=3)  # independent of the engine
    depths = []
    for i, prompt in enumerate(prompts):
        tokens, exits = generate(shallow, prompt, params)
        assert (finished[f"o{i}"].token_ids, finished[f"o{i}"].exit_depths) == (tokens, exits)
        depths += exits
    assert max(depths) == 3
    with pytest.raises(ConfigError, match="num_loops"):
        make_engine(tiny_dir, num_loops=0)


def test_a_context_past_the_checkpoints_positions_is_refused_before_a_weight_is_read(
    tmp_path, monkeypatch
):
    """max_model_len past the checkpoint's max_position_embeddings is a start-up error from
    its config.json alone (a checkpoint without weights gets it, not a load error), naming
    the limit and the opt-in; at the limit the weights are read. Opted in
    (LOOPSERVE_ALLOW_LONG_MAX_MODEL_LEN=1), the engine runs that length: a request crosses the
    checkpoint's last position and equals the dense reference."""
    import shutil

    from loopserve.errors import ConfigError, ModelLoadError
    from loopserve.models.tiny import make_tiny_checkpoint
    from tests.engine_utils import make_engine, run_steps

    monkeypatch.delenv("LOOPSERVE_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    checkpoint = make_tiny_checkpoint(tmp_path / "short", seed=0, max_position_embeddings=32)
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(checkpoint / "config.json", config_only / "config.json")
    message = (
        "max_model_len=48 is longer than the model's 32 positions (max_position_embeddings in "
        "its config.json): pass at most 32, or set LOOPSERVE_ALLOW_LONG_MAX_MODEL_LEN=1"
    )
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_engine(config_only, max_model_len=48)
    with pytest.raises(ModelLoadError):  # at the limit the check passes and the weights load
        make_engine(config_only, max_model_len=32)

    monkeypatch.setenv("LOOPSERVE_ALLOW_LONG_MAX_MODEL_LEN", "1")
    engine = make_engine(checkpoint, max_model_len=48)
    assert engine.max_model_len == 48
    prompt = [(7 * i) % 90 + 3 for i in range(30)]
    params = SamplingParams(max_tokens=12, temperature=0.0, exit_threshold=0.6, ignore_eos=True)
    out = run_steps(engine, [("long", prompt, params, 0)])["long"]
    assert len(prompt) + len(out.token_ids) == 42 > 32  # past the checkpoint's positions
    assert (out.token_ids, out.exit_depths) == generate(engine.model, prompt, params)


def test_trust_remote_code_is_accepted_as_vllm_takes_it_and_changes_nothing(tiny_dir):
    """`LLM(..., trust_remote_code=True)` and `serve --trust-remote-code`, as vLLM's users
    write them for Ouro and Huginn, run; no checkpoint code runs either way, so the tokens
    are the same."""
    import argparse

    from loopserve.cli.serve import add_cli_args

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = [
        LLM(str(tiny_dir), dtype="float32", num_blocks=64, **extra).generate([[5, 17, 42]], params)
        for extra in ({}, {"trust_remote_code": True})
    ]
    assert outputs[0][0].token_ids == outputs[1][0].token_ids
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert parser.parse_args(["ByteDance/Ouro-1.4B", "--trust-remote-code"]).trust_remote_code
