"""Triton kernels vs the torch reference backend, on CPU under the Triton interpreter.

Kernels pick their form per launch (`triton_jit.device_kernel`: interpreted for CPU
tensors, compiled for CUDA ones), so nothing is set at import. `TRITON_INTERPRET=1` is set
per test (an autouse fixture) only because the attention registry asks for it before it
lets an engine choose the Triton backend on CPU. Skipped, with the reason, only when triton
is not installed (it is in the `dev` extra). Shapes are small: the interpreter runs every
program in Python.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton not installed (pip install -e '.[dev]')")

from loopserve.errors import ConfigError  # noqa: E402
from loopserve.runner.attention import triton_kernels  # noqa: E402
from loopserve.runner.attention.base import RowSegment  # noqa: E402
from loopserve.runner.attention.registry import (  # noqa: E402
    make_attention_backend,
    resolve_attention_backend,
)
from loopserve.runner.attention.torch_paged import TorchBackend  # noqa: E402
from loopserve.runner.attention.triton_backend import TritonBackend  # noqa: E402
from loopserve.runner.attention.triton_jit import observe_launches  # noqa: E402
from loopserve.runner.graph_buffers import GRAPH_MAX_CONTEXT  # noqa: E402
from loopserve.sampling_params import SamplingParams  # noqa: E402
from tests.engine_utils import (  # noqa: E402
    assert_match_reference,
    make_engine,
    reference_for,
    run_steps,
)


@pytest.fixture(autouse=True)
def _interpreter_allowed(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


NUM_LAYERS, HEAD_DIM = 2, 16


def random_cache(seed: int, num_blocks: int, block_size: int, num_kv_heads: int):
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_LAYERS, 2, num_blocks * block_size, num_kv_heads, HEAD_DIM)
    return torch.randn(shape, generator=generator)


def random_tables(seed: int, num_tables: int, num_blocks: int, width: int) -> list[list[int]]:
    """Disjoint block tables (one per request plane) in a shuffled order."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    return [order[i * width : (i + 1) * width] for i in range(num_tables)]


def run_both(segments, cache, block_size, num_heads, seed, **triton_kwargs):
    """Outputs of both backends for every layer, and their caches afterwards."""
    generator = torch.Generator().manual_seed(seed)
    rows = sum(seg.count for seg in segments)
    num_kv_heads = cache.shape[3]
    reference = TorchBackend(cache.clone(), block_size=block_size, scale=0.3)
    fast = TritonBackend(cache.clone(), block_size=block_size, scale=0.3, **triton_kwargs)
    outs = []
    for layer_idx in range(NUM_LAYERS):
        query = torch.randn(rows, num_heads, HEAD_DIM, generator=generator)
        key = torch.randn(rows, num_kv_heads, HEAD_DIM, generator=generator)
        value = torch.randn(rows, num_kv_heads, HEAD_DIM, generator=generator)
        expected = reference.prepare(segments).attend(layer_idx, query, key, value)
        actual = fast.prepare(segments).attend(layer_idx, query, key, value)
        outs.append((expected, actual))
    return outs, reference.kv_cache, fast.kv_cache


