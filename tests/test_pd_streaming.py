"""Streamed prefill/decode hand-off in serving (`PDReplicaPool(kv_handoff="stream")`, the
`--kv-handoff stream` flag) on a local Ray cluster: the decode replica reserves blocks before the
prompt runs, each run of prompt blocks goes to it plane by plane as soon as it is final, and
the final hand-off carries the rest. Outputs equal one colocated engine over every prompt arm,
both layouts, both families and decode-side prefix hits; the decode replica receives all but
the last chunk's blocks as chunks (counted); killing either replica mid-stream loses no request
silently and leaks no block on either side.

One Ray cluster serves the module; one 1P1D pool runs at a time. Skipped without Ray."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import asyncio

import pytest

from tests.optional import require

require("ray", "serve")
ray = pytest.importorskip("ray", reason="needs the optional `ray` extra (pip install '.[ray]')")
from loopserve.llm import LLM
from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopserve.models.registry import read_config
from loopserve.sampling_params import SamplingParams
from tests.pd_pools import (
    DECODE,
    PREFILL,
    collect,
    gather,
    kill_during,
    prompt_ids,
    replica_stats,
    settled,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
BASE = {"dtype": "float32", "num_blocks": 512, "block_size": 4, "max_num_seqs": 4}
SHARED = [prompt_ids(90, 12)]  # three blocks of 4 every "shared" prompt starts with


@pytest.fixture(scope="module")
def huginn_dir(tmp_path_factory):
    return make_tiny_huginn_checkpoint(tmp_path_factory.mktemp("huginn"))


@pytest.fixture
def pools(pd_pools):
    """The module's streaming pool for the engine arguments."""
    return lambda engine_args: pd_pools.get(engine_args, kv_handoff="stream")


def _ouro_args(model_dir, **overrides) -> dict:
    return {"model": str(model_dir), **BASE, "prefill_chunk_size": 8, **overrides}


