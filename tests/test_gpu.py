"""GPU tests (`pytest -m gpu tests/test_gpu.py`, run by scripts/gpu_check.sh): Triton kernels
vs the torch backend on CUDA in float32 and bfloat16, and the engine's batch invariance in
float32 on CUDA with the Triton backend. Skipped (saying why) without a CUDA device or triton.
The kernels pick their compiled form for CUDA tensors (`triton_jit.device_kernel`), so these
run in the same process as the CPU interpreter tests; only a process that imported triton with
TRITON_INTERPRET=1 already set (Triton's own helpers then stay interpreted) skips them.

Still to come with CUDA graphs and async scheduling: graphs vs eager identical in fp32, async
vs sync identical (same structure: a parametrized engine run compared with the reference).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1",
        reason="TRITON_INTERPRET=1 in this process: run tests/test_gpu.py on its own",
    ),
]

CASES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2)]


def _segments(tables, specs):
    from loopserve.runner.attention.base import RowSegment

    return [RowSegment(tables[i], start, count) for i, (start, count) in enumerate(specs)]


@pytest.mark.parametrize("dtype,atol,rtol", CASES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 16), (8, 2)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("split_len", [4096, 64], ids=["one_split", "split_k"])
def test_triton_matches_torch_backend_on_cuda(
    dtype, atol, rtol, num_heads, num_kv_heads, split_len
):
    pytest.importorskip("triton", reason="triton not installed")
    from loopserve.runner.attention.torch_paged import TorchBackend
    from loopserve.runner.attention.triton_backend import TritonBackend

    torch.backends.cuda.matmul.allow_tf32 = False
    generator = torch.Generator(device="cuda").manual_seed(7)
    layers, head_dim, block_size, num_blocks = 2, 128, 16, 512
    cache = torch.randn(layers, 2, num_blocks * block_size, num_kv_heads, head_dim,
                        generator=generator, device="cuda").to(dtype)  # fmt: skip
    order = torch.randperm(num_blocks, device="cpu", generator=torch.Generator().manual_seed(3))
    tables = [order[i * 60 : (i + 1) * 60].tolist() for i in range(8)]
    # decode rows of different planes and lengths, prompt chunks with and without context
    segments = _segments(tables, [(700, 1), (0, 1), (130, 1), (0, 300), (517, 77), (9, 1),
                                  (255, 1), (40, 129)])  # fmt: skip
    rows = sum(s.count for s in segments)
    reference = TorchBackend(cache.clone(), block_size=block_size, scale=head_dim**-0.5)
    fast = TritonBackend(cache.clone(), block_size=block_size, scale=head_dim**-0.5,
                         split_len=split_len)  # fmt: skip
    for layer_idx in range(layers):
        q = torch.randn(rows, num_heads, head_dim, generator=generator, device="cuda").to(dtype)
        k = torch.randn(rows, num_kv_heads, head_dim, generator=generator, device="cuda")
        v = torch.randn(rows, num_kv_heads, head_dim, generator=generator, device="cuda")
        k, v = k.to(dtype), v.to(dtype)
        expected = reference.prepare(segments).attend(layer_idx, q, k, v).float()
        actual = fast.prepare(segments).attend(layer_idx, q, k, v).float()
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    assert torch.equal(fast.kv_cache, reference.kv_cache)
    src = torch.tensor([5, 17], device="cuda")
    dst = torch.tensor([900, 4000], device="cuda")
    reference.finalize(src, dst)
    fast.finalize(src, dst)
    assert torch.equal(fast.kv_cache, reference.kv_cache)


@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_engine_batch_invariance_fp32_on_cuda(tiny_dir, mode):
    pytest.importorskip("triton", reason="triton not installed")
    from tests.engine_utils import make_engine, random_workload, reference_for, run_steps

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    engine = make_engine(tiny_dir, device="cuda", mode=mode, attention_backend="triton",
                         prefill_mode="wavefront", mixed_prefill_decode=True)  # fmt: skip
    work = random_workload(41, 9, engine.model.config.vocab_size, sampled=True)
    finished = run_steps(engine, work)
    depths = []
    for request_id, prompt, params, _ in work:
        ref = reference_for(engine, prompt, params)
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), request_id
        depths += out.exit_depths
    assert min(depths) < 4 and max(depths) == 4  # early exits (finalize copies) happened


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cascade_attention_on_cuda_matches_reference(tiny_dir, backend):
    """Cascade attention on CUDA (torch: matmul prefix path; triton: prefix in torch, suffix
    through the decode kernel's log-sum-exp output): outputs equal the dense reference and
    groups formed. Same workload as tests/test_cascade_attention.py on CPU."""
    if backend == "triton":
        pytest.importorskip("triton", reason="triton not installed")
    from tests.engine_utils import make_engine, reference_for, run_steps
    from tests.test_cascade_attention import _work

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    engine = make_engine(tiny_dir, device="cuda", attention_backend=backend, max_num_seqs=6,
                         cascade_attention=True, graph_mode="off")  # fmt: skip
    finished = run_steps(engine, _work())
    for request_id, prompt, params, _ in _work():
        ref = reference_for(engine, prompt, params)
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), request_id
    stats = engine.runner.attention.cascade_stats
    assert stats.num_groups > 0 and stats.num_grouped_rows >= 2 * stats.num_groups


def test_batch_invariant_mode_on_cuda_alone_equals_busy(tiny_dir):
    """Batch-invariant mode on CUDA (never verified before a device run): a request alone and
    among others, with a recompute preemption, gets bit-identical tokens, exit depths and
    logprobs. The CPU test (tests/test_batch_invariant.py) also compares every KV plane."""
    from tests.test_batch_invariant import ARMS, _run

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    args = dict(ARMS["last_exited-mixed"], batch_invariant=True, enable_prefix_caching=False,
                device="cuda")  # fmt: skip
    _, alone, _, _ = _run(tiny_dir, args, busy=False)
    engine, busy, _, _ = _run(tiny_dir, args, busy=True, preempt_after=6)
    assert engine.scheduler.memory_stats.num_preemptions_recompute == 1
    assert (busy.token_ids, busy.exit_depths) == (alone.token_ids, alone.exit_depths)
    assert busy.logprobs == alone.logprobs


def test_a_landed_hand_off_is_on_the_device_and_decodes_the_same_tokens(tiny_dir):
    """On CUDA, landing (`LLMEngine.land_kv`: what a decode replica does with every hand-off
    and chunk, off its engine thread) puts a hand-off's K/V on the device, copied on a side
    stream that records an event; importing the landed state and the plain host state give
    the reference's tokens, and the engine counts which it imported."""
    import dataclasses

    from loopserve.sampling_params import SamplingParams
    from tests.engine_utils import make_engine, reference_for

    prefill = make_engine(tiny_dir, device="cuda")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = list(range(5, 35))
    prefill.add_request("x", prompt, params)
    while not prefill.can_export("x"):
        prefill.step()
    state = prefill.export_request("x")
    assert state.kv.device.type == "cpu"  # type: ignore[attr-defined]
    expected = reference_for(prefill, prompt, params)
    for landed in (False, True):
        decode = make_engine(tiny_dir, device="cuda")
        item = state
        if landed:
            kv = decode.land_kv(state.kv)
            assert kv.tensor.is_cuda and kv.ready is not None  # type: ignore[attr-defined]
            assert decode.runner.handoff.num_landed_device == 1
            item = dataclasses.replace(state, kv=kv)
        decode.import_request(item)
        final = None
        while decode.has_unfinished_requests():
            for output in decode.step():
                final = output
        assert final is not None and final.token_ids == expected.token_ids, landed
        swap = decode.runner.moves.swap
        assert (swap.num_imports_landed, swap.num_imports_unlanded) == (int(landed), 1 - landed)


def test_an_export_the_engine_thread_does_not_wait_for_settles_to_the_same_bytes(tiny_dir):
    """On CUDA a pending export (what the serving engine thread makes: `pending=True`) is a
    pinned host tensor filled by a non-blocking copy, with an event; once settled it holds the
    same bytes as the K/V on the device."""
    from loopserve.contracts import PendingHostKV
    from loopserve.sampling_params import SamplingParams
    from tests.engine_utils import make_engine

    engine = make_engine(tiny_dir, device="cuda")
    engine.add_request("x", list(range(5, 35)), SamplingParams(max_tokens=6, temperature=0.0))
    while not engine.can_export("x"):
        engine.step()
    handle = engine.scheduler.kv_handle("x")
    on_device = engine.runner.handoff.export_blocks(handle, 0, to_host=False)
    pending = engine.runner.handoff.export_blocks(handle, 0, pending=True)
    assert isinstance(pending, PendingHostKV) and pending.done is not None
    assert pending.tensor.is_pinned()  # type: ignore[attr-defined]
    assert torch.equal(pending.settled(), on_device.cpu())  # type: ignore[arg-type]
