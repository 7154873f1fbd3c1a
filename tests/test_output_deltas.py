"""Outputs as deltas: per-step output work independent of the stream's length, and the three
output kinds telling the same story.

The work an output costs is what it carries (every element is built or copied for it) plus
what the detokenizer re-scans per token; both are measured here as element counts, never as
times. The cumulative kind is the control: the same measure grows with the stream there.
"""

from __future__ import annotations

import pytest

from loopserve.sampling_params import SamplingParams
from tests.engine_utils import make_engine

NUM_TOKENS = 300


def _carried(output) -> int:
    """Elements this output holds (tokens, exit depths, text characters, logprobs, times)."""
    return (
        len(output.token_ids)
        + len(output.exit_depths)
        + len(output.text)
        + len(output.logprobs or ())
        + len(output.metrics.token_times_s)
    )


def _run_all(engine, kinds: tuple[str, ...]) -> dict:
    """One request per output kind, all in one batch (same prompt, seed and parameters):
    each kind's outputs, and the detokenizer's held characters after every step."""
    for kind in kinds:
        params = SamplingParams(
            max_tokens=NUM_TOKENS,
            temperature=0.8,
            seed=7,
            ignore_eos=True,
            logprobs=2,
            stop=("zzzz-never",),
            output_kind=kind,
        )
        engine.add_request(kind, "the quick brown fox", params)
    runs = {kind: ([], []) for kind in kinds}
    while engine.has_unfinished_requests():
        for output in engine.step():
            runs[output.request_id][0].append(output)
        for kind, (_, held) in runs.items():
            state = engine.output_processor._states.get(kind)
            if state is not None and state.detokenizer is not None:
                held.append(state.detokenizer.num_held_chars)
    return runs


@pytest.fixture(scope="module")
def runs(tiny_tok_dir):
    engine = make_engine(tiny_tok_dir, max_model_len=512)
    return _run_all(engine, ("delta", "cumulative", "final_only"))


def test_delta_outputs_carry_only_what_is_new_however_long_the_stream(runs):
    outputs, held = runs["delta"]
    streaming = [o for o in outputs if not o.finished]
    assert len(streaming) >= NUM_TOKENS - 1
    sizes = [_carried(o) for o in streaming]
    early, late = sizes[:50], sizes[-50:]
    # Each new token brings one id, one depth, one logprob and a few characters.
    assert max(late) <= max(early) + 8, (max(early), max(late))
    assert max(held) <= len("zzzz-never")  # the detokenizer keeps only a held tail

    # Control: the same measure on cumulative outputs grows with the stream.
    cumulative = [_carried(o) for o in runs["cumulative"][0] if not o.finished]
    assert cumulative[-1] > 20 * cumulative[0]


def test_deltas_add_up_to_the_cumulative_and_final_only_outputs(runs):
    deltas, _ = runs["delta"]
    final_cumulative = runs["cumulative"][0][-1]
    final_only = runs["final_only"][0]
    assert len(final_only) == 1 and final_only[0].finished
    for whole in (final_cumulative, final_only[0]):
        assert [t for o in deltas for t in o.token_ids] == whole.token_ids
        assert "".join(o.text for o in deltas) == whole.text
        assert [d for o in deltas for d in o.exit_depths] == whole.exit_depths
        # Logprobs to float tolerance: rows of one batch may round differently.
        streamed = [lp for o in deltas for lp in o.logprobs]
        assert [lp.token_id for lp in streamed] == [lp.token_id for lp in whole.logprobs]
        assert [lp.logprob for lp in streamed] == pytest.approx(
            [lp.logprob for lp in whole.logprobs], abs=1e-4
        )
        assert deltas[-1].metrics.token_times_s  # the final delta carries every token time
        assert len(deltas[-1].metrics.token_times_s) == len(whole.token_ids)
        assert deltas[-1].num_output_tokens == whole.num_output_tokens == NUM_TOKENS
        assert deltas[-1].finish_reason == whole.finish_reason == "length"
