"""The fused residual-add + RMSNorm kernel (runner/fused_norms.py) against the torch path.

On CPU the kernel runs under Triton's interpreter; the torch path (the checkpoint's RMSNorm
and add) is the oracle. The kernel rounds where the torch path rounds; a sum of squares in
another order is the only other difference, so float32 agrees to rounding (1e-6) and
bfloat16 to two units in its last place (see the tolerance's note)."""

from __future__ import annotations

import pytest
import torch

from loopserve.models.ouro import RMSNorm

pytest.importorskip("triton")

from loopserve.runner.fused_norms import add_norm_norm  # noqa: E402
from tests.engine_utils import make_engine, random_workload, reference_for, run_steps  # noqa: E402


def _norm(width: int, seed: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(width, 1e-6)
    generator = torch.Generator().manual_seed(seed)
    norm.weight.data = 1 + 0.1 * torch.randn(width, generator=generator)
    return norm.to(dtype)


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [
        (torch.float32, dict(rtol=1e-6, atol=1e-6)),
        # two bfloat16 units at the values' scale (|x| < 8): Triton's interpreter truncates
        # to bfloat16 where torch (and the compiled kernel) round to nearest
        (torch.bfloat16, dict(rtol=2**-6, atol=2**-4)),
    ],
)
@pytest.mark.parametrize("width", [64, 96, 2048])  # (96: a masked tail in the block)
def test_add_norm_norm_equals_the_torch_norms(dtype, tolerance, width):
    generator = torch.Generator().manual_seed(width)
    residual = torch.randn(5, width, generator=generator).to(dtype)
    branch = (3 * torch.randn(5, width, generator=generator)).to(dtype)
    norm_a, norm_b = _norm(width, 1, dtype), _norm(width, 2, dtype)
    with torch.no_grad():
        expected_residual = residual + norm_a(branch)
        expected = norm_b(expected_residual)
        new_residual, normed = add_norm_norm(residual, branch, norm_a, norm_b)
        alone_residual, alone = add_norm_norm(residual, None, None, norm_b)
    torch.testing.assert_close(new_residual, expected_residual, **tolerance)
    torch.testing.assert_close(normed, expected, **tolerance)
    assert alone_residual is residual or torch.equal(alone_residual, residual)
    torch.testing.assert_close(alone, norm_b(residual), **tolerance)
    assert normed.dtype == dtype and not torch.equal(normed, norm_b(residual))


def test_fused_core_equals_the_torch_core(tiny_model):
    """Ouro's loop with 2 fused calls per layer: logits of a full forward equal the torch
    path's (float32, to rounding), and turning it off restores the torch path."""
    from tests.test_model import full_forward_logits

    tokens = [5, 9, 2, 7, 11]
    torch_logits = full_forward_logits(tiny_model, tokens)
    calls = []

    def counted(*args):
        calls.append(args[1] is None)
        return add_norm_norm(*args)

    tiny_model.use_fused_norms(counted)
    try:
        fused_logits = full_forward_logits(tiny_model, tokens)
    finally:
        tiny_model.use_fused_norms(None)
    for fused, plain in zip(fused_logits, torch_logits):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    assert tiny_model.add_norm_norm is None
    layers, loops = len(tiny_model.model.layers), tiny_model.num_loops
    assert len(calls) == (2 * layers + 1) * loops  # per loop: the first norm, 2 per layer
    assert sum(calls) == loops


def test_the_engine_with_fused_norms_equals_the_dense_reference(tiny_dir):
    """The fused path as the runner sets it up on CUDA (here interpreted), through the
    emulated decode graphs and with merged projections: tokens and exits equal the dense
    reference of that model."""
    work = random_workload(47, 4, 256, sampled=True)
    engine = make_engine(tiny_dir, max_num_seqs=4, graph_mode="emulate")
    engine.model.merge_projections()
    calls = []
    engine.model.use_fused_norms(lambda *args: calls.append(1) or add_norm_norm(*args))
    finished = run_steps(engine, work)
    assert len(calls) > 100
    for request_id, prompt, params, _ in work:
        ref = reference_for(engine, prompt, params)
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), request_id
    assert engine.stats.num_graph_calls > 0


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [(torch.float32, dict(rtol=1e-6, atol=1e-6)), (torch.bfloat16, dict(rtol=2**-6, atol=2**-4))],
)
def test_norm_sum_equals_huginns_sandwich_norms(dtype, tolerance):
    """Huginn's order (`norm_sum`): the new residual is norm_a(branch + residual); without
    `norm_b` only that comes back."""
    from loopserve.models.huginn import HuginnRMSNorm

    generator = torch.Generator().manual_seed(3)
    residual = torch.randn(5, 96, generator=generator).to(dtype)
    branch = (3 * torch.randn(5, 96, generator=generator)).to(dtype)
    norm_a, norm_b = HuginnRMSNorm(96, 1e-6), HuginnRMSNorm(96, 1e-6)
    norm_a.weight.data = 1 + 0.1 * torch.randn(96, generator=generator)
    norm_a, norm_b = norm_a.to(dtype), norm_b.to(dtype)
    with torch.no_grad():
        expected = norm_a(branch + residual)
        new_residual, normed = add_norm_norm(residual, branch, norm_a, norm_b, norm_sum=True)
        last, nothing = add_norm_norm(residual, branch, norm_a, None, norm_sum=True)
    torch.testing.assert_close(new_residual, expected, **tolerance)
    torch.testing.assert_close(normed, norm_b(expected), **tolerance)
    torch.testing.assert_close(last, expected, **tolerance)
    assert nothing is None


def test_huginn_with_fused_norms_equals_the_dense_reference(tmp_path):
    """Huginn's core blocks with 2 fused calls each (the prelude and coda unfused): the
    engine's greedy tokens and exit steps equal the dense reference of that model."""
    from loopserve.models.huginn_dense import generate
    from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
    from loopserve.sampling_params import SamplingParams

    engine = make_engine(make_tiny_huginn_checkpoint(tmp_path), exit_criterion="kl")
    calls = []
    engine.model.use_fused_norms(lambda *a, **k: calls.append(1) or add_norm_norm(*a, **k))
    params = SamplingParams(max_tokens=4, temperature=0.0, exit_threshold=0.01, ignore_eos=True)
    work = [("a", [7, 3, 99, 42, 5], params, 0), ("b", [11, 64, 17], params, 1)]
    finished = run_steps(engine, work)
    for request_id, prompt, _, _ in work:
        ref = generate(engine.model, prompt, max_new_tokens=4, num_steps=None, criterion="kl",
                       threshold=0.01, min_steps=0, lookup="last_exited", exit_in_prompt=False)  # fmt: skip
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.tokens, ref.steps), request_id
    assert min(min(out.exit_depths) for out in finished.values()) < 8  # early exits
    assert len(calls) > 50


def test_an_interpreted_launch_leaves_triton_language_as_it_was():
    """Triton's interpreter patches `triton.language` while a kernel runs and, when the kernel
    calls an interpreted helper (`tl.sum`), left some functions patched: a later compile in
    the same process failed. `triton_jit` restores those modules after every launch."""
    import triton.language as tl

    modules = [tl, tl.core, tl.standard]
    before = [dict(vars(module)) for module in modules]
    rows, norm = torch.randn(2, 64), _norm(64, 0, torch.float32)
    with torch.no_grad():
        add_norm_norm(rows, rows, norm, norm, norm_sum=True)
    for module, attributes in zip(modules, before):
        changed = [n for n, v in attributes.items() if vars(module).get(n) is not v]
        assert changed == [], (module.__name__, changed[:5])
