"""Structured output (llguidance): every token the engine emits is one the grammar allows,
a finished output is a whole match (JSON that follows the schema, the regex, a choice), the
engine equals the dense reference with the same grammar (early exits, prompt arms, sampled
rows included), and a constraint that cannot compile is a 400 naming `response_format`."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import json
import re

import pytest
import torch

from tests.optional import require

require("structured")
from loopserve.errors import InvalidRequestError
from loopserve.sampling_params import SamplingParams, StructuredOutput
from tests.engine_utils import make_engine, reference_for, run_steps

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": StructuredOutput(json_schema=SCHEMA),
    "regex": StructuredOutput(regex=r"[0-9]{3}-[a-f]{2,4}"),
    "choice": StructuredOutput(choice=("red", "green", "blue")),
}
PROMPTS = [[17, 250, 3, 99, 41, 7], [5, 6, 7, 8, 9], [44, 1, 250, 250, 8, 91, 100, 3]]


def whole_match(constraint: StructuredOutput, text: str) -> bool:
    if constraint.json_schema is not None:
        value = json.loads(text)
        return (
            set(value) == {"answer", "score"}
            and value["answer"] in ("yes", "no")
            and (isinstance(value["score"], int) and 0 <= value["score"] <= 9)
        )
    if constraint.regex is not None:
        return re.fullmatch(constraint.regex, text) is not None
    return text in constraint.choice


def check_tokens_allowed(engine, constraint, token_ids) -> bool:
    """Replay: a fresh matcher accepts every token in turn; returns whether it ends accepting."""
    matcher = engine.structured.matcher(constraint)
    for token_id in token_ids:
        assert matcher.allowed()[token_id], (token_id, token_ids)
        matcher.consume(token_id)
    return matcher.is_accepting


@pytest.mark.parametrize("name", list(CONSTRAINTS))
@pytest.mark.parametrize(
    "arm",
    [
        {},
        {"prefill_mode": "wavefront", "mixed_prefill_decode": True},
        {"mode": "no_refill"},
        {"graph_mode": "emulate", "max_num_seqs": 8},
        {"preemption_mode": "recompute", "num_blocks": 40},
        {"coda_batching": "on"},
    ],
    ids=["refill", "wavefront_mixed", "no_refill", "graphs", "preemption", "coda_batching"],
)
def test_constrained_outputs_follow_the_grammar_and_equal_the_reference(tiny_tok_dir, name, arm):
    engine = make_engine(tiny_tok_dir, **arm)
    constraint = CONSTRAINTS[name]
    work = []
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(
            max_tokens=24, temperature=0.0 if i == 0 else 0.9, seed=7 + i,
            exit_threshold=0.6, structured_output=constraint,
        )  # fmt: skip
        work.append((f"r{i}", prompt, params, i))
    plain = SamplingParams(max_tokens=12, temperature=0.9, seed=3, exit_threshold=0.6)
    work.append(("plain", PROMPTS[0], plain, 0))  # an unconstrained request beside them
    finished = run_steps(engine, work)
    depths = []
    for request_id, prompt, params, _ in work:
        out = finished[request_id]
        want = reference_for(engine, prompt, params)
        assert out.token_ids == want.token_ids and out.exit_depths == want.exit_depths
        depths += out.exit_depths
        if params.structured_output is None:
            continue
        accepting = check_tokens_allowed(engine, constraint, out.token_ids)
        text = engine.tokenizer.decode(out.token_ids)
        if out.finish_reason == "stop":
            assert accepting and whole_match(constraint, text), text
    assert min(depths) < 4 == max(depths)  # early exits happened beside full-depth tokens
    if "num_blocks" in arm and name != "choice":  # a tight pool (choices are too short
        assert engine.scheduler.memory_stats.num_preemptions > 0  # to fill it): recomputed
    assert sum(finished[f"r{i}"].finish_reason == "stop" for i in range(3)) >= 2


def test_a_constraint_changes_what_is_generated(tiny_tok_dir):
    engine = make_engine(tiny_tok_dir)
    free = SamplingParams(max_tokens=16, temperature=0.0)
    bound = SamplingParams(max_tokens=16, temperature=0.0, structured_output=CONSTRAINTS["choice"])
    finished = run_steps(engine, [("free", PROMPTS[0], free, 0), ("bound", PROMPTS[0], bound, 0)])
    assert engine.tokenizer.decode(finished["bound"].token_ids) in ("red", "green", "blue")
    assert finished["free"].token_ids != finished["bound"].token_ids


@pytest.mark.parametrize(
    "constraint,match",
    [
        (StructuredOutput(json_schema={"type": "object", "properties": {"a": {"type": "nope"}}}),
         "invalid JSON schema"),
        (StructuredOutput(regex="(ab"), "invalid regex"),
    ],
)  # fmt: skip
def test_a_constraint_that_does_not_compile_is_rejected_at_admission(
    tiny_tok_dir, constraint, match
):
    engine = make_engine(tiny_tok_dir)
    with pytest.raises(InvalidRequestError, match=match) as info:
        engine.add_request("x", [1, 2, 3], SamplingParams(structured_output=constraint))
    assert info.value.param == "response_format"
    assert not engine.has_unfinished_requests()


def test_structured_output_needs_a_tokenizer_and_llguidance(tiny_dir, tiny_tok_dir, monkeypatch):
    params = SamplingParams(structured_output=CONSTRAINTS["choice"])
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        make_engine(tiny_dir).add_request("x", [1, 2, 3], params)
    engine = make_engine(tiny_tok_dir)
    monkeypatch.setitem(__import__("sys").modules, "llguidance", None)  # as if not installed
    with pytest.raises(InvalidRequestError, match=r"loopserve\[structured\]"):
        engine.add_request("y", [1, 2, 3], params)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"json_schema": "{}", "regex": "a"}, {"choice": ()}, {"choice": ("a", "")},
     {"choice": "abc"}, {"regex": 5}],
)  # fmt: skip
def test_structured_output_takes_exactly_one_well_formed_constraint(kwargs):
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutput(**kwargs)
    assert info.value.param == "response_format"


def test_a_handed_off_request_resumes_its_grammar_where_it_was(tiny_tok_dir):
    """The matcher of an imported request consumes the outputs it already has."""
    from loopserve.contracts import SampleSpec
    from loopserve.runner.logits_adjust import TokenHistory
    from loopserve.runner.transfers import Transfers

    engine = make_engine(tiny_tok_dir)
    constraint = CONSTRAINTS["choice"]
    red = engine.tokenizer.encode("red")
    spec = SampleSpec.of(SamplingParams(structured_output=constraint))
    history = TokenHistory(
        spec, engine.model.config.vocab_size, Transfers(torch.device("cpu")),
        output_token_ids=red, matcher=engine.structured.matcher(constraint),
    )  # fmt: skip
    assert history.matcher.is_accepting  # "red" is complete: only the end tokens remain
    allowed = set(history.matcher.allowed().nonzero()[0].tolist())
    assert allowed and allowed <= set(engine.eos_token_ids) | set(
        engine.tokenizer.end_of_turn_token_ids
    )


def test_huginn_follows_the_grammar_too(tmp_path):
    """The Huginn executor masks logits with the same matchers: every emitted token is one
    the grammar allows, with criterion exits beside an unconstrained request."""
    from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint

    model_dir = make_tiny_huginn_checkpoint(tmp_path / "h", vocab_size=512, with_tokenizer=True)
    engine = make_engine(model_dir, exit_criterion="kl")
    work = [
        (name, PROMPTS[i], SamplingParams(max_tokens=24, temperature=0.0 if i else 0.9, seed=i,
                                          exit_threshold=0.1, structured_output=constraint), i)
        for i, (name, constraint) in enumerate(CONSTRAINTS.items())
    ]  # fmt: skip
    work.append(("plain", PROMPTS[0], SamplingParams(max_tokens=8, exit_threshold=0.1), 0))
    finished = run_steps(engine, work)
    for name, _, params, _ in work[:-1]:
        out = finished[name]
        accepting = check_tokens_allowed(engine, params.structured_output, out.token_ids)
        if out.finish_reason == "stop":
            text = engine.tokenizer.decode(out.token_ids)
            assert accepting and whole_match(params.structured_output, text), text
    assert sum(finished[name].finish_reason == "stop" for name in CONSTRAINTS) >= 2
    assert min(d for out in finished.values() for d in out.exit_depths) < 8
