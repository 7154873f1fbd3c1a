"""Batch-invariant mode: a row's bits depend only on its own inputs, never on its call.

Unit level: the row-invariant linear, SiLU and attention against plain torch (close in value,
identical in bits across row counts and call compositions). Engine level: a request run
alone and the same request sharing every call with other requests (staggered arrivals,
different depths, a recompute preemption in between) write bit-identical KV planes and get
bit-identical logprobs. Each sensitivity claim has a control: the default path, in the same
situation, does change bits (measured on this CPU: float32 GEMM picks its kernel by row
count, padded attention rounds differently, vectorised SiLU runs a scalar tail).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from loopserve.config import EngineConfig, effective_graph_mode
from loopserve.errors import ConfigError
from loopserve.models.attention import attention_reference
from loopserve.runner.attention.base import RowSegment
from loopserve.runner.attention.registry import resolve_attention_backend
from loopserve.runner.attention.torch_paged import TorchBackend
from loopserve.runner.batch_invariant import (
    RowInvariantTorchBackend,
    RowwiseSiLU,
    row_invariant_linear,
)
from loopserve.sampling_params import SamplingParams
from tests.engine_utils import kv_planes, make_engine, run_steps


def host_control(differs: bool, what: str) -> None:
    """A control measures the host CPU's kernels, so it may not fail the suite: where the
    default path happens to give the same bits on this host, skip with the measured reason
    (on an AVX2-only CPU, for instance, plain SiLU has no row-count-dependent tail)."""
    if not differs:
        capability = torch.backends.cpu.get_cpu_capability()
        pytest.skip(f"control not observable on this host ({capability}): {what} gave equal bits")


def rows_alone_vs_in_calls(fn, inputs: torch.Tensor) -> list[int]:
    """Row counts M for which `fn(inputs[:M])` differs in any bit from its rows run alone."""
    alone = torch.cat([fn(inputs[i : i + 1]) for i in range(inputs.shape[0])])
    return [m for m in range(1, inputs.shape[0] + 1) if not torch.equal(fn(inputs[:m]), alone[:m])]


@pytest.mark.parametrize(
    "in_features,out_features,bias", [(64, 176, False), (176, 64, False), (64, 1, True)]
)
def test_row_invariant_linear_matches_linear_and_ignores_row_count(in_features, out_features, bias):
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    bias_t = torch.randn(out_features, generator=generator) if bias else None
    inputs = torch.randn(24, in_features, generator=generator)
    expected = F.linear(inputs, weight, bias_t)
    torch.testing.assert_close(row_invariant_linear(inputs, weight, bias_t), expected)
    assert rows_alone_vs_in_calls(lambda x: row_invariant_linear(x, weight, bias_t), inputs) == []


def test_control_plain_linear_changes_a_rows_bits_in_wider_calls():
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(176, 64, generator=generator) / 8
    inputs = torch.randn(24, 64, generator=generator)
    differs = rows_alone_vs_in_calls(lambda x: F.linear(x, weight), inputs) != []
    host_control(differs, "F.linear over 1..24 rows")


def test_rowwise_silu_ignores_row_count():
    # 176 (the tiny model's SwiGLU width) is not a multiple of 32, so a contiguous SiLU over
    # rows x 176 elements runs a scalar tail whose position depends on the row count.
    inputs = torch.randn(40, 176, generator=torch.Generator().manual_seed(4)) * 3
    torch.testing.assert_close(RowwiseSiLU()(inputs), inputs * torch.sigmoid(inputs))
    assert rows_alone_vs_in_calls(RowwiseSiLU(), inputs) == []


def test_control_plain_silu_changes_a_rows_bits_with_row_count():
    inputs = torch.randn(40, 176, generator=torch.Generator().manual_seed(4)) * 3
    host_control(rows_alone_vs_in_calls(F.silu, inputs) != [], "F.silu over 1..40 rows")


def _call(backend_cls, kv_cache, segments, query, key, value):
    backend = backend_cls(kv_cache, block_size=4, scale=0.25)
    return backend.prepare(segments).attend(0, query, key, value)


def test_row_invariant_attention_row_alone_equals_row_in_call():
    """Decode rows at different positions and a prompt chunk share one call; every row's
    output equals, bit for bit, that row attended as a one-row call over the same K/V."""
    generator = torch.Generator().manual_seed(5)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    kv_cache = torch.randn(1, 2, 64 * block_size, num_kv_heads, head_dim, generator=generator)
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(4)]
    # decode at 3, chunk [9, 15), decode at 30, decode at 17: contexts 4, 10..15, 31, 18
    segments = [
        RowSegment(tables[0], 3, 1),
        RowSegment(tables[1], 9, 6),
        RowSegment(tables[2], 30, 1),
        RowSegment(tables[3], 17, 1),
    ]
    rows = [(0, 3), *((1, p) for p in range(9, 15)), (2, 30), (3, 17)]
    query = torch.randn(len(rows), num_heads, head_dim, generator=generator)
    key = torch.randn(len(rows), num_kv_heads, head_dim, generator=generator)
    value = torch.randn(len(rows), num_kv_heads, head_dim, generator=generator)
    for backend_cls in (RowInvariantTorchBackend, TorchBackend):
        cache = kv_cache.clone()
        together = _call(backend_cls, cache, segments, query, key, value)
        alone = torch.cat(
            [
                _call(backend_cls, cache, [RowSegment(tables[t], p, 1)], query[r : r + 1],
                      key[r : r + 1], value[r : r + 1])
                for r, (t, p) in enumerate(rows)
            ]
        )  # fmt: skip
        if backend_cls is TorchBackend:  # control: padding may change a row's bits (host kernels)
            host_control(not torch.equal(together, alone), "padded torch attention")
            continue
        assert torch.equal(together, alone)
        for r, (t, p) in enumerate(rows):  # the math: the reference over the row's context
            slots = [tables[t][i // block_size] * block_size + i % block_size for i in range(p + 1)]
            keys, values = cache[0, 0, slots], cache[0, 1, slots]
            allowed = torch.ones(1, p + 1, dtype=torch.bool)
            ref = attention_reference(query[r : r + 1], keys, values, allowed, 0.25)
            torch.testing.assert_close(together[r : r + 1], ref)


def test_batch_invariant_rejects_triton_and_graph_buckets_and_avoids_them_on_auto(tiny_dir):
    with pytest.raises(ConfigError, match="torch attention path"):
        make_engine(tiny_dir, batch_invariant=True, attention_backend="triton")
    with pytest.raises(ConfigError, match="graph_mode='emulate'"):
        make_engine(tiny_dir, batch_invariant=True, graph_mode="emulate")
    with pytest.raises(ConfigError, match="fused_linears=True"):  # one tile of a call's rows
        make_engine(tiny_dir, batch_invariant=True, fused_linears=True)
    # On CUDA, 'auto' picks torch attention and eager execution in this mode.
    assert resolve_attention_backend("auto", "cuda:0", batch_invariant=True) == "torch"
    assert resolve_attention_backend("auto", "cuda:0") == "triton"
    config = EngineConfig.from_engine_args(device="cuda", batch_invariant=True)
    assert effective_graph_mode(config) == "off"
    assert effective_graph_mode(EngineConfig.from_engine_args(device="cuda")) == "capture"


def test_batch_invariant_turns_cascade_attention_off(tiny_dir):
    # Cascade groups rows over a shared prefix: unset, it is off in this mode; asked for, an
    # error at start-up.
    with pytest.raises(ConfigError, match="cascade_attention=True"):
        make_engine(tiny_dir, batch_invariant=True, cascade_attention=True)
    engine = make_engine(tiny_dir, batch_invariant=True, enable_prefix_caching=True)
    assert isinstance(engine.runner.attention, RowInvariantTorchBackend)
    assert not engine.runner.attention.cascade
    assert make_engine(tiny_dir, enable_prefix_caching=True).runner.attention.cascade


TARGET_PROMPT = [17, 250, 3, 99, 41, 7, 300, 12, 88, 5, 61, 140, 9]
TARGET_PARAMS = SamplingParams(
    max_tokens=12, temperature=0.8, seed=11, exit_threshold=0.4, logprobs=3, ignore_eos=True
)


def _others() -> list[tuple[str, list[int], SamplingParams, int]]:
    """Requests that share the target's calls: staggered arrivals, other depths and exits."""
    work = []
    for i, (length, threshold, min_loops, arrival) in enumerate(
        [(21, 0.3, 1, 0), (5, 0.9, 2, 1), (9, 1.0, 1, 2), (14, 0.5, 1, 4), (3, 0.7, 3, 6)]
    ):
        prompt = [(37 * i + 11 * j + 1) % 512 for j in range(length)]
        params = SamplingParams(
            max_tokens=9 + i,
            temperature=0.0 if i % 2 else 1.0,
            seed=300 + i,
            exit_threshold=threshold,
            min_loops=min_loops,
            ignore_eos=True,
        )
        work.append((f"o{i}", prompt, params, arrival))
    return work