@pytest.mark.parametrize("split_len", [1024, 8], ids=["one_split", "split_k"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)], ids=["mha", "gqa3"])
def test_decode_rows_of_different_planes_and_lengths_match_torch(
    num_heads, num_kv_heads, split_len
):
    block_size = 5  # odd: positions of one tile span several blocks
    tables = random_tables(11, 4, 40, 10)
    # Rows of one call: different planes (tables) and positions, one of them at position 0.
    segments = [RowSegment(tables[0], 37, 1), RowSegment(tables[1], 0, 1)]
    segments += [RowSegment(tables[2], 12, 1), RowSegment(tables[3], 23, 1)]
    cache = random_cache(3, 40, block_size, num_kv_heads)
    outs, ref_cache, fast_cache = run_both(
        segments, cache, block_size, num_heads, seed=5, split_len=split_len, decode_block_n=4
    )
    num_splits = -(-38 // split_len)
    assert num_splits == (1 if split_len == 1024 else 5)  # split-K really runs when asked
    for expected, actual in outs:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(fast_cache, ref_cache)


def test_each_row_splits_its_own_context_over_a_launch_sized_for_longer_ones():
    """A launch with the split count of a long bound (as a graph bucket fixes it from
    max_model_len): a short row's context is divided among the splits too, in whole tiles
    (not left to split 0 with the other programs idle), and the result equals torch."""
    block_size, block_n = 4, 4
    tables = random_tables(31, 2, 40, 20)
    cache = random_cache(7, 40, block_size, 2)
    generator = torch.Generator().manual_seed(8)
    query = torch.randn(2, 2, HEAD_DIM, generator=generator)
    seq_lens = torch.tensor([13, 70], dtype=torch.int32)
    out = torch.empty_like(query)
    with observe_launches() as launches:
        triton_kernels.decode_attention(
            query, cache[0, 0], cache[0, 1], out,
            tables=torch.tensor(tables, dtype=torch.int32),
            table_idx=torch.tensor([0, 1], dtype=torch.int32),
            rows=torch.tensor([0, 1], dtype=torch.int32), seq_lens=seq_lens,
            max_seq_len=80, scale=0.3, block_size=block_size, split_len=16, block_n=block_n,
        )  # fmt: skip
    (decode,) = [lch for lch in launches if lch.kernel.fn.__name__ == "_decode_kernel"]
    assert decode.grid[2] == 5  # ceil(80 / 16) splits for every row
    part_lse = decode.args[9]  # [rows, heads, splits]
    tile = decode.constexprs["BLOCK_N"]
    for row, length in enumerate(seq_lens.tolist()):
        per_split = math.ceil(math.ceil(length / 5) / tile) * tile  # in whole tiles
        working = math.ceil(length / per_split)
        assert torch.isfinite(part_lse[row, :, :working]).all()
        assert torch.isinf(part_lse[row, :, working:]).all()
    # The 13-position row works in more than split 0 (a split length of 16 kept it there).
    assert torch.isfinite(part_lse[0, :, 1]).all()
    reference = TorchBackend(cache.clone(), block_size=block_size, scale=0.3)
    segments = [RowSegment(tables[0], 12, 1), RowSegment(tables[1], 69, 1)]
    meta = reference.prepare(segments)
    expected = meta.attend(
        0, query, cache[0, 0, meta.meta.write_slots], cache[0, 1, meta.meta.write_slots]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_the_last_split_to_finish_merges_them_in_the_same_launch():
    """With `counters` the decode launch merges its splits itself (the last split of each row
    and KV head to finish reads the others' partials): no reduce launch, the same output as
    the two-launch path (to float32 rounding: it sums splits 8 at a time), empty splits of a
    short row included, more splits than one merge tile, and the counters left at zero for
    the next launch (a graph replays with the same buffer). Grouped query heads, 3 per KV
    head: a padded head tile."""
    block_size, block_n, num_heads, num_kv_heads = 4, 4, 6, 2
    tables = random_tables(41, 3, 120, 40)
    cache = random_cache(9, 120, block_size, num_kv_heads)
    query = torch.randn(3, num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(10))
    args = dict(
        tables=torch.tensor(tables, dtype=torch.int32),
        table_idx=torch.tensor([0, 1, 2], dtype=torch.int32),
        rows=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([9, 160, 33], dtype=torch.int32),
        max_seq_len=160, scale=0.3, block_size=block_size, split_len=4, block_n=block_n,
    )  # fmt: skip
    two_launches, merged = torch.empty_like(query), torch.empty_like(query)
    triton_kernels.decode_attention(query, cache[0, 0], cache[0, 1], two_launches, **args)
    counters = torch.zeros(16, dtype=torch.int32)
    with observe_launches() as launches:
        triton_kernels.decode_attention(
            query, cache[0, 0], cache[0, 1], merged, counters=counters, **args
        )
    assert [lch.kernel.fn.__name__ for lch in launches] == ["_decode_kernel"]
    assert launches[0].grid[2] > triton_kernels.MERGE_SPLITS  # two merge tiles
    torch.testing.assert_close(merged, two_launches, atol=1e-6, rtol=1e-6)
    assert not counters.any()
    # Too few counters for rows x KV heads: the reduce launch, as without them.
    with observe_launches() as launches:
        triton_kernels.decode_attention(
            query, cache[0, 0], cache[0, 1], merged, counters=counters[:2], **args
        )
    assert [lch.kernel.fn.__name__ for lch in launches] == [
        "_decode_kernel",
        "_decode_reduce_kernel",
    ]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2)], ids=["mha", "gqa2"])
