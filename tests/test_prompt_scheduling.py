"""Prompt scheduling arms (atomic, per_depth, wavefront, mixed): exactness and mechanics."""

from __future__ import annotations

import random
import zlib

import pytest

from loopserve.config import max_inflight_rows
from loopserve.contracts import ItemKind
from loopserve.errors import ConfigError
from loopserve.sampling_params import SamplingParams
from tests.engine_utils import (
    make_engine,
    random_workload,
    reference_for,
    run_steps,
    step_rows,
)

ARMS = {
    "atomic": dict(prefill_mode="atomic"),
    "per_depth": dict(prefill_mode="per_depth"),
    "wavefront": dict(prefill_mode="wavefront"),
    "mixed": dict(prefill_mode="per_depth", mixed_prefill_decode=True),
    "wavefront_mixed": dict(prefill_mode="wavefront", mixed_prefill_decode=True),
}
# Chunk 8 with prompts up to 41 tokens: many chunks per prompt; budget fits chunk + seqs - 1.
BUDGET = dict(prefill_chunk_size=8, max_num_batched_tokens=24, max_num_seqs=4, block_size=4)


def record_schedules(engine):
    """Every executed step's rows (`step_rows`: decode rows, then items), through the engine
    core's observer hook."""
    steps = []
    engine.core.add_observer(lambda scheduled, _output: steps.append(step_rows(scheduled)))
    return steps


# Hidden-state rows the runner may hold between steps, derived by hand for BUDGET (chunk
# c = 8, max_num_seqs S = 4, D = 4 loops of the tiny model), per running request:
# - in decode: at most its one in-flight token, 1 row;
# - atomic: a chunk runs all D loops inside its step, so a prompt holds nothing: S * 1 = 4;
# - per_depth, and mixed (which runs atomic prompts one depth per step): one chunk in
#   flight, at most c rows: S * c = 32;
# - wavefront: chunk k+1 runs depth d only after chunk k finished d, and a step runs a prefix
#   of the ready chunks, so the held chunks of a request sit at distinct next depths in
#   1..D-1: at most D-1 chunks, S * (D-1) * c = 96.
HELD_ROWS_BOUND = {
    "atomic": 4,
    "per_depth": 32,
    "mixed": 32,
    "wavefront": 96,
    "wavefront_mixed": 96,
}


@pytest.mark.parametrize("exit_mode", ["ouro", "ouro_delayed", "random_lookahead", "trace"])
@pytest.mark.parametrize("arm", list(ARMS))
def test_every_arm_matches_reference_with_arrivals_and_aborts(tiny_dir, arm, exit_mode):
    engine = make_engine(tiny_dir, exit_mode=exit_mode, **ARMS[arm], **BUDGET)
    seed = zlib.crc32(f"{arm}-{exit_mode}".encode()) % 997  # stable across processes
    work = random_workload(seed, 9, engine.model.config.vocab_size, sampled=True)
    aborted = {"r1": 4, "r6": 13}
    assert engine.num_loops == 4  # HELD_ROWS_BOUND assumes D = 4
    rows_seen = []

    def check(e):
        assert e.runner.inflight_rows <= HELD_ROWS_BOUND[arm]
        rows_seen.append(e.runner.inflight_rows)

    finished = run_steps(engine, work, abort_at=aborted, on_step=check)
    for request_id, prompt, params, _ in work:
        ref = reference_for(engine, prompt, params)
        out = finished[request_id]
        n = len(out.token_ids)
        if out.finish_reason == "abort":
            assert (out.token_ids, out.exit_depths) == (ref.token_ids[:n], ref.exit_depths[:n])
        else:
            assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), request_id
    if arm != "atomic":  # prompt chunks were held between steps, so the bound was exercised
        assert max(rows_seen) > HELD_ROWS_BOUND["atomic"]
    assert engine.runner.num_live_handles == 0
    assert engine.stats.kv_blocks_used == 0


def test_per_depth_runs_under_shared_layout_position_major(tiny_dir):
    engine = make_engine(tiny_dir, layout="shared", prefill_mode="per_depth", **BUDGET)
    work = random_workload(5, 5, engine.model.config.vocab_size, sampled=False)
    finished = run_steps(engine, work)
    for request_id, prompt, params, _ in work:
        ref = reference_for(engine, prompt, params)
        assert (finished[request_id].token_ids, finished[request_id].exit_depths) == tuple(ref)


