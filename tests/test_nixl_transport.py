"""The NIXL KV transport ("nixl", `loopserve/distributed/nixl_transport.py`) on loopback.

First two endpoints in this process (NIXL's UCX backend over host memory, no Ray): a read
gives the exact bytes, the sender releases its registration when the read or a discard is
notified, an unread send expires and a later read of it fails without breaking the endpoint.
Then the prefill/decode hand-off on a local Ray cluster with `kv_transport="nixl"`: outputs
equal a colocated engine's and the bytes are counted on both sides. Skipped without NIXL (the
optional `nixl` extra, which CI installs)."""

from __future__ import annotations

# ruff: noqa: E402 - skips run before the optional imports
import time
import uuid

import pytest
import torch

pytest.importorskip("nixl", reason="needs NIXL (pip install -e '.[nixl]')")

from loopserve.distributed.nixl_transport import NixlSource, NixlTransport
from loopserve.distributed.transport import KVDescriptor, KVTransportError, NixlSpec
from loopserve.engine.handoff import HandoffState
from loopserve.sampling_params import SamplingParams


def _state(request_id: str, kv: torch.Tensor) -> HandoffState:
    return HandoffState(
        request_id=request_id, prompt_token_ids=[1, 2, 3], output_token_ids=[4],
        exit_depths=[2], logprobs=[], params=SamplingParams(max_tokens=4), num_planes=4,
        block_size=4, num_kv_positions=3, kv=kv, generator_state=None, arrival_s=0.0,
    )  # fmt: skip