def test_prompt_chunks_of_several_requests_and_depths_share_one_launch(num_heads, num_kv_heads):
    block_size = 3
    tables = random_tables(21, 5, 80, 16)
    segments = [
        RowSegment(tables[0], 7, 1),  # a decode row rides along
        RowSegment(tables[1], 0, 19),  # first chunk of a prompt: two tiles of 16, causal only
        RowSegment(tables[2], 11, 5),  # later chunk: cached context + causal within the chunk
        RowSegment(tables[3], 30, 17),  # another request at another plane, 2 tiles
        RowSegment(tables[4], 2, 1),
    ]
    cache = random_cache(4, 80, block_size, num_kv_heads)
    outs, ref_cache, fast_cache = run_both(
        segments, cache, block_size, num_heads, seed=6, prefill_block_m=16, prefill_block_n=16
    )
    for expected, actual in outs:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(fast_cache, ref_cache)


def test_kv_write_puts_each_row_at_its_plane_slot():
    block_size = 3
    cache = torch.zeros(NUM_LAYERS, 2, 12 * block_size, 2, HEAD_DIM)
    backend = TritonBackend(cache, block_size=block_size, scale=1.0)
    segments = [RowSegment([4, 9], 4, 1), RowSegment([7, 2, 11], 2, 3)]
    key = torch.arange(4 * 2 * HEAD_DIM, dtype=torch.float32).view(4, 2, HEAD_DIM)
    backend.prepare(segments).attend(1, torch.zeros(4, 2, HEAD_DIM), key, -key)
    # position 4 in table [4, 9] -> block 9 offset 1; positions 2,3,4 in [7, 2, 11] ->
    # block 7 offset 2, then block 2 offsets 0 and 1 (across a block boundary).
    expected_slots = [9 * 3 + 1, 7 * 3 + 2, 2 * 3 + 0, 2 * 3 + 1]
    torch.testing.assert_close(cache[1, 0, expected_slots], key, atol=0, rtol=0)
    torch.testing.assert_close(cache[1, 1, expected_slots], -key, atol=0, rtol=0)
    written = torch.zeros(cache.shape[2], dtype=torch.bool)
    written[expected_slots] = True
    assert not cache[1, :, ~written].any() and not cache[0].any()  # nothing else touched


def test_finalize_copies_every_layer_of_every_exiting_row_in_one_launch():
    cache = random_cache(8, 10, 4, 2)
    before = cache.clone()
    backend = TritonBackend(cache, block_size=4, scale=1.0)
    src, dst = torch.tensor([3, 3, 17]), torch.tensor([21, 30, 38])
    backend.finalize(src, dst)
    for s, d in zip(src.tolist(), dst.tolist()):
        assert torch.equal(cache[:, :, d], before[:, :, s])  # all layers, K and V
    untouched = [i for i in range(40) if i not in (21, 30, 38)]
    assert torch.equal(cache[:, :, untouched], before[:, :, untouched])


def test_auto_backend_is_triton_on_cuda_and_torch_on_cpu(monkeypatch):
    assert resolve_attention_backend("auto", "cuda:0") == "triton"
    assert resolve_attention_backend("auto", "cpu") == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        make_attention_backend("triton", torch.zeros(1, 2, 4, 1, 1), block_size=4, scale=1.0)
    with pytest.raises(ConfigError, match="attention_backend must be one of"):
        resolve_attention_backend("flash", "cpu")