@pytest.mark.parametrize("arm", ["wavefront", "mixed"])
def test_shared_layout_rejects_wavefront_and_mixed(tiny_dir, arm):
    with pytest.raises(ConfigError, match="last_exited"):
        make_engine(tiny_dir, layout="shared", **ARMS[arm], **BUDGET)


def test_mixed_budget_guard_names_values_and_fix(tiny_dir):
    with pytest.raises(
        ConfigError, match=r"16 \+ 8 - 1 = 23 > 20; set max_num_batched_tokens >= 23"
    ):
        make_engine(
            tiny_dir,
            mixed_prefill_decode=True,
            prefill_chunk_size=16,
            max_num_seqs=8,
            max_num_batched_tokens=20,
        )
    make_engine(
        tiny_dir,
        mixed_prefill_decode=True,
        prefill_chunk_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=23,
    )


def long_and_short_workload():
    long = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, exit_threshold=0.5)
    return [
        ("d0", [3, 4], short, 0),
        ("d1", [5, 6, 7], short, 0),
        ("long", list(range(1, 41)), long, 2),
        ("late", [9, 9], short, 6),
    ]


def test_mixed_calls_form_with_decode_rows_first(tiny_dir):
    engine = make_engine(tiny_dir, **ARMS["mixed"], **BUDGET)
    steps = record_schedules(engine)
    run_steps(engine, long_and_short_workload())
    mixed = [s for s in steps if {i.kind for i in s} == {"decode", "prompt"}]
    assert len(mixed) >= 5
    for s in steps:
        kinds = [i.kind for i in s]
        assert kinds == sorted(kinds, key=lambda k: k == "prompt"), "decode rows come first"
        assert sum(i.token_count for i in s) <= BUDGET["max_num_batched_tokens"]
        assert all(i.num_depths == 1 for i in s)


def test_mixed_selects_every_ready_decode_row(tiny_dir):
    engine = make_engine(tiny_dir, **ARMS["mixed"], **BUDGET)
    steps = []
    engine.core.add_observer(lambda scheduled, _output: steps.append(scheduled))

    def check(e):
        scheduled = steps[-1]
        decode_ids = {i.request_id for i in step_rows(scheduled) if i.kind == "decode"}
        # Every request already in decode before this step had a row in it.
        assert decode_ids >= pre_decode.get(scheduled.step_id, set())

    pre_decode: dict[int, set[str]] = {}
    in_decode: set[str] = set()

    def observe(scheduled, output) -> None:
        # Requests in decode before this step: first tokens sampled by earlier steps, minus
        # requests that finished (released in this step's output).
        in_decode.difference_update(scheduled.finished_request_ids)
        pre_decode[scheduled.step_id] = set(in_decode)
        for item, result in zip(scheduled.items, output.results):
            if item.kind is ItemKind.PROMPT and item.first_token and result.sampled is not None:
                in_decode.add(item.request_id)

    engine.core.add_observer(observe)
    run_steps(engine, long_and_short_workload(), on_step=check)


def test_wavefront_respects_chunk_dependencies_and_overlaps_depths(tiny_dir):
    engine = make_engine(tiny_dir, **ARMS["wavefront"], **BUDGET)
    steps = record_schedules(engine)
    engine.add_request("p", list(range(1, 41)), SamplingParams(max_tokens=2, temperature=0))
    run_steps(engine, [])
    done: set[tuple[int, int]] = set()  # (chunk start, depth) completed
    overlapped = False
    for s in steps:
        items = [(i.token_start, i.depth) for i in s if i.kind == "prompt"]
        for start, depth in items:
            if start > 0:
                assert (start - 8, depth) in done, (
                    f"chunk {start}@d{depth} ran before chunk {start - 8}@d{depth}"
                )
            if depth > 0:
                assert (start, depth - 1) in done
        if len({d for _, d in items}) > 1:
            overlapped = True
        done |= set(items)
    assert overlapped, "c0@d1 and c1@d0 never shared a core call"
    assert any(
        ((0, 1) in {(i.token_start, i.depth) for i in s})
        and ((8, 0) in {(i.token_start, i.depth) for i in s})
        for s in steps
    )