class TargetWatch:
    """Per step: the target's KV planes at every point between two of its tokens (keyed by
    the number of final positions), its exit hazards by (position, depth), and whether its
    items shared the step's core calls with other requests' items at other depths."""

    def __init__(self, engine, target: str = "t") -> None:
        self.target = target
        self.snapshots: dict[int, torch.Tensor] = {}
        self.hazards: dict[tuple[int, int], float] = {}  # (position, depth) -> hazard
        self.shared_steps = 0
        self.replay_shared_steps = 0
        self.mixed_depth_steps = 0
        engine.core.add_observer(self._on_step)

    def _on_step(self, scheduled, output) -> None:
        # (request, last position, depth, hazards read, kind) of every decode row and item.
        groups = []
        if scheduled.decode is not None:
            rows, results = scheduled.decode, output.decode
            for i, request_id in enumerate(rows.request_ids):
                hazard = results.hazards[i]
                hazards = () if np.isnan(hazard) else (float(hazard),)
                groups.append(
                    (request_id, int(rows.positions[i]), int(rows.depths[i]), hazards, "decode")
                )
        for item, result in zip(scheduled.items, output.results):
            last_position = item.token_start + item.token_count - 1
            groups.append(
                (item.request_id, last_position, item.depth, result.hazards, item.kind.value)
            )
        mine = [g for g in groups if g[0] == self.target]
        others = [g for g in groups if g[0] != self.target]
        for _, last_position, depth, hazards, _ in mine:
            for k, hazard in enumerate(hazards):
                # A replay that reads a hazard again must read the same bits.
                assert self.hazards.setdefault((last_position, depth + k), hazard) == hazard
        if mine and others:
            self.shared_steps += 1
            self.replay_shared_steps += any(kind == "replay" for *_, kind in mine)
            depths = {depth for _, _, depth, _, _ in mine}
            self.mixed_depth_steps += any(depth not in depths for _, _, depth, _, _ in others)

    def snapshot(self, engine) -> None:
        request = engine.scheduler.requests.get(self.target)
        between_tokens = (
            request is not None
            and self.target in engine.kv.tables
            and not request.in_prompt_phase
            and request.replay is None
            and engine.scheduler.token_depth(self.target) == 0
        )
        if between_tokens:
            position = request.next_position
            self.snapshots[position] = kv_planes(engine, self.target, position)


