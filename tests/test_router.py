"""The data-parallel router's bookkeeping and policies, without Ray: outstanding tokens per
replica, least-load choice, prefix keys over full KV blocks, and the load fallback."""

from __future__ import annotations

import hashlib

import pytest

from loopserve.distributed.router import RoutedRequest, Router, prefix_block_hashes


def test_prefix_keys_cover_full_blocks_only_and_chain_the_previous_block():
    ids = list(range(10))  # blocks of 4: [0..3], [4..7], partial [8, 9]
    hashes = prefix_block_hashes(ids, block_size=4)
    assert len(hashes) == 2
    first = hashlib.blake2b(b"", digest_size=16)
    first.update(b"".join(t.to_bytes(8, "little", signed=True) for t in range(4)))
    assert hashes[0] == first.digest()
    # Same second block after a different first block: a different key (chained).
    other = prefix_block_hashes([9, 9, 9, 9, 4, 5, 6, 7], block_size=4)
    assert other[1] != hashes[1]
    assert prefix_block_hashes(ids[:8] + [42, 43], block_size=4) == hashes


def test_least_load_counts_prompt_until_first_token_then_remaining_tokens():
    router = Router(num_replicas=2)
    router.assign(0, [RoutedRequest("a", num_prompt_tokens=10, max_tokens=5)])
    assert router.load(0) == 15
    assert router.choose([0, 1], None).replica == 1
    router.progress("a", 2)  # first tokens: the prompt is done, 3 tokens may follow
    assert router.load(0) == 3
    router.assign(1, [RoutedRequest("b", num_prompt_tokens=1, max_tokens=3)])
    assert router.load(1) == 4
    assert router.choose([0, 1], None).replica == 0
    router.finish("a")
    router.finish("b")
    assert (router.load(0), router.load(1)) == (0, 0)
    assert router.choose([0, 1], None).replica == 0  # tie: lowest index
    assert router.choose([1], None).replica == 1  # only serving replicas are candidates


def test_prefix_routing_follows_the_longest_known_prefix_until_much_busier():
    router = Router(num_replicas=2, policy="prefix", block_size=4, balance_abs_tokens=50)
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    router.assign(1, [RoutedRequest("a", 9, 1)], shared + [9])
    decision = router.choose([0, 1], shared + [100, 101])
    assert (decision.replica, decision.prefix_hit) == (1, True)  # replica 1 busier, still hit
    assert router.choose([0, 1], [1, 2, 3, 4, 99, 99, 99, 99]).replica == 1  # one-block match
    assert router.choose([0, 1], [8, 7, 6, 5]).prefix_hit is False
    assert router.choose([0, 1], [1, 2, 3]).replica == 0  # shorter than a block: by load
    # Much busier (more than 50 tokens more and more than twice the least): by load.
    router.assign(1, [RoutedRequest("big", 60, 1)])
    decision = router.choose([0, 1], shared)
    assert (decision.replica, decision.prefix_hit) == (0, False)
    router.forget_replica(1)
    router.finish("big")
    assert router.choose([0, 1], shared).prefix_hit is False


def test_prefix_table_is_bounded_lru():
    router = Router(num_replicas=2, policy="prefix", block_size=2, max_prefix_entries=2)
    router.assign(1, [], [1, 1])
    router.assign(1, [], [2, 2])
    router.assign(1, [], [3, 3])  # evicts [1, 1]
    assert router.choose([0, 1], [1, 1]).prefix_hit is False
    assert router.choose([0, 1], [3, 3]).prefix_hit is True


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="routing must be one of"):
        Router(num_replicas=2, policy="random")


def test_streamed_hand_offs_go_to_the_decode_replica_with_the_fewest_in_flight():
    """`choose_handoff`: fewest streamed hand-offs in flight first, then the least
    outstanding work, then the lowest index; a count never drops below zero."""
    router = Router(3)
    router.assign(0, [RoutedRequest("x", 0, 100)])
    assert router.choose_handoff([0, 1, 2]) == 1  # by load, then index
    router.begin_handoffs(1, 2)
    router.begin_handoffs(2, 1)
    assert router.choose_handoff([0, 1, 2]) == 0  # the only one without a stream in flight
    router.begin_handoffs(0, 1)
    assert router.choose_handoff([0, 1, 2]) == 2  # one each on 0 and 2: 2 has less work
    assert router.choose_handoff([1]) == 1
    router.end_handoff(1)
    router.end_handoff(1)
    router.end_handoff(1)
    assert [router.handoffs(i) for i in range(3)] == [1, 0, 1]
    assert router.choose_handoff([0, 1, 2]) == 1
