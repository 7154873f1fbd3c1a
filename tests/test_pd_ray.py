"""Offline prefill/decode disaggregation on a local Ray cluster (1P1D): hand-offs travel
through Ray's object store and the outputs equal one colocated engine's.

Two configurations, one per KV layout (LAST_EXITED with `ouro_delayed`, SHARED with `trace`):
each starts its own two replica actors, so the full layout x exit-mode matrix is left to
tests/test_pd_serving.py (serving) and tests/test_pd_handoff.py (in-process). Huginn: a 1P1D
hand-off and two data-parallel replicas, each equal to one engine.
Skipped when Ray is not installed (it is the optional `ray` extra)."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import dataclasses

import pytest

from tests.optional import require

require("ray", "serve")

ray = pytest.importorskip("ray", reason="needs the optional `ray` extra (pip install '.[ray]')")
from loopserve.distributed.offline import DisaggregatedEngines  # noqa: E402
from loopserve.llm import LLM  # noqa: E402
from loopserve.sampling_params import SamplingParams  # noqa: E402
from tests.ray_utils import start_local_ray, stop_local_ray  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ENGINE_ARGS = {"dtype": "float32", "num_blocks": 256, "block_size": 4, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def ray_cluster():
    start_local_ray(2)
    yield
    stop_local_ray()


@pytest.mark.parametrize(
    ("layout", "exit_mode"), [("last_exited", "ouro_delayed"), ("shared", "trace")]
)
def test_one_prefill_one_decode_equals_colocated(tiny_dir, ray_cluster, layout, exit_mode):
    engine_args = {**ENGINE_ARGS, "layout": layout, "exit_mode": exit_mode}
    prompts = [[(7 * k + 3 * i) % 90 + 3 for i in range(n)] for k, n in enumerate([1, 6, 13, 22])]
    params = [
        SamplingParams(max_tokens=9, temperature=0.0, exit_threshold=0.6, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=1.0, seed=41, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.8, seed=42, ignore_eos=True),  # no hand-off
        SamplingParams(max_tokens=11, temperature=0.7, top_k=30, seed=43, min_loops=2),
    ]
    if exit_mode == "trace":  # replayed exit depths, one list per request
        traces = [(1, 3, 2), (4, 1), (2,), (2, 1, 3)]
        params = [dataclasses.replace(sp, exit_trace=t) for sp, t in zip(params, traces)]
    colocated = LLM(str(tiny_dir), **engine_args).generate(prompts, params)
    engines = DisaggregatedEngines({"model": str(tiny_dir), **engine_args}, 1, 1)
    try:
        outputs = engines.generate([f"r{i}" for i in range(len(prompts))], prompts, params)
        assert engines.last_num_handed_off == 3  # all but the max_tokens=1 request
    finally:
        engines.shutdown()
    for output, expected in zip(outputs, colocated):
        assert output.token_ids == expected.token_ids
        assert output.exit_depths == expected.exit_depths
        assert output.finish_reason == expected.finish_reason
    assert [len(o.token_ids) for o in outputs][:3] == [9, 7, 1]
    assert min(d for o in outputs for d in o.exit_depths[1:]) < 4  # decode tokens exited early


def test_huginn_requests_hand_off_through_ray_to_the_colocated_tokens(ray_cluster, tmp_path):
    """Huginn's hand-off through Ray's object store: K/V of every step plane and the once
    plane, the sampler, and its runner state (seeded random initial states); the outputs
    equal one colocated engine's."""
    from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint

    model = str(make_tiny_huginn_checkpoint(tmp_path / "huginn"))
    engine_args = {**ENGINE_ARGS, "exit_criterion": "kl", "init_scale": 1.0}
    prompts = [[(5 * k + 11 * i) % 120 + 1 for i in range(n)] for k, n in enumerate([3, 9, 14])]
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, seed=7, exit_threshold=0.3,
                       ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.8, seed=8, exit_threshold=0.1,
                       ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=1.0, seed=9, ignore_eos=True),
    ]  # fmt: skip
    colocated = LLM(model, **engine_args).generate(prompts, params)
    engines = DisaggregatedEngines({"model": model, **engine_args}, 1, 1)
    try:
        outputs = engines.generate([f"h{i}" for i in range(len(prompts))], prompts, params)
        assert engines.last_num_handed_off == 3
    finally:
        engines.shutdown()
    for output, expected in zip(outputs, colocated, strict=True):
        assert (output.token_ids, output.exit_depths) == (expected.token_ids, expected.exit_depths)
    assert min(d for o in outputs for d in o.exit_depths[1:]) < 8  # early exits after hand-off


def test_huginn_data_parallel_replicas_return_one_engines_tokens(ray_cluster, tmp_path):
    """`LLM(huginn, data_parallel_size=2)`: both replicas run requests and every request's
    tokens and steps equal one engine's."""
    from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint

    model = str(make_tiny_huginn_checkpoint(tmp_path / "huginn-dp"))
    engine_args = {**ENGINE_ARGS, "exit_criterion": "kl", "init_scale": 1.0}
    prompts = [[(3 * k + 7 * i) % 120 + 1 for i in range(4 + 3 * k)] for k in range(4)]
    params = [
        SamplingParams(max_tokens=6, temperature=0.8, seed=60 + i, exit_threshold=0.3,
                       ignore_eos=True)
        for i in range(4)
    ]  # fmt: skip
    expected = LLM(model, **engine_args).generate(prompts, params, use_tqdm=False)
    llm = LLM(model, data_parallel_size=2, **engine_args)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        split = llm._replicas.last_split
    finally:
        llm._replicas.shutdown()
    assert [(o.token_ids, o.exit_depths) for o in outputs] == [
        (e.token_ids, e.exit_depths) for e in expected
    ]
    assert sorted(split) != [0, 4] and sum(split) == 4, split  # both replicas ran requests
    assert min(d for o in outputs for d in o.exit_depths) < 8