def _work(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 1 to 41 tokens (two start with SHARED), greedy and seeded sampling, one
    that ends with its first token."""
    lengths = [7, 29, 1, 18, 41]
    prompts = [prompt_ids(seed + k, n) for k, n in enumerate(lengths)]
    prompts[1] = SHARED[0] + prompts[1]
    prompts[3] = SHARED[0] + prompts[3]
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, exit_threshold=0.5, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.0, seed=7, exit_threshold=0.7, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.8, seed=8, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.7, top_k=30, seed=9, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.0, max_loops=2, ignore_eos=True),
    ]  # fmt: skip
    return prompts, params


def _delta(after, before, name: str) -> int:
    return getattr(after, name) - getattr(before, name)


def _assert_equal_to_colocated(pool, loop, engine_args, prompts, params, tag):
    results = gather(
        loop,
        *(collect(pool, f"{tag}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))),
    )
    expected = LLM(**engine_args).generate(prompts, params)
    for (outputs, _), want in zip(results, expected, strict=True):
        final = outputs[-1]
        assert (final.token_ids, final.exit_depths) == (want.token_ids, want.exit_depths)
        assert final.finish_reason == want.finish_reason


# Every prompt arm once, both layouts, decode-side prefix hits in two (a pool costs ~3 s).
CASES = [
    ("last_exited", "per_depth", False, True),
    ("last_exited", "wavefront", False, False),
    ("last_exited", "per_depth", True, True),  # mixed prefill/decode batching
    ("shared", "atomic", False, False),
]


@pytest.mark.parametrize("layout,prefill_mode,mixed,prefix_caching", CASES)
def test_streamed_serving_equals_colocated(
    pools, tiny_tok_dir, loop, layout, prefill_mode, mixed, prefix_caching
):
    args = _ouro_args(
        tiny_tok_dir, layout=layout, prefill_mode=prefill_mode, mixed_prefill_decode=mixed,
        enable_prefix_caching=prefix_caching,
    )  # fmt: skip
    pool = pools(args)
    if prefix_caching:  # the decode replica caches SHARED (a request decoded there)
        gather(loop, collect(pool, "warm", SHARED[0] + [5], SamplingParams(max_tokens=3)))
    before = gather(loop, replica_stats(pool))[0]
    prompts, params = _work(40)
    _assert_equal_to_colocated(pool, loop, args, prompts, params, f"eq-{prefill_mode}")
    after = loop.run_until_complete(asyncio.wait_for(settled(pool), 60.0))
    decode, prefill = after[DECODE], after[PREFILL]
    assert _delta(decode, before[DECODE], "num_imported") == 4  # all but max_tokens=1
    assert _delta(decode, before[DECODE], "num_streamed_imports") >= 3  # 7+ token prompts
    counters = ("num_kv_chunks_sent", "num_kv_chunks_received", "kv_chunk_blocks_received",
                "num_streamed_imports", "instance_id")  # fmt: skip
    window = {  # (before, after) per replica: what a mismatch needs to be explained
        role: {name: (getattr(before[i], name), getattr(after[i], name)) for name in counters}
        for role, i in (("prefill", PREFILL), ("decode", DECODE))
    }
    assert _delta(decode, before[DECODE], "num_kv_chunks_received") == _delta(
        prefill, before[PREFILL], "num_kv_chunks_sent"
    ), window
    for stats in after:  # nothing reserved or held once everything finished
        assert stats.num_reserved == 0
        assert stats.snapshot.kv_blocks_free == stats.snapshot.kv_blocks_total


def test_streamed_huginn_serving_equals_colocated(pools, huginn_dir, loop):
    args = {
        "model": str(huginn_dir), **BASE, "prefill_chunk_size": 5, "exit_criterion": "latent-diff",
        "prefill_mode": "per_depth", "enable_prefix_caching": True,
    }  # fmt: skip
    pool = pools(args)
    prompts = [[(7 * k + 3 * i) % 120 + 1 for i in range(n)] for k, n in enumerate([3, 14, 22])]
    params = [
        SamplingParams(max_tokens=6, temperature=0.0, exit_threshold=0.1, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.0, max_loops=6, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0.0, exit_threshold=0.2, ignore_eos=True),
    ]
    before = gather(loop, replica_stats(pool))[0]
    _assert_equal_to_colocated(pool, loop, args, prompts, params, "huginn")
    after = loop.run_until_complete(asyncio.wait_for(settled(pool), 60.0))
    assert _delta(after[DECODE], before[DECODE], "num_streamed_imports") == 2  # 14, 22 tokens
    for stats in after:
        assert stats.num_reserved == 0
        assert stats.snapshot.kv_blocks_free == stats.snapshot.kv_blocks_total


def test_all_but_the_last_chunk_arrive_as_chunks(pools, tiny_tok_dir, loop):
    """A prompt of n = 6 chunks of 8 tokens (2 blocks each): the decode replica writes at
    least the first n - 1 chunks' blocks as chunks, and the final hand-off carries only what
    the last chunk and the first token add (counted by the replicas, not timed)."""
    args = _ouro_args(tiny_tok_dir, max_num_batched_tokens=8, prefill_mode="per_depth")
    pool = pools(args)
    before = gather(loop, replica_stats(pool))[0]
    prompt = prompt_ids(77, 8 * 6 - 1)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    _assert_equal_to_colocated(pool, loop, args, [prompt], [params], "long")
    after = loop.run_until_complete(asyncio.wait_for(settled(pool), 60.0))
    received = _delta(after[DECODE], before[DECODE], "kv_chunk_blocks_received")
    planes = read_config(tiny_tok_dir)[1].num_loops  # summed over the planes (LAST_EXITED)
    assert received >= (6 - 1) * 2 * planes
    assert received == len(prompt) // 4 * planes  # every complete prompt block, none twice
    assert _delta(after[DECODE], before[DECODE], "num_streamed_imports") == 1


def test_a_failed_chunk_write_replays_the_stream(pools, tiny_tok_dir, loop, monkeypatch):
    """The first chunk write of the submission reports failure (as when the decode replica's
    reservation is gone): the final hand-off does not go on top of it; the request is
    reserved again and every kept chunk is written again before the import, so the tokens
    still equal one colocated engine and nothing stays reserved."""
    from loopserve.distributed.pd_kv_stream import StreamedKV

    args = _ouro_args(tiny_tok_dir, max_num_batched_tokens=8, prefill_mode="per_depth")
    pool = pools(args)
    real = StreamedKV._written
    calls = []

    async def first_fails(self, answer_ref, index):
        ok = await real(self, answer_ref, index)
        calls.append(ok)
        return ok and len(calls) > 1

    monkeypatch.setattr(StreamedKV, "_written", first_fails)
    replays = []
    real_replay = StreamedKV.replay

    async def counted(self, request_id):
        outcome = await real_replay(self, request_id)
        replays.append(outcome)
        return outcome

    monkeypatch.setattr(StreamedKV, "replay", counted)
    before = gather(loop, replica_stats(pool))[0]
    prompt = prompt_ids(81, 40)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    _assert_equal_to_colocated(pool, loop, args, [prompt], [params], "replay")
    after = loop.run_until_complete(asyncio.wait_for(settled(pool), 60.0))
    assert replays == ["replayed"] and calls[0] is True  # the write itself had landed
    received = _delta(after[DECODE], before[DECODE], "kv_chunk_blocks_received")
    # Every block of every plane twice: streamed (plane by plane), then replayed.
    assert received == 2 * (len(prompt) // 4) * read_config(tiny_tok_dir)[1].num_loops
    for stats in after:
        assert stats.num_reserved == 0
        assert stats.snapshot.kv_blocks_free == stats.snapshot.kv_blocks_total


@pytest.mark.parametrize("victim", [PREFILL, DECODE])
def test_a_replica_killed_mid_stream_loses_nothing_silently(pools, tiny_tok_dir, loop, victim):
    """Kill the prefill replica (its half-streamed K/V is released on the decode side; the
    request is re-routed or fails with the retry error) or the decode replica (a request not
    yet taken there is reserved again on it once it is back and its kept chunks replayed;
    one it had taken fails with the retry error) while
    long prompts stream: every stream ends with the colocated tokens or the retry error,
    never short, and once both replicas serve again neither holds a block or a reservation."""
    args = _ouro_args(tiny_tok_dir, max_num_batched_tokens=8, prefill_mode="per_depth")
    pool = pools(args)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    requests = [(f"kill{victim}-{i}", prompt_ids(200 + i, 60)) for i in range(4)]
    expected = {
        rid: out.token_ids
        for (rid, _), out in zip(requests, LLM(**args).generate([p for _, p in requests], params))
    }
    chunks_seen = lambda: any(s.handoffs.kv_stream.writes for s in pool.streams)  # noqa: E731
    done = kill_during(pool, loop, requests, params, chunks_seen, victim)
    for request_id, how, outputs in done:
        assert how in ("done", "failed"), request_id
        if how == "done":
            assert outputs[-1].finished and outputs[-1].token_ids == expected[request_id]
    assert pool.replicas[victim].num_restarts >= 1
    after = loop.run_until_complete(asyncio.wait_for(settled(pool), 60.0))
    for stats in after:
        assert stats.num_reserved == 0
        assert stats.snapshot.kv_blocks_free == stats.snapshot.kv_blocks_total
    assert pool.num_in_flight == 0 and not pool.streams
    # Both replicas serve streamed hand-offs again.
    _assert_equal_to_colocated(pool, loop, args, [prompt_ids(300, 30)], [params], f"again{victim}")


def test_a_decode_replica_short_of_blocks_preempts_streamed_requests_exactly(
    pools, tiny_tok_dir, loop
):
    """96 blocks on each replica (24 positions per plane): five 16-token prompts that grow to
    40 positions; reservations that do not fit make those hand-offs whole, and the decode
    replica preempts imported requests as they grow: every request still equals colocated,
    and nothing stays reserved or held."""
    args = _ouro_args(tiny_tok_dir, num_blocks=96, prefill_chunk_size=4)
    pool = pools(args)
    before = gather(loop, replica_stats(pool))[0]
    prompts = [prompt_ids(120 + k, 16) for k in range(5)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True) for _ in prompts]
    _assert_equal_to_colocated(pool, loop, args, prompts, params, "short")
    after = loop.run_until_complete(asyncio.wait_for(settled(pool), 60.0))
    snap_before, snap_after = before[DECODE].snapshot, after[DECODE].snapshot
    preempted = (snap_after.num_preemptions_recompute + snap_after.num_preemptions_swap) - (
        snap_before.num_preemptions_recompute + snap_before.num_preemptions_swap
    )
    assert preempted > 0
    assert _delta(after[DECODE], before[DECODE], "num_streamed_imports") > 0
    for stats in after:
        assert stats.num_reserved == 0
        assert stats.snapshot.kv_blocks_free == stats.snapshot.kv_blocks_total