def _run(tiny_dir, engine_args, *, busy: bool, preempt_after: int | None = None):
    """Run the target alone or among `_others()`; optionally preempt it (recompute) once it
    has `preempt_after` tokens. Returns (its output, the watch, replay (before, after))."""
    engine = make_engine(tiny_dir, **engine_args)
    watch = TargetWatch(engine)
    work = [("t", TARGET_PROMPT, TARGET_PARAMS, 3 if busy else 0)]
    work += _others() if busy else []
    replay: list[torch.Tensor] = []

    def on_step(engine) -> None:
        watch.snapshot(engine)
        request = engine.scheduler.requests.get("t")
        if (
            preempt_after is not None
            and not replay
            and request is not None
            and request.next_position in watch.snapshots
            and len(request.output_token_ids) >= preempt_after
        ):
            replay.append(watch.snapshots[request.next_position])
            engine.scheduler.preempt("t")

    finished = run_steps(engine, work, on_step=on_step)
    return engine, finished["t"], watch, replay


ARMS = {
    "last_exited-mixed": dict(
        layout="last_exited", prefill_mode="per_depth", mixed_prefill_decode=True
    ),
    "last_exited-wavefront-lookahead": dict(
        layout="last_exited", prefill_mode="wavefront", exit_mode="random_lookahead"
    ),
    "shared-atomic": dict(layout="shared", prefill_mode="atomic"),
}