def test_engine_with_triton_backend_matches_dense_reference(tiny_two_loop_dir):
    engine = make_engine(
        tiny_two_loop_dir,
        attention_backend="triton",
        prefill_mode="wavefront",
        mixed_prefill_decode=True,
    )
    assert engine.runner.attention.name == "triton"
    finalized = []
    original = engine.runner.attention.finalize

    def counting_finalize(src, dst):
        finalized.append(src.numel())
        original(src, dst)

    engine.runner.attention.finalize = counting_finalize
    prompts = {"a": [5, 9, 2, 7, 1, 3, 8, 4, 6, 11, 13, 17, 19, 23, 29], "b": [40, 41, 42]}
    work = [
        ("a", prompts["a"], SamplingParams(max_tokens=4, exit_threshold=0.5, temperature=0.0), 0),
        ("b", prompts["b"], SamplingParams(max_tokens=4, exit_threshold=0.7, seed=3), 0),
        ("c", [100 + i for i in range(9)], SamplingParams(max_tokens=3, temperature=0.0), 2),
    ]
    depths = assert_match_reference(engine, work, run_steps(engine, work))
    assert min(depths) < 2 and max(depths) == 2  # early exits and full-depth tokens both ran
    assert sum(finalized) > 0  # finalize copies went through the triton kernel


def test_auto_split_fills_the_device_only_when_rows_are_few():
    from loopserve.runner.attention.triton_backend import auto_split_len

    # 1 row x 16 KV heads on 132 SMs wants 17 splits; 4096 positions allow up to 32 of 128.
    assert auto_split_len(1, 16, 4096, 132) == 241  # ceil(4096 / 17)
    assert auto_split_len(1, 16, 300, 132) == 150  # at most 300 // 128 = 2 splits
    assert auto_split_len(64, 16, 4096, 132) == 4096  # 1024 programs already: one split
    assert auto_split_len(1, 16, 100, 132) == 100  # too short to split


@pytest.mark.parametrize("split_len", [1024, 8], ids=["one_split", "split_k"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)], ids=["mha", "gqa3"])
def test_cascade_groups_match_plain_torch_attention(num_heads, num_kv_heads, split_len):
    """Decode rows sharing leading blocks at two planes (partial suffix blocks, a row that
    cuts its group's prefix, an ungrouped row, a prompt chunk) under the Triton cascade path:
    the prefix once per group, the suffix through the decode kernel with its log-sum-exp."""
    block_size = 4
    segments = [
        RowSegment([1, 2, 3, 10], 13, 1),  # plane-0 group
        RowSegment([30, 31, 32], 9, 1),  # plane-1 group
        RowSegment([1, 2, 3, 11, 12], 18, 1),  # plane-0 group, suffix over two blocks
        RowSegment([20, 21, 22], 5, 4),  # a prompt chunk
        RowSegment([30, 31, 33], 10, 1),  # plane-1 group
        RowSegment([1, 2, 13], 8, 1),  # plane-0 group: only 2 shared blocks
        RowSegment([25, 26], 6, 1),  # alone
    ]
    cache = random_cache(8, 40, block_size, num_kv_heads)
    reference = TorchBackend(cache.clone(), block_size=block_size, scale=0.3)
    fast = TritonBackend(
        cache.clone(),
        block_size=block_size,
        scale=0.3,
        split_len=split_len,
        decode_block_n=4,
        cascade=True,
    )
    generator = torch.Generator().manual_seed(9)
    rows = sum(seg.count for seg in segments)
    for layer_idx in range(NUM_LAYERS):
        query = torch.randn(rows, num_heads, HEAD_DIM, generator=generator)
        key = torch.randn(rows, num_kv_heads, HEAD_DIM, generator=generator)
        value = torch.randn(rows, num_kv_heads, HEAD_DIM, generator=generator)
        expected = reference.prepare(segments).attend(layer_idx, query, key, value)
        actual = fast.prepare(segments).attend(layer_idx, query, key, value)
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(fast.kv_cache, reference.kv_cache)
    # Two groups per call (plane 0: rows 0, 2, 5 over 2 blocks; plane 1: rows 1, 4 over 2).
    stats = fast.cascade_stats
    assert (stats.num_calls, stats.num_groups, stats.num_grouped_rows) == (2, 4, 10)
    assert stats.num_shared_positions == 2 * (2 * 8 + 1 * 8)
    assert reference.cascade_stats.num_groups == 0