def test_prompt_items_keep_admission_order_across_depths(tiny_dir):
    engine = make_engine(tiny_dir, **ARMS["wavefront"], **BUDGET)
    steps = record_schedules(engine)
    params = SamplingParams(max_tokens=2, temperature=0)
    work = [(f"p{i}", list(range(1, 20 + i)), params, 0) for i in range(3)]
    run_steps(engine, work)
    for s in steps:
        order = [int(i.request_id[1:]) for i in s if i.kind == "prompt"]
        assert order == sorted(order)
        for rid in {i.request_id for i in s}:
            starts = [i.token_start for i in s if i.request_id == rid]
            assert starts == sorted(starts)


def test_admission_continues_during_long_prompts(tiny_dir):
    for arm in ("per_depth", "wavefront", "mixed"):
        engine = make_engine(tiny_dir, **ARMS[arm], **BUDGET)
        engine.add_request("long", list(range(1, 41)), SamplingParams(max_tokens=2, temperature=0))
        engine.step()
        engine.add_request("short", [1, 2], SamplingParams(max_tokens=1, temperature=0))
        finished_order = []
        while engine.has_unfinished_requests():
            finished_order += [o.request_id for o in engine.step() if o.finished]
        assert finished_order == ["short", "long"], arm


def test_items_keep_their_length_and_new_chunks_fill_the_budget(tiny_dir):
    """A chunk's length is fixed when it is created (every depth of it runs the same rows),
    and a new chunk is cut to the rows its call has left: min(remaining prompt, rows left,
    chunk size)."""
    engine = make_engine(tiny_dir, **ARMS["wavefront"], **BUDGET)
    steps = record_schedules(engine)
    params = SamplingParams(max_tokens=2, temperature=0)
    work = [(f"p{i}", list(range(1 + i, 30 + i)), params, 0) for i in range(4)]  # distinct
    finished = run_steps(engine, work)
    budget = BUDGET["max_num_batched_tokens"]
    lengths: dict[tuple[str, int], set[int]] = {}
    cut_in_full_calls = 0
    for s in steps:
        assert s.num_rows <= budget
        for item in s:
            if item.kind != "prompt":
                continue
            lengths.setdefault((item.request_id, item.token_start), set()).add(item.token_count)
            natural = min(BUDGET["prefill_chunk_size"], 29 - item.token_start)
            if item.depth == 0 and item.token_count < natural:
                cut_in_full_calls += s.num_rows == budget  # cut exactly to what was left
    assert all(len(counts) == 1 for counts in lengths.values())
    assert cut_in_full_calls > 0
    for request_id, prompt, p, _ in work:
        ref = reference_for(engine, prompt, p)
        assert (finished[request_id].token_ids, finished[request_id].exit_depths) == (
            ref.token_ids, ref.exit_depths,
        )  # fmt: skip


@pytest.mark.parametrize("arm", ["atomic", "per_depth", "wavefront", "mixed", "wavefront_mixed"])
def test_budget_filling_chunks_equal_the_dense_reference_over_random_budgets(tiny_dir, arm):
    rng = random.Random(zlib.crc32(f"budget-{arm}".encode()))
    cuts = 0
    for trial in range(3):
        chunk = rng.choice([4, 7, 12])
        max_seqs = rng.choice([2, 3, 5])
        budget = rng.randint(chunk + max_seqs - 1, chunk + max_seqs + 9)
        engine = make_engine(tiny_dir, **ARMS[arm], prefill_chunk_size=chunk,
                             max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             block_size=4)  # fmt: skip
        steps = record_schedules(engine)
        work = []
        for i in range(5):
            prompt = [rng.randrange(1, 256) for _ in range(rng.randint(1, 30))]
            params = SamplingParams(max_tokens=rng.randint(1, 5), temperature=0.0,
                                    exit_threshold=rng.choice([0.4, 1.0]))  # fmt: skip
            work.append((f"r{trial}-{i}", prompt, params, rng.randrange(0, 4)))
        finished = run_steps(engine, work)
        for request_id, prompt, params, _ in work:
            ref = reference_for(engine, prompt, params)
            out = finished[request_id]
            assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths)
        prompt_len = {rid: len(p) for rid, p, _, _ in work}
        cuts += sum(
            1
            for s in steps
            for i in s
            if i.kind == "prompt" and i.depth == 0
            and i.token_count < min(chunk, prompt_len[i.request_id] - i.token_start)
        )  # fmt: skip
    assert cuts > 0  # some chunk really was cut to its call's budget


