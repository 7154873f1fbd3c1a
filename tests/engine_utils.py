"""Helpers for engine tests: run workloads step by step and compare with the reference."""

from __future__ import annotations

import random
from typing import NamedTuple

import numpy as np

from loopserve.contracts import DecodeRows, ItemKind
from loopserve.engine.llm_engine import LLMEngine
from loopserve.reference import generate
from loopserve.sampling_params import SamplingParams


def pairwise(cases: list[tuple]) -> list[tuple]:
    """A subset of `cases` (tuples of factor values; a product, perhaps filtered) in which
    every pair of values of two factors that occurs together in some case occurs together
    in at least one chosen case (an all-pairs covering, chosen greedily and
    deterministically). It keeps every two-factor interaction of a parametrized product
    at a fraction of its cases."""

    def pairs(case):
        return {(i, a, j, b) for i, a in enumerate(case) for j, b in enumerate(case) if i < j}

    uncovered = set().union(*(pairs(case) for case in cases))
    chosen: list[tuple] = []
    used: dict[tuple, int] = {}  # (factor, value) -> chosen cases with it (ties: the rarest)

    def score(case):
        return len(pairs(case) & uncovered), -sum(used.get((i, v), 0) for i, v in enumerate(case))

    while uncovered:
        best = max(cases, key=score)
        chosen.append(best)
        uncovered -= pairs(best)
        for item in enumerate(best):
            used[item] = used.get(item, 0) + 1
    return sorted(chosen, key=cases.index)


def make_engine(model_dir, **overrides) -> LLMEngine:
    args = dict(
        model=str(model_dir),
        dtype="float32",
        num_blocks=512,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=48,
        prefill_chunk_size=12,
    )
    args.update(overrides)
    return LLMEngine.from_engine_args(**args)


def random_workload(seed: int, num_requests: int, vocab: int, *, sampled: bool):
    rng = random.Random(seed)
    work = []
    for i in range(num_requests):
        prompt = [rng.randrange(vocab) for _ in range(rng.choice([1, 3, 5, 13, 30, 41]))]
        params = SamplingParams(
            max_tokens=rng.randrange(1, 14),
            temperature=rng.choice([0.7, 1.0]) if sampled and i % 2 else 0.0,
            top_k=rng.choice([-1, 30]),
            top_p=rng.choice([1.0, 0.9]),
            seed=1000 + i,
            exit_threshold=rng.choice([0.3, 0.6, 0.9, 1.0]),
            min_loops=rng.choice([1, 1, 2]),
            max_loops=rng.choice([None, None, 3]),
            exit_trace=tuple(rng.randrange(1, 5) for _ in range(rng.randrange(1, 6))),
        )
        arrival_step = rng.randrange(0, 12)
        work.append((f"r{i}", prompt, params, arrival_step))
    return work


def run_steps(engine: LLMEngine, work, *, abort_at: dict[str, int] | None = None, on_step=None):
    """Add requests at their arrival steps, abort some, step until done. Returns final outputs."""
    abort_at = abort_at or {}
    finished = {}
    step = 0
    pending = sorted(work, key=lambda w: w[3])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            request_id, prompt, params, _ = pending.pop(0)
            engine.add_request(request_id, prompt, params)
        for request_id, when in abort_at.items():
            if when == step:
                output = engine.abort_request(request_id)
                if output is not None:
                    finished[request_id] = output
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.scheduler.check_invariants()
        check_table_copy(engine)
        if on_step is not None:
            on_step(engine)
        step += 1
    return finished


def check_table_copy(engine: LLMEngine) -> None:
    """The runner's copy of the block tables (kept from the steps' `TableUpdate`s) equals the
    KV manager's for every request whose change was sent (a synchronous engine, between
    steps; an async engine may have a step in flight)."""
    copy = getattr(engine.runner, "block_tables", None)
    if copy is None or engine.config.async_scheduling:
        return
    kv = engine.scheduler.kv
    for request_id, table in kv.tables.items():
        if request_id not in kv._changed:
            assert copy.tables.get(request_id) == tuple(table), request_id