def _wait(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


@pytest.fixture
def pair():
    group = uuid.uuid4().hex[:8]
    prefill = NixlTransport(NixlSpec(group, timeout_s=30.0), rank=0)
    decode = NixlTransport(NixlSpec(group, timeout_s=30.0), rank=1)
    yield prefill, decode
    prefill.close()
    decode.close()


def test_a_read_moves_the_exact_bytes_and_releases_the_senders_copy(pair):
    prefill, decode = pair
    kvs = [torch.randn(2, 2, 8, 4, 2, 16, generator=torch.Generator().manual_seed(i))
           for i in range(3)]  # fmt: skip
    sent = [prefill.send(_state(f"r{i}", kv), destination=1) for i, kv in enumerate(kvs)]
    assert all(isinstance(item, KVDescriptor) and item.state.kv is None for item in sent)
    assert [item.seq for item in sent] == [0, 1, 2]  # numbered per (sender, receiver)
    assert isinstance(sent[0].source, NixlSource) and len(sent[0].source.metadata) < 4096
    assert prefill.stats().num_pending_sends == 3
    received = decode.receive_many([sent[2], sent[0]])  # any order
    assert torch.equal(received[0].kv, kvs[2]) and torch.equal(received[1].kv, kvs[0])
    assert received[0].request_id == "r2" and received[0].output_token_ids == [4]
    decode.discard_many([sent[1]])  # an aborted request: nothing read, the copy released
    num_bytes = 2 * kvs[0].numel() * 4
    assert _wait(lambda: prefill.stats().num_pending_sends == 0)
    sender, receiver = prefill.stats(), decode.stats()
    assert (sender.num_sent, sender.bytes_sent) == (3, num_bytes)  # the two reads
    assert (receiver.num_received, receiver.bytes_received) == (2, num_bytes)
    assert receiver.num_discarded == 1


def test_an_unread_send_stays_registered_until_read_and_a_bounded_flush_says_so(pair):
    """Never released on a timer (a read of freed host memory over UCX can succeed with
    whatever the memory holds): flush waits at most its timeout and reports it pending."""
    prefill, decode = pair
    kv = torch.arange(64, dtype=torch.float32)
    slow = prefill.send(_state("slow", kv), destination=1)
    assert prefill.flush(0.2).num_pending_sends == 1  # returns with it still unread
    assert torch.equal(decode.receive(slow).kv, kv)  # still there, still right
    assert _wait(lambda: prefill.stats().num_pending_sends == 0)


def test_a_descriptor_of_another_transport_or_a_closed_endpoint_is_refused(pair):
    prefill, decode = pair
    torch_made = KVDescriptor(_state("t", None), (4,), torch.float32, 0, 1, 0)
    with pytest.raises(KVTransportError, match="not sent by the nixl transport"):
        decode.receive(torch_made)
    decode.close()
    sent = prefill.send(_state("x", torch.zeros(4)), destination=1)
    with pytest.raises(KVTransportError, match="closed"):
        decode.receive(sent)
    prefill.close()
    with pytest.raises(KVTransportError, match="closed"):
        prefill.send(_state("y", torch.zeros(4)), destination=1)


# ---- through Ray, as `DisaggregatedEngines` runs it ----------------------------------------

ray = pytest.importorskip("ray", reason="needs Ray (the nixl extra includes it)")

from loopserve.distributed.offline import DisaggregatedEngines
from loopserve.llm import LLM
from loopserve.models.registry import read_config
from tests.pd_pools import (
    DECODE,
    PREFILL,
    exported_kv_bytes,
    replica_stats,
    run_cases,
    start_pool,
    transport_stats,
)
from tests.ray_utils import start_local_ray, stop_local_ray
from tests.test_pd_serving_torch import CASES, _engine_args
from tests.test_pd_transport import (
    BASE_ARGS,
    PARAMS,
    PROMPT_LENGTHS,
    PROMPTS,
)


@pytest.fixture(scope="module")
def ray_cluster():
    start_local_ray(3)
    yield
    stop_local_ray()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    ("layout", "exit_mode", "num_prefill"),
    [("last_exited", "ouro", 2), ("shared", "random_lookahead", 1)],
)
def test_nixl_hand_offs_equal_colocated_serving(tiny_dir, ray_cluster, layout, exit_mode,
                                                num_prefill):  # fmt: skip
    args = {**BASE_ARGS, "layout": layout, "exit_mode": exit_mode, "lookahead_seed": 7}
    colocated = LLM(str(tiny_dir), **args).generate(PROMPTS, PARAMS, use_tqdm=False)
    engines = DisaggregatedEngines(
        {"model": str(tiny_dir), **args}, num_prefill, 1, kv_transport="nixl"
    )
    try:
        outputs = engines.generate([f"r{i}" for i in range(len(PROMPTS))], PROMPTS, PARAMS)
        stats = engines.transport.flush()  # the senders release what was read
    finally:
        engines.shutdown()
    for output, expected in zip(outputs, colocated):
        assert (output.token_ids, output.exit_depths) == (expected.token_ids, expected.exit_depths)
        assert output.finish_reason == expected.finish_reason
    assert any(depth < 4 for o in outputs for depth in o.exit_depths)
    handed_off = [n for n, p in zip(PROMPT_LENGTHS, PARAMS) if p.max_tokens > 1]
    expected = sum(exported_kv_bytes(tiny_dir, layout, n) for n in handed_off)
    *senders, decode = stats
    assert {s.kind for s in stats} == {"nixl"}
    assert sum(s.num_sent for s in senders) == decode.num_received == 3
    assert sum(s.bytes_sent for s in senders) == decode.bytes_received == expected
    assert all(s.num_pending_sends == 0 for s in senders)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_nixl_serving_equals_colocated_and_reads_the_kv_point_to_point(
    tiny_tok_dir, ray_cluster, loop
):
    """`PDReplicaPool(..., kv_transport="nixl")` (what `serve --pd prefill=1,decode=1
    --kv-transport nixl` builds): five concurrent streams, four hand-offs read over NIXL."""

    args = _engine_args(tiny_tok_dir, "last_exited", "ouro_delayed")
    pool = start_pool(loop, args, kv_transport="nixl")
    try:
        assert pool.uses_point_to_point and pool.health()["kv_transport"] == "nixl"
        results = run_cases(pool, loop, CASES)
        stats = transport_stats(pool, loop)
    finally:
        loop.run_until_complete(pool.shutdown(5.0))
    expected = LLM(**args).generate([p for p, _ in CASES.values()],
                                    [sp for _, sp in CASES.values()])  # fmt: skip
    for rid, (outputs, stream), want in zip(CASES, results, expected):
        final = outputs[-1]
        assert (final.token_ids, final.exit_depths) == (want.token_ids, want.exit_depths), rid
        assert (rid in stream.decode_replicas) == (rid != "one"), rid
    kv_bytes = sum(exported_kv_bytes(tiny_tok_dir, "last_exited", len(p))
                   for rid, (p, _) in CASES.items() if rid != "one")  # fmt: skip
    assert (stats[PREFILL].kind, stats[DECODE].kind) == ("nixl", "nixl")
    assert stats[PREFILL].num_sent == stats[DECODE].num_received == 4
    assert stats[PREFILL].bytes_sent == stats[DECODE].bytes_received == kv_bytes
    assert stats[PREFILL].num_pending_sends == 0 and pool.kv_transport_fallback is None


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_nixl_streamed_serving_equals_colocated_and_reads_every_chunk_over_nixl(
    tiny_tok_dir, ray_cluster, loop
):
    """`PDReplicaPool(..., kv_transport="nixl", kv_handoff="stream")` (`serve --pd ...
    --kv-transport nixl --kv-handoff stream`): each complete prompt block is read over NIXL
    by the decode replica that reserved it, as a chunk, before the final hand-off, which is
    read over NIXL too; outputs equal colocated and every block is read exactly once (the
    request that ends with its first token had its block out already, a chunk per plane
    under per_depth prompts, streaming's default: they are read too)."""

    args = {**_engine_args(tiny_tok_dir, "last_exited", "ouro"), "prefill_chunk_size": 4}
    pool = start_pool(loop, args, kv_transport="nixl", kv_handoff="stream")
    try:
        results = run_cases(pool, loop, CASES)
        stats = transport_stats(pool, loop)
        counters = loop.run_until_complete(replica_stats(pool))
    finally:
        loop.run_until_complete(pool.shutdown(5.0))
    expected = LLM(**args).generate([p for p, _ in CASES.values()],
                                    [sp for _, sp in CASES.values()])  # fmt: skip
    for rid, (outputs, _), want in zip(CASES, results, expected):
        final = outputs[-1]
        assert (final.token_ids, final.exit_depths) == (want.token_ids, want.exit_depths), rid
    assert pool.engine_args["prefill_mode"] == "per_depth"  # none given: streaming's arm
    chunks = counters[PREFILL].num_kv_chunks_sent
    # "one"'s chunks (one per plane) are read too; each written or not depending on whether
    # its release came first.
    planes = read_config(tiny_tok_dir)[1].num_loops
    assert 0 <= chunks - counters[DECODE].num_kv_chunks_received <= planes
    assert counters[DECODE].num_streamed_imports == 3  # g, s, k; m has no complete block
    assert stats[PREFILL].num_sent == stats[DECODE].num_received + stats[DECODE].num_discarded
    assert stats[PREFILL].num_sent == chunks + 4  # every chunk and final hand-off over NIXL
    handed_off = sum(exported_kv_bytes(tiny_tok_dir, "last_exited", len(p))
                     for rid, (p, _) in CASES.items() if rid != "one")  # fmt: skip
    one_chunk = exported_kv_bytes(tiny_tok_dir, "last_exited", 4)
    assert stats[PREFILL].bytes_sent == stats[DECODE].bytes_received == handed_off + one_chunk
    assert stats[PREFILL].num_pending_sends == 0 and pool.kv_transport_fallback is None
