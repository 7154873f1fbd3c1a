"""The torch.distributed KV transport of the prefill/decode hand-off on a local Ray cluster
(gloo on CPU): 1P1D outputs equal a colocated engine's, the K/V bytes go point to point (not
through the object store), hand-offs pair up in order, and an aborted or unreceived hand-off
ends in a bounded, reported state.

Skipped when Ray is not installed (it is the optional `ray` extra)."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import pickle

import pytest

from tests.optional import require

require("ray", "serve")

ray = pytest.importorskip("ray", reason="needs the optional `ray` extra (pip install '.[ray]')")
from loopserve.distributed.args import add_distributed_args  # noqa: E402
from loopserve.distributed.offline import DisaggregatedEngines  # noqa: E402
from loopserve.distributed.transport import (  # noqa: E402
    KVDescriptor,
    resolve_kv_transport,
)
from loopserve.errors import ConfigError  # noqa: E402
from loopserve.llm import LLM  # noqa: E402
from loopserve.sampling_params import SamplingParams  # noqa: E402
from tests.pd_pools import exported_kv_bytes  # noqa: E402
from tests.ray_utils import start_local_ray, stop_local_ray  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
BASE_ARGS = {"dtype": "float32", "num_blocks": 256, "block_size": 4, "max_num_seqs": 4}
PROMPT_LENGTHS = [1, 6, 13, 22]
PROMPTS = [[(7 * k + 3 * i) % 90 + 3 for i in range(n)] for k, n in enumerate(PROMPT_LENGTHS)]
PARAMS = [
    SamplingParams(max_tokens=9, temperature=0.0, exit_threshold=0.6, ignore_eos=True),
    SamplingParams(max_tokens=7, temperature=1.0, seed=41, exit_threshold=0.5, ignore_eos=True),
    SamplingParams(max_tokens=1, temperature=0.8, seed=42, ignore_eos=True),  # no hand-off
    SamplingParams(max_tokens=11, temperature=0.7, top_k=30, seed=43, min_loops=2),
]


@pytest.fixture(scope="module")
def ray_cluster():
    start_local_ray(3)  # logical: up to three one-CPU replicas on the 2-core machine
    yield
    stop_local_ray()


def test_unknown_kv_transport_is_a_clear_error(tiny_dir):
    ray_was_up = ray.is_initialized()
    with pytest.raises(ConfigError, match="unknown kv_transport 'pigeon': choose one of ray"):
        DisaggregatedEngines({"model": str(tiny_dir)}, 1, 1, kv_transport="pigeon")
    assert ray.is_initialized() == ray_was_up  # rejected before starting a cluster
    assert resolve_kv_transport("auto", "cpu") == "ray"
    assert resolve_kv_transport("auto", "cuda") == "torch"
    assert resolve_kv_transport("torch", "cpu") == "torch"
    import argparse

    parser = argparse.ArgumentParser()
    add_distributed_args(parser)
    assert parser.parse_args(["--kv-transport", "torch"]).kv_transport == "torch"
    assert parser.parse_args([]).kv_transport == "ray"
    assert parser.parse_args(["--kv-transport", "nixl"]).kv_transport == "nixl"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-transport", "pigeon"])


@pytest.mark.parametrize(
    "layout,exit_mode",
    [("last_exited", "ouro"), ("shared", "random_lookahead")],  # each layout, each gate kind
)
def test_torch_transport_one_prefill_one_decode_equals_colocated(
    tiny_dir, ray_cluster, layout, exit_mode
):
    args = {**BASE_ARGS, "layout": layout, "exit_mode": exit_mode, "lookahead_seed": 7}
    colocated = LLM(str(tiny_dir), **args).generate(PROMPTS, PARAMS, use_tqdm=False)
    engines = DisaggregatedEngines({"model": str(tiny_dir), **args}, 1, 1, kv_transport="torch")
    try:
        outputs = engines.generate([f"r{i}" for i in range(len(PROMPTS))], PROMPTS, PARAMS)
        prefill_stats, decode_stats = engines.transport.stats()
    finally:
        engines.shutdown()
    for output, expected in zip(outputs, colocated):
        assert output.token_ids == expected.token_ids
        assert output.exit_depths == expected.exit_depths
        assert output.finish_reason == expected.finish_reason
    assert [len(o.token_ids) for o in outputs][:3] == [9, 7, 1]
    assert any(depth < 4 for o in outputs for depth in o.exit_depths)  # early exits happened
    # Three hand-offs (not the max_tokens=1 request), each of its prompt's K/V (one token
    # sampled, not yet fed), sent by rank 0 and received by rank 1 over torch.distributed.
    handed_off = [n for n, p in zip(PROMPT_LENGTHS, PARAMS) if p.max_tokens > 1]
    expected = sum(exported_kv_bytes(tiny_dir, layout, n) for n in handed_off)
    assert engines.last_num_handed_off == 3
    assert (prefill_stats.kind, prefill_stats.rank, decode_stats.rank) == ("torch", 0, 1)
    assert (prefill_stats.num_sent, prefill_stats.bytes_sent) == (3, expected)
    assert (decode_stats.num_received, decode_stats.bytes_received) == (3, expected)
    assert prefill_stats.num_pending_sends == 0
    assert prefill_stats.failure is None and decode_stats.failure is None


def test_torch_transport_two_prefill_one_decode_equals_colocated(tiny_dir, ray_cluster):
    args = {**BASE_ARGS, "layout": "last_exited", "exit_mode": "ouro_delayed"}
    colocated = LLM(str(tiny_dir), **args).generate(PROMPTS, PARAMS, use_tqdm=False)
    engines = DisaggregatedEngines({"model": str(tiny_dir), **args}, 2, 1, kv_transport="torch")
    try:
        outputs = engines.generate([f"r{i}" for i in range(len(PROMPTS))], PROMPTS, PARAMS)
        # A second batch continues each pair's numbering where the first ended.
        again = engines.generate([f"s{i}" for i in range(len(PROMPTS))], PROMPTS, PARAMS)
        stats = engines.transport.stats()
    finally:
        engines.shutdown()
    for batch in (outputs, again):
        for output, expected in zip(batch, colocated):
            assert (output.token_ids, output.exit_depths) == (
                expected.token_ids,
                expected.exit_depths,
            )
            assert output.finish_reason == expected.finish_reason
    assert any(depth < 4 for o in outputs for depth in o.exit_depths)
    # Both prefill ranks sent to rank 2, which received each source's hand-offs in order.
    first, second, decode = stats
    assert first.num_sent >= 2 and second.num_sent >= 2
    assert first.num_sent + second.num_sent == decode.num_received == 6
    handed_off = [n for n, p in zip(PROMPT_LENGTHS, PARAMS) if p.max_tokens > 1]
    expected = 2 * sum(exported_kv_bytes(tiny_dir, "last_exited", n) for n in handed_off)
    assert first.bytes_sent + second.bytes_sent == decode.bytes_received == expected


def test_an_8_bit_cache_moves_a_quarter_of_the_float32_bytes_and_serves_the_same(
    tiny_dir, ray_cluster
):
    """`kv_cache_dtype` fp8 through Ray and the torch transport (gloo): the hand-offs carry
    the cache's bytes, one per element, and the outputs equal colocated serving with the same
    cache."""
    args = {**BASE_ARGS, "layout": "last_exited", "kv_cache_dtype": "fp8_e5m2"}
    colocated = LLM(str(tiny_dir), **args).generate(PROMPTS, PARAMS, use_tqdm=False)
    engines = DisaggregatedEngines({"model": str(tiny_dir), **args}, 1, 1, kv_transport="torch")
    try:
        outputs = engines.generate([f"r{i}" for i in range(len(PROMPTS))], PROMPTS, PARAMS)
        stats = engines.transport.stats()
    finally:
        engines.shutdown()
    for output, expected in zip(outputs, colocated):
        assert (output.token_ids, output.exit_depths) == (expected.token_ids, expected.exit_depths)
    handed_off = [n for n, p in zip(PROMPT_LENGTHS, PARAMS) if p.max_tokens > 1]
    expected = sum(exported_kv_bytes(tiny_dir, "last_exited", n) for n in handed_off) // 4
    assert stats[0].bytes_sent == stats[1].bytes_received == expected > 0


def test_torch_transport_pairs_in_order_discards_aborts_and_bounds_unreceived(
    tiny_dir, ray_cluster
):
    args = {**BASE_ARGS, "layout": "last_exited", "exit_mode": "ouro"}
    colocated = LLM(str(tiny_dir), **args).generate(PROMPTS[1:], PARAMS[1:], use_tqdm=False)
    engines = DisaggregatedEngines({"model": str(tiny_dir), **args}, 1, 1, kv_transport="torch")
    prefill, decode = engines.prefill[0], engines.decode[0]
    try:
        ids = ["a", "b", "c"]
        summary_ref, items_ref = prefill.prefill_export.options(num_returns=2).remote(
            ids, PROMPTS[1:], PARAMS[1:], destination=1
        )
        assert ray.get(summary_ref) == 2  # "b" finished with its only token
        items = ray.get(items_ref)
        # The metadata went through Ray without the K/V: the bytes wait on rank 0's sends.
        a, b, c = items
        assert isinstance(a, KVDescriptor) and isinstance(c, KVDescriptor)
        assert a.state.kv is None and c.state.kv is None
        assert [(d.src_rank, d.dst_rank, d.seq) for d in (a, c)] == [(0, 1, 0), (0, 1, 1)]
        kv_bytes = exported_kv_bytes(tiny_dir, "last_exited", PROMPT_LENGTHS[3])
        assert len(pickle.dumps(c)) < kv_bytes  # what Ray stored cannot hold the K/V
        assert ray.get(prefill.kv_transport_stats.remote()).num_pending_sends == 2
        # Receiving the second before the first is refused, and posts nothing.
        with pytest.raises(ray.exceptions.RayTaskError, match="in the order they were sent"):
            ray.get(decode.decode_import.remote([c]))
        # "a" was aborted before import: discarding it pairs its bytes; "c" then decodes.
        assert ray.get(decode.discard_handoffs.remote([a])) == 1
        [c_out] = ray.get(decode.decode_import.remote([c]))
        assert (c_out.token_ids, c_out.exit_depths) == (
            colocated[2].token_ids,
            colocated[2].exit_depths,
        )
        sent = ray.get(prefill.flush_kv_transport.remote(5.0))
        assert (sent.num_sent, sent.num_pending_sends, sent.failure) == (2, 0, None)
        assert sent.bytes_sent == exported_kv_bytes(tiny_dir, "last_exited", 6) + kv_bytes
        got = ray.get(decode.kv_transport_stats.remote())
        assert (got.num_received, got.num_discarded, got.bytes_received) == (
            1,
            1,
            sent.bytes_sent,
        )
        # A hand-off nobody receives: a bounded flush reports it and the endpoint refuses
        # further sends (the pair's order is lost) instead of blocking.
        ray.get(prefill.prefill_export.remote(["d"], [PROMPTS[3]], [PARAMS[3]], destination=1))
        stuck = ray.get(prefill.flush_kv_transport.remote(0.3))
        assert stuck.num_pending_sends == 1
        assert "'d'" in stuck.failure and "still pending" in stuck.failure
        with pytest.raises(ray.exceptions.RayTaskError, match="failed earlier"):
            ray.get(prefill.prefill_export.remote(["e"], [PROMPTS[1]], [PARAMS[0]], destination=1))
    finally:
        engines.shutdown()  # closes the group despite the pending send


def _num_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(
    _num_cuda_devices() < 2, reason="needs two CUDA devices (NCCL needs one GPU per rank)"
)
def test_nccl_transport_one_prefill_one_decode_equals_colocated_on_cuda(tiny_dir, ray_cluster):
    """Never run here (no GPU): `auto` picks torch/NCCL on CUDA, the K/V goes device to
    device, and the outputs equal a colocated CUDA engine's in float32."""
    args = {**BASE_ARGS, "device": "cuda", "layout": "last_exited", "exit_mode": "ouro"}
    colocated = LLM(str(tiny_dir), **args).generate(PROMPTS, PARAMS, use_tqdm=False)
    engines = DisaggregatedEngines({"model": str(tiny_dir), **args}, 1, 1, kv_transport="auto")
    try:
        outputs = engines.generate([f"r{i}" for i in range(len(PROMPTS))], PROMPTS, PARAMS)
        prefill_stats, decode_stats = engines.transport.stats()
    finally:
        engines.shutdown()
    for output, expected in zip(outputs, colocated):
        assert (output.token_ids, output.exit_depths) == (expected.token_ids, expected.exit_depths)
    handed_off = [n for n, p in zip(PROMPT_LENGTHS, PARAMS) if p.max_tokens > 1]
    expected = sum(exported_kv_bytes(tiny_dir, "last_exited", n) for n in handed_off)
    assert prefill_stats.kind == "torch"
    assert prefill_stats.bytes_sent == decode_stats.bytes_received == expected