def test_engine_with_triton_cascade_matches_dense_reference(tiny_two_loop_dir):
    from tests.test_cascade_attention import _work

    engine = make_engine(tiny_two_loop_dir, attention_backend="triton", max_num_seqs=6)
    assert engine.runner.attention.cascade  # on by default: prefix caching is on
    finished = run_steps(engine, _work(num_followers=2))
    for request_id, prompt, params, _ in _work(num_followers=2):
        ref = reference_for(engine, prompt, params)
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), request_id
    assert engine.runner.attention.cascade_stats.num_groups > 0


def test_kernels_run_interpreted_on_cpu_tensors_without_the_environment_variable(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    cache = random_cache(7, 8, 4, 2)
    key = torch.randn(3, 2, HEAD_DIM)
    value = torch.randn(3, 2, HEAD_DIM)
    slots = torch.tensor([5, 17, 30])
    triton_kernels.write_kv(key, value, cache[1, 0], cache[1, 1], slots)
    assert torch.equal(cache[1, 0, slots], key) and torch.equal(cache[1, 1, slots], value)


@pytest.mark.parametrize("group,expected", [(1, 16), (2, 16), (3, 8), (4, 8), (8, 8)])
def test_decode_positions_per_step_shrink_for_wide_groups(group, expected):
    # [group (>= 2, pow2), block_n, head_dim 128] fp32 products stay within 4096 elements
    # (8 positions at the least).
    assert triton_kernels.decode_block_n(32, group, 128) == expected


def _nan_outside_live_context(engine):
    """Fill the whole KV cache with NaN: every slot a row may read must be written first, so
    any read past a row's context (the rest of its last block, padding, other blocks of
    the table buffer) turns its output into NaN."""
    engine.runner.kv_cache.fill_(float("nan"))


def _graph_workload():
    work = []
    for i, length in enumerate([3, 9, 14, 6, 21]):
        params = SamplingParams(
            max_tokens=5 + i, temperature=0.0 if i % 2 else 0.8, seed=70 + i,
            exit_threshold=(0.4, 0.7, 1.0)[i % 3], ignore_eos=True,
        )  # fmt: skip
        work.append((f"r{i}", [(29 * i + 7 * j + 3) % 256 for j in range(length)], params, i))
    return work


def test_emulated_graphs_over_the_triton_kernel_read_only_live_context(tiny_two_loop_dir):
    """graph_mode=emulate + attention_backend=triton runs the graphed code path (static
    buffers, the Triton decode kernel reading them) and equals the dense reference with every
    slot past each row's context holding NaN."""
    engine = make_engine(
        tiny_two_loop_dir, attention_backend="triton", graph_mode="emulate", max_num_seqs=6,
        max_model_len=4096,
    )  # fmt: skip
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.paged
    # No 2,048-position window: the buffers span max_model_len, the gather mask is gone.
    assert graphs.max_blocks * graphs.block_size == 4096 > GRAPH_MAX_CONTEXT
    assert graphs.fits(6, 4000) and graphs.span.numel() == 0
    _nan_outside_live_context(engine)
    work = _graph_workload()
    depths = assert_match_reference(engine, work, run_steps(engine, work))
    assert min(depths) < 2 and max(depths) == 2  # early exits (finalize) and full depth
    stats = engine.stats
    assert stats.num_graph_calls > 0 and stats.num_padded_rows > 0


def test_nan_past_the_context_poisons_the_torch_gather_but_not_the_paged_kernel(tiny_dir):
    """Control for the test above: the torch gather backend reads whole tables, so the same
    NaN fill reaches its outputs (the NaN check can fail)."""
    engine = make_engine(tiny_dir, graph_mode="emulate", max_num_seqs=6, max_model_len=4096)
    assert not engine.runner.graphs.paged
    _nan_outside_live_context(engine)
    work = _graph_workload()[:2]
    finished = run_steps(engine, work)
    refs = [reference_for(engine, prompt, params) for _, prompt, params, _ in work]
    assert any(finished[rid].token_ids != ref.token_ids for (rid, *_), ref in zip(work, refs))