def reference_for(engine: LLMEngine, prompt, params):
    config = engine.config
    return generate(
        engine.model,
        prompt,
        params,
        layout=config.cache.layout,
        exit_mode=config.exit.mode,
        lookahead_seed=config.exit.lookahead_seed,
        eos_token_ids=sorted(engine.eos_token_ids),
        make_matcher=None if engine.structured is None else engine.structured.matcher,
        kv_cache_dtype=config.cache.kv_cache_dtype,
    )


def assert_match_reference(engine: LLMEngine, work, finished) -> list[int]:
    """Every request's tokens and exit depths equal the dense reference's; returns all exit
    depths (callers assert that early exits and full-depth tokens both happened)."""
    depths: list[int] = []
    for request_id, prompt, params, _ in work:
        ref = reference_for(engine, prompt, params)
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), request_id
        depths += out.exit_depths
    return depths


def kv_planes(engine: LLMEngine, request_id: str, num_positions: int):
    """[planes, layers, K/V, positions, kv_heads, head_dim] of one request, via its tables."""
    import torch

    block_size = engine.kv.block_size
    cache = engine.runner.kv_cache
    planes = []
    for table in engine.kv.tables[request_id]:
        slots = [table[p // block_size] * block_size + p % block_size for p in range(num_positions)]
        planes.append(cache[:, :, slots].clone())
    return torch.stack(planes)


class StepRow(NamedTuple):
    """One row group of a step, read alike for decode rows and items (tests only): a decode
    row (`kind` "decode", one row, one depth) or a prompt / replay `WorkItem`."""

    request_id: str
    kind: str  # "decode", "prompt", "replay"
    token_start: int
    token_count: int
    depth: int
    num_depths: int
    needs_gate: bool
    exit_now: bool | None  # decode rows: True / False, None where the gate decides
    first_token: bool = False


class StepRows(list):
    """A step's `StepRow`s, with the step's id and its first call's row count."""

    step_id: int
    num_rows: int


def step_rows(scheduled) -> StepRows:
    """A `SchedulerOutput`'s decode rows (first, as in the call) and items, as `StepRow`s."""
    rows = StepRows()
    rows.step_id, rows.num_rows = scheduled.step_id, scheduled.num_rows
    if scheduled.decode is not None:
        for row in scheduled.decode.rows():
            exit_now = {1: True, 0: False, -1: None}[row.exit_code]
            rows.append(
                StepRow(
                    row.request_id,
                    "decode",
                    row.position,
                    1,
                    row.depth,
                    1,
                    row.needs_gate,
                    exit_now,
                )  # fmt: skip
            )
    for item in scheduled.items:
        prompt = item.kind is ItemKind.PROMPT
        rows.append(
            StepRow(
                item.request_id,
                item.kind.value,
                item.token_start,
                item.token_count,
                item.depth,
                item.num_depths,
                item.needs_gate,
                False if prompt else item.exit_now,
                prompt and item.first_token,
            )  # fmt: skip
        )
    return rows


def decode_rows(*rows) -> DecodeRows:
    """`DecodeRows` columns from `DecodeRow` values (hand-built steps in tests)."""
    columns = list(zip(*rows))
    dtypes = [np.int64, np.int64, np.int64, np.int8, bool, np.float64, np.float64, np.float64]
    return DecodeRows(tuple(columns[0]), *(np.array(c, t) for c, t in zip(columns[1:], dtypes)))


def assert_preempted_and_hit(engine: LLMEngine, preemption: str) -> None:
    """The run preempted requests (by swap, when that is the mode) and hit the prefix cache."""
    stats = engine.scheduler.memory_stats
    assert stats.num_preemptions > 0
    if preemption == "swap":
        assert stats.num_preemptions_swap > 0
    assert engine.kv.prefix_cache.stats.num_hit_tokens > 0
