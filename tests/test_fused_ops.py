"""The fused rotary and SiLU-and-multiply kernels (runner/fused_ops.py) against the torch path.

On CPU the kernels run under Triton's interpreter; the families' own torch code is the
oracle: Ouro's rotate-half RoPE (`apply_rope`) and Huginn's interleaved one (with its q/k
bias), and `silu(gate) * up`. The kernels round where the torch path rounds, so float32 agrees
to rounding and bfloat16 to two units in its last place (the interpreter truncates to
bfloat16 where torch rounds to nearest). Then the models and engines with every fused
kernel on, as the runner installs them on CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from loopserve.models.huginn import apply_interleaved_rope, interleaved_rope_tables
from loopserve.models.ouro import RotaryEmbedding, apply_rope

pytest.importorskip("triton")

from loopserve.runner.fused_ops import install_fused_kernels, rope_qkv, silu_mul  # noqa: E402
from loopserve.sampling_params import SamplingParams  # noqa: E402
from tests.engine_utils import make_engine, reference_for, run_steps  # noqa: E402

TOLERANCES = [
    (torch.float32, dict(rtol=1e-6, atol=1e-6)),
    (torch.bfloat16, dict(rtol=2**-6, atol=2**-4)),
]


def _qkv(rows: int, heads: int, kv_heads: int, head_dim: int, dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * head_dim
    return (2 * torch.randn(rows, width, generator=generator)).to(dtype)


@pytest.mark.parametrize(("dtype", "tolerance"), TOLERANCES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 8), (3, 3, 64), (2, 1, 12)])
def test_rotate_half_rope_equals_ouros(dtype, tolerance, heads, kv_heads, head_dim):
    """GQA and MHA, a head size whose half is no power of two (12: a masked tail)."""
    rows = 5
    qkv = _qkv(rows, heads, kv_heads, head_dim, dtype)
    positions = torch.tensor([0, 3, 17, 250, 4095])
    cos, sin = RotaryEmbedding(head_dim, 10_000.0)(positions, dtype)
    q, k, v = rope_qkv(qkv, cos, sin, heads, kv_heads)
    parts = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    want_q = apply_rope(parts[0].view(rows, heads, head_dim), cos, sin)
    want_k = apply_rope(parts[1].view(rows, kv_heads, head_dim), cos, sin)
    torch.testing.assert_close(q, want_q, **tolerance)
    torch.testing.assert_close(k, want_k, **tolerance)
    assert torch.equal(v, parts[2].view(rows, kv_heads, head_dim))
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    assert not torch.allclose(q, parts[0].view(rows, heads, head_dim))  # it rotated


@pytest.mark.parametrize(("dtype", "tolerance"), TOLERANCES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_interleaved_rope_equals_huginns(dtype, tolerance, with_bias):
    rows, heads, head_dim = 4, 3, 16
    qkv = _qkv(rows, heads, heads, head_dim, dtype, seed=1)
    cos, sin = interleaved_rope_tables(torch.tensor([1, 9, 64, 700]), head_dim, 50_000.0)
    bias = None
    if with_bias:
        bias = 0.5 * torch.randn(2, heads, head_dim, generator=torch.Generator().manual_seed(2))
        bias = bias.to(dtype)
    q, k, v = rope_qkv(qkv, cos, sin, heads, heads, interleaved=True, bias=bias)
    shape = (rows, heads, head_dim)
    query, key, value = (part.reshape(shape) for part in qkv.chunk(3, dim=-1))
    if bias is not None:  # Huginn's order: the bias in the activations' dtype, then rotary
        query, key = (query + bias[0]).to(dtype), (key + bias[1]).to(dtype)
    torch.testing.assert_close(q, apply_interleaved_rope(query, cos, sin), **tolerance)
    torch.testing.assert_close(k, apply_interleaved_rope(key, cos, sin), **tolerance)
    assert torch.equal(v, value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_inside_the_kv_write_stores_what_the_separate_write_stores(dtype, interleaved):
    """`cache=`: rotated K and V land in the caches' rows `slots` (scattered, out of order),
    bit for bit what `rope_qkv` then the backend's `write_kv` store; every other row is
    untouched and q is the same."""
    from loopserve.runner.attention.triton_kernels import write_kv

    rows, heads, kv_heads, head_dim = 4, 4, 2, 16
    if interleaved:
        kv_heads = heads
        cos, sin = interleaved_rope_tables(torch.tensor([2, 5, 31, 90]), head_dim, 50_000.0)
    else:
        cos, sin = RotaryEmbedding(head_dim, 10_000.0)(torch.tensor([2, 5, 31, 90]), dtype)
    qkv = _qkv(rows, heads, kv_heads, head_dim, dtype, seed=5)
    slots = torch.tensor([37, 2, 20, 9])
    caches = torch.full((2, 2, 48, kv_heads, head_dim), -7.0, dtype=dtype)  # [how, K/V, ...]
    q, k, v = rope_qkv(qkv, cos, sin, heads, kv_heads, interleaved=interleaved)
    write_kv(k, v, caches[0, 0], caches[0, 1], slots)
    fused_q, none_k, none_v = rope_qkv(qkv, cos, sin, heads, kv_heads, interleaved=interleaved,
                                       cache=(caches[1, 0], caches[1, 1], slots))  # fmt: skip
    assert none_k is None and none_v is None and torch.equal(fused_q, q)
    assert torch.equal(caches[1], caches[0])
    assert torch.equal(caches[1, 0, slots], k) and torch.equal(caches[1, 1, slots], v)
    others = torch.ones(48, dtype=torch.bool)
    others[slots] = False
    assert bool((caches[1, :, others] == -7.0).all())


@pytest.mark.parametrize(("dtype", "tolerance"), TOLERANCES)
@pytest.mark.parametrize("inner", [8, 96, 2500])  # 2500: several programs per row, a tail
def test_silu_mul_equals_torch(dtype, tolerance, inner):
    gate_up = (3 * torch.randn(6, 2 * inner, generator=torch.Generator().manual_seed(3))).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up, **tolerance)


@pytest.mark.parametrize("attention_backend", ["torch", "triton"])
def test_the_ouro_engine_with_every_fused_kernel_equals_the_dense_reference(
    tiny_two_loop_dir, attention_backend, monkeypatch
):
    """The model as the runner prepares it on CUDA (merged projections; fused norms, rotary
    and SiLU-and-multiply; here interpreted), through the emulated decode graphs: tokens and
    exits equal the dense reference of that model, and each fused kernel ran. With the
    Triton backend, rotary runs inside the K/V write (`cache=`) on every call."""
    if attention_backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    work = [  # short prompts: every interpreted program runs in Python
        (f"r{i}", [3 + i, 17, 250][: 1 + i], SamplingParams(
            max_tokens=8, temperature=0.7 if i == 1 else 0.0, seed=i, exit_threshold=0.6,
            ignore_eos=True), i)
        for i in range(3)
    ]  # fmt: skip
    engine = make_engine(
        tiny_two_loop_dir,
        max_num_seqs=4,
        graph_mode="emulate",
        attention_backend=attention_backend,
    )
    engine.model.merge_projections()
    install_fused_kernels(engine.model)
    calls = {"rope": 0, "silu": 0, "rope_write": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            calls["rope_write"] += kwargs.get("cache") is not None
            return fn(*args, **kwargs)

        return call

    engine.model.use_fused_ops(counted("rope", rope_qkv), counted("silu", silu_mul))
    finished = run_steps(engine, work)
    assert calls["rope"] > 20 and calls["silu"] > 20  # 2 layers a loop, 36 here
    assert calls["rope_write"] == (calls["rope"] if attention_backend == "triton" else 0)
    for request_id, prompt, params, _ in work:
        ref = reference_for(engine, prompt, params)
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), request_id
    assert engine.stats.num_graph_calls > 0


@pytest.mark.parametrize("attention_backend", ["torch", "triton"])
def test_huginn_with_every_fused_kernel_matches_its_torch_logits(
    huginn_small_dir, attention_backend, monkeypatch
):
    """Huginn's prelude, core and coda with fused norms, rotary (with a q/k bias) and
    SiLU-and-multiply: its teacher-forced logits equal the torch path's to float32
    rounding, and the engine equals the dense reference of the fused model. With the
    Triton backend, every layer's rotary runs inside its K/V write, routed to its plane."""
    from loopserve.models.huginn_dense import generate, teacher_forced_logits

    if attention_backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    engine = make_engine(  # the fused kernels are interpreted: a small Huginn (conftest)
        huginn_small_dir, exit_criterion="kl",
        attention_backend=attention_backend,
    )  # fmt: skip
    model = engine.model
    for block in model.modules():
        if getattr(block, "qk_bias", None) is not None:
            block.qk_bias.data.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(4))
    prompt = [7, 3, 99, 42, 5]
    plain = teacher_forced_logits(model, prompt)
    install_fused_kernels(model)
    fused = teacher_forced_logits(model, prompt)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    writes = []
    model.use_fused_ops(lambda *a, **kw: writes.append(kw.get("cache")) or rope_qkv(*a, **kw),
                        silu_mul)  # fmt: skip
    params = SamplingParams(max_tokens=3, temperature=0.0, exit_threshold=0.2, ignore_eos=True)
    work = [("a", prompt, params, 0), ("b", [11, 64], params, 1)]
    finished, depths = run_steps(engine, work), []
    for request_id, tokens, _, _ in work:
        ref = generate(model, tokens, max_new_tokens=3, num_steps=None, criterion="kl",
                       threshold=0.2, min_steps=0, lookup="last_exited", exit_in_prompt=False)  # fmt: skip
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.tokens, ref.steps), request_id
        depths.extend(out.exit_depths)
    assert min(depths) < 3  # early exits (finalize copies) too
    if attention_backend == "triton":  # the engine's calls; the references' go through attend
        assert sum(cache is not None for cache in writes) > 20