@pytest.mark.parametrize("arm", list(ARMS))
def test_request_alone_and_in_busy_engine_get_identical_bits(tiny_dir, arm):
    """With a recompute preemption of the target while the others keep running: its replayed
    planes equal the planes before preemption, and every plane it ever wrote, every token,
    exit depth and logprob equal the lone run's, bit for bit."""
    args = dict(ARMS[arm], batch_invariant=True, enable_prefix_caching=False)
    _, alone, alone_watch, _ = _run(tiny_dir, args, busy=False)
    engine, busy, busy_watch, replay = _run(tiny_dir, args, busy=True, preempt_after=6)
    assert busy_watch.shared_steps > 5 and busy_watch.mixed_depth_steps > 0
    assert busy_watch.replay_shared_steps > 0  # the replay ran beside other requests' rows
    assert engine.scheduler.memory_stats.num_preemptions_recompute == 1
    assert busy.metrics.num_preemptions == 1
    assert any(d < 4 for d in alone.exit_depths[1:]), (
        "early exits happened (LAST_EXITED: finalize copies)"
    )
    # The replay rebuilt the planes while other requests shared its calls.
    position = replay[0].shape[3]
    rebuilt = [s for p, s in busy_watch.snapshots.items() if p > position]
    assert rebuilt, "the target ran tokens after its replay"
    assert torch.equal(rebuilt[0][:, :, :, :position], replay[0])
    # Alone vs busy: outputs and every between-token KV snapshot, bit for bit.
    assert (busy.token_ids, busy.exit_depths) == (alone.token_ids, alone.exit_depths)
    assert busy.logprobs == alone.logprobs and len(alone.logprobs) == 12
    assert busy_watch.snapshots.keys() == alone_watch.snapshots.keys()
    for position, planes in alone_watch.snapshots.items():
        assert torch.equal(busy_watch.snapshots[position], planes), position
    assert len(alone_watch.hazards) > 12 and busy_watch.hazards == alone_watch.hazards


def test_default_mode_busy_engine_changes_bits(tiny_dir):
    """Control for the test above (measured on this CPU): without batch-invariant mode the
    same busy run gives the same tokens but other bits in some KV plane and logprob."""
    args = dict(ARMS["last_exited-mixed"], batch_invariant=False, enable_prefix_caching=False)
    _, alone, alone_watch, _ = _run(tiny_dir, args, busy=False)
    _, busy, busy_watch, _ = _run(tiny_dir, args, busy=True, preempt_after=6)
    assert (busy.token_ids, busy.exit_depths) == (alone.token_ids, alone.exit_depths)
    assert busy_watch.snapshots.keys() == alone_watch.snapshots.keys()
    differs = busy.logprobs != alone.logprobs and any(
        not torch.equal(busy_watch.snapshots[p], planes)
        for p, planes in alone_watch.snapshots.items()
    )
    host_control(differs, "a busy default-mode engine")


def test_bench_batch_invariant_times_both_modes_on_one_workload(tiny_dir, tmp_path):
    from loopserve.cli.main import main

    out = tmp_path / "bench.json"
    argv = ["bench", "batch-invariant", "--model", str(tiny_dir), "--num-requests", "3"]
    argv += ["--output-len", "3", "5", "--repeats", "2", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert [len(v) for v in result["tok_per_s_all"].values()] == [2, 2]
    rates = result["tok_per_s"]
    assert set(rates) == {"default", "batch_invariant"} and min(rates.values()) > 0
    ratio = rates["batch_invariant"] / rates["default"]
    assert result["batch_invariant_over_default"] == pytest.approx(ratio)
    assert isinstance(result["same_outputs"], bool)


def test_prefix_cache_hit_changes_no_bits(tiny_dir):
    """A target whose first two pages come from the prefix cache (written by another request,
    so its prompt re-runs from a later start, in other chunks) gets the bits of a run without
    caching: planes, hazards and logprobs. (Measured: in the default mode the logprobs of this
    same pair of runs differ.)"""
    base = dict(layout="last_exited", prefill_mode="wavefront", batch_invariant=True)
    engine = make_engine(tiny_dir, **base, enable_prefix_caching=False)
    alone_watch = TargetWatch(engine)
    target = [("t", TARGET_PROMPT, TARGET_PARAMS, 0)]
    alone = run_steps(engine, target, on_step=alone_watch.snapshot)["t"]
    engine = make_engine(tiny_dir, **base, enable_prefix_caching=True)
    cached_watch = TargetWatch(engine)
    writer = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    run_steps(engine, [("w", TARGET_PROMPT[:9] + [400, 401, 402], writer, 0)])
    cached = run_steps(engine, target, on_step=cached_watch.snapshot)["t"]
    assert cached.metrics.num_cached_prompt_tokens == 8  # two pages of 4 positions
    assert (cached.token_ids, cached.exit_depths) == (alone.token_ids, alone.exit_depths)
    assert cached.logprobs == alone.logprobs
    assert cached_watch.snapshots.keys() == alone_watch.snapshots.keys()
    for position, planes in alone_watch.snapshots.items():
        assert torch.equal(cached_watch.snapshots[position], planes), position
    assert len(alone_watch.hazards) > 12 and cached_watch.hazards == alone_watch.hazards