@pytest.mark.parametrize("arm", ["per_depth", "wavefront", "wavefront_mixed"])
def test_abort_mid_prompt_releases_every_handle(tiny_dir, arm):
    engine = make_engine(tiny_dir, **ARMS[arm], **BUDGET)
    engine.add_request("a", list(range(1, 41)), SamplingParams(max_tokens=3, temperature=0))
    engine.add_request("b", list(range(2, 30)), SamplingParams(max_tokens=3, temperature=0))
    for _ in range(3):
        engine.step()
    assert engine.runner.num_live_handles >= 1
    engine.abort_request("a")
    engine.step()  # the release travels with the next step's SchedulerOutput
    assert not engine.runner.inflight.handles_of("a")
    run_steps(engine, [])
    assert engine.runner.num_live_handles == 0
    assert engine.stats.kv_blocks_used == 0


def test_failed_step_releases_in_flight_prompt_state(tiny_dir, monkeypatch):
    engine = make_engine(tiny_dir, **ARMS["wavefront"], **BUDGET)
    engine.add_request("a", list(range(1, 41)), SamplingParams(max_tokens=3, temperature=0))
    engine.step()
    engine.step()
    monkeypatch.setattr(
        engine.runner, "execute", lambda s: (_ for _ in ()).throw(RuntimeError("boom"))
    )
    outputs = engine.step()
    assert outputs[0].finish_reason == "abort" and "boom" in outputs[0].error
    assert engine.runner.num_live_handles >= 1  # the failing executor could not release yet
    monkeypatch.undo()
    assert engine.step() == []  # an idle step carries the pending release
    assert engine.runner.num_live_handles == 0
    assert engine.stats.kv_blocks_used == 0


def test_memory_plan_reserves_inflight_hidden_states(tiny_dir):
    from loopserve.config import DEFAULT_CPU_KV_BYTES

    engine = make_engine(tiny_dir, num_blocks=None, **ARMS["wavefront"], **BUDGET)
    rows = max_inflight_rows(engine.config, engine.num_loops)
    assert rows == 4 * (4 * 8 + 4)
    assert engine.inflight_hidden_bytes == rows * engine.model.config.hidden_size * 4
    element_size = engine.model.lm_head.weight.element_size()
    hidden = engine.model.config.hidden_size
    per_block = engine.model.config.kv_bytes_per_block(4, element_size)
    assert engine.kv.prefix_cache is not None  # with it, the score store: a vector per slot
    per_block += 4 * hidden * element_size
    expected = (DEFAULT_CPU_KV_BYTES - engine.inflight_hidden_bytes) // per_block
    assert engine.stats.kv_blocks_total == expected
    assert engine.runner.eager.score_store.shape == (expected * 4, hidden)
    plain = make_engine(tiny_dir, enable_prefix_caching=False, **ARMS["wavefront"], **BUDGET)
    assert plain.runner.eager.score_store is None


def test_request_id_reuse_starts_from_clean_runner_state(tiny_dir):
    engine = make_engine(tiny_dir, **ARMS["wavefront"], **BUDGET)
    params = SamplingParams(max_tokens=3, temperature=0.8, seed=7)
    engine.add_request("x", list(range(1, 30)), params)
    engine.step()
    engine.abort_request("x")
    engine.add_request("x", list(range(1, 30)), params)
    finished = run_steps(engine, [])
    ref = reference_for(engine, list(range(1, 30)), params)
    assert (finished["x"].token_ids, finished["x"].exit_depths) == tuple(ref)


def test_mixed_has_one_meaning_the_resolved_config_shows():
    """--mixed-prefill-decode alone (atomic is the default) runs per_depth chunks; the config,
    not the scheduler, says so."""
    from loopserve.config import SchedulerConfig

    assert SchedulerConfig(mixed_prefill_decode=True).prefill_mode == "per_depth"
    assert SchedulerConfig(prefill_mode="wavefront", mixed_prefill_decode=True).prefill_mode == (
        "wavefront"
    )
    assert SchedulerConfig().prefill_mode == "atomic"
