"""Prefix caching: outputs equal caching off and the reference; hits, sharing and eviction."""

from __future__ import annotations

import pytest

from loopserve.sampling_params import SamplingParams
from tests.engine_utils import make_engine, reference_for, run_steps

SYSTEM = [11, 22, 33, 44, 55, 66, 77, 88, 99, 12, 13, 14, 15]  # 13 tokens: 3 full pages of 4


def _run(engine, work):
    finished = run_steps(engine, work)
    return {rid: (out.token_ids, out.exit_depths) for rid, out in finished.items()}, finished


def _params(i: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=6, temperature=0.0 if i % 2 else 0.9, seed=300 + i, exit_threshold=0.6
    )


@pytest.mark.parametrize(
    "layout,arm",
    [
        ("last_exited", {"prefill_mode": "atomic"}),
        ("last_exited", {"prefill_mode": "wavefront", "prefill_chunk_size": 4}),
        ("last_exited", {"prefill_mode": "per_depth", "mixed_prefill_decode": True}),
        ("shared", {"prefill_mode": "atomic"}),
    ],
    ids=["atomic", "wavefront", "mixed", "shared"],
)
def test_shared_system_prompt_hits_and_matches_caching_off(tiny_dir, layout, arm):
    # r0 runs first; r1..r3 (same system prompt, own suffixes) arrive after it finished its
    # prompt; r4 repeats r1 exactly, r5 is a 12-token prompt that ends on a block boundary.
    work = [("r0", SYSTEM + [1, 2], _params(0), 0)]
    # (SHARED runs prompts one position per step: r0's prompt takes 15 steps.)
    work += [(f"r{i}", SYSTEM + [i, i + 1, i + 2], _params(i), 20) for i in (1, 2, 3)]
    work += [("r4", SYSTEM + [1, 2, 3], _params(4), 24)]
    work += [("r5", SYSTEM[:12], _params(5), 26)]
    engine = make_engine(tiny_dir, layout=layout, enable_prefix_caching=True, **arm)
    cached, finished = _run(engine, work)
    off = make_engine(tiny_dir, layout=layout, enable_prefix_caching=False, **arm)
    uncached, _ = _run(off, work)
    assert cached == uncached
    for request_id, prompt, params, _ in work:
        ref = reference_for(engine, prompt, params)
        assert cached[request_id] == (ref.token_ids, ref.exit_depths), request_id
    hits = {rid: out.metrics.num_cached_prompt_tokens for rid, out in finished.items()}
    # 3 full pages of the system prompt; r5's last page holds its last prompt position, which
    # is always recomputed, so it reuses 2 pages.
    assert hits == {"r0": 0, "r1": 12, "r2": 12, "r3": 12, "r4": 12, "r5": 8}
    stats = engine.kv.prefix_cache.stats
    assert stats.num_hit_tokens == 56
    assert stats.num_queried_tokens == sum(len(w[1]) for w in work)
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_concurrent_prompts_share_only_complete_pages(tiny_dir):
    # Both arrive together under wavefront: b cannot hit a's pages before they are complete
    # at every plane, and b's own copies stay private (same content already published).
    # `run_steps` checks after every step that no request's cached pages are still written.
    engine = make_engine(
        tiny_dir, prefill_mode="wavefront", prefill_chunk_size=4, max_num_batched_tokens=8
    )
    params = SamplingParams(max_tokens=4, temperature=0)
    work = [("a", SYSTEM + [1], params, 0), ("b", SYSTEM + [2], params, 0)]
    work.append(("c", SYSTEM + [3], params, 30))
    cached, finished = _run(engine, work)
    for request_id, prompt, p, _ in work:
        ref = reference_for(engine, prompt, p)
        assert cached[request_id] == (ref.token_ids, ref.exit_depths)
    assert finished["b"].metrics.num_cached_prompt_tokens == 0
    assert finished["c"].metrics.num_cached_prompt_tokens == 12


def test_lru_eviction_under_pressure_keeps_outputs_exact(tiny_dir):
    # 40 blocks (10 positions x 4 planes of room per block index): every finished prompt
    # leaves cached pages behind and new ones must evict them.
    engine = make_engine(tiny_dir, num_blocks=40, block_size=4, max_num_seqs=2)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompts = [[i * 7 % 500 + j for j in range(13)] for i in range(1, 7)]
    work = [(f"p{i}", prompt, params, i * 3) for i, prompt in enumerate(prompts)]
    work.append(("again", prompts[-1], params, 40))  # the most recent: still cached
    cached, finished = _run(engine, work)
    stats = engine.kv.prefix_cache.stats
    assert stats.num_evicted_pages > 0
    assert finished["again"].metrics.num_cached_prompt_tokens == 12
    for request_id, prompt, p, _ in work:
        ref = reference_for(engine, prompt, p)
        assert cached[request_id] == (ref.token_ids, ref.exit_depths)
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_pages_filled_by_a_copy_are_not_scored_and_scored_matches_stop_there():
    """Pages published by a request whose blocks came by copy (swap-in, KV import) have no
    stored last-loop outputs: a scoring lookup stops at the first such page, a plain one
    does not."""
    from loopserve.scheduler.kv_cache import KVCacheManager
    from loopserve.scheduler.prefix_cache import PrefixCache

    kv = KVCacheManager(64, 4, 2, prefix_cache=PrefixCache(4, 2))
    prompt = list(range(1, 14))  # 3 full pages
    kv.match_prefix("own", prompt)
    kv.allocate("own", len(prompt))
    kv.publish_prompt("own", 8)  # its own prompt calls wrote pages 0 and 1
    hits = kv.match_prefix("copied", prompt)
    assert len(hits) == 2
    kv.allocate("copied", len(prompt), prefix=hits)
    kv.mark_unscored("copied")
    kv.publish_prompt("copied", 12)  # page 2 arrives from a copy (pages 0, 1 are cached)
    assert kv.prefix_cache is not None
    assert len(kv.prefix_cache.pages) == 3
    assert [len(kv.match_prefix(r, prompt)) for r in ("a", "b")] == [3, 3]
    assert len(kv.match_prefix("c", prompt, scored_only=True)) == 2
    kv.forget("copied")
    assert "copied" not in kv._unscored
