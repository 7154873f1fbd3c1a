"""The skinny GEMMs with fused prologues and the rotary epilogue (runner/fused_linear.py)
against the torch path they replace, under Triton's interpreter on CPU.

The oracle is the model's own torch code: Ouro's RMSNorm modules, `F.linear`, silu(gate) x up,
and rotate-half RoPE (`apply_rope`) with the K/V rows stored at their slots. Elementwise steps
round where torch rounds; the GEMM sums in its own order, so float32 agrees to 1e-5 and
bfloat16 to a few units in its last place."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from loopserve.models import load_model
from loopserve.models.huginn import HuginnRMSNorm, apply_interleaved_rope, interleaved_rope_tables
from loopserve.models.ouro import RMSNorm, RotaryEmbedding, apply_rope

pytest.importorskip("triton")

from loopserve.runner.fused_linear import MAX_ROWS, fits, fused_linear  # noqa: E402
from loopserve.sampling_params import SamplingParams  # noqa: E402
from tests.engine_utils import make_engine, reference_for, run_steps  # noqa: E402

TOLERANCES = [
    (torch.float32, dict(rtol=1e-5, atol=1e-5)),
    (torch.bfloat16, dict(rtol=2**-6, atol=2**-4)),
]


def _randn(*shape, dtype, seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=generator)).to(dtype)


def _norm(hidden: int, dtype, seed: int, eps: float = 1e-6, cls=RMSNorm):
    norm = cls(hidden, eps)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.5 * _randn(hidden, dtype=torch.float32, seed=seed))
    return norm.to(dtype)


@pytest.mark.parametrize(("dtype", "tolerance"), TOLERANCES)
@pytest.mark.parametrize(("rows", "hidden", "n_out"), [(1, 64, 48), (5, 200, 96), (16, 128, 1100)])
def test_plain_gemm_equals_linear(dtype, tolerance, rows, hidden, n_out):
    """K not a multiple of the K tile (200), N not of the N tile (1100): masked tails."""
    x = _randn(rows, hidden, dtype=dtype, seed=0)
    weight = _randn(n_out, hidden, dtype=dtype, seed=1, scale=0.1)
    torch.testing.assert_close(fused_linear(x, weight), F.linear(x, weight), **tolerance)


@pytest.mark.parametrize(("dtype", "tolerance"), TOLERANCES)
@pytest.mark.parametrize("rows", [1, 7])
def test_add_norm_prologue_equals_the_residual_add_the_norms_and_the_gemm(dtype, tolerance, rows):
    hidden, n_out = 160, 72
    residual = _randn(rows, hidden, dtype=dtype, seed=2)
    branch = _randn(rows, hidden, dtype=dtype, seed=3, scale=3.0)
    norm_a, norm_b = _norm(hidden, dtype, seed=4), _norm(hidden, dtype, seed=5, eps=1e-5)
    weight = _randn(n_out, hidden, dtype=dtype, seed=6, scale=0.1)
    out, new_residual = fused_linear(
        branch, weight, residual=residual, norm_a=norm_a, norm_b=norm_b
    )
    want_residual = residual + norm_a(branch)
    torch.testing.assert_close(new_residual, want_residual, **tolerance)
    torch.testing.assert_close(out, F.linear(norm_b(want_residual), weight), **tolerance)
    # Without a branch: the norm of the residual alone, which comes back as it is.
    out, same = fused_linear(None, weight, residual=residual, norm_b=norm_b)
    assert same is residual
    torch.testing.assert_close(out, F.linear(norm_b(residual), weight), **tolerance)


@pytest.mark.parametrize(("dtype", "tolerance"), TOLERANCES)
def test_norm_of_the_sum_prologue_equals_huginns_sandwich(dtype, tolerance):
    """`norm_sum`: the new residual is norm_a(branch + residual) (Huginn's norm_2 / norm_4),
    then norm_b of it feeds the GEMM (norm_3 / the next block's norm_1)."""
    rows, hidden, n_out = 4, 144, 56
    residual = _randn(rows, hidden, dtype=dtype, seed=11, scale=2.0)
    branch = _randn(rows, hidden, dtype=dtype, seed=12)
    norm_a = _norm(hidden, dtype, seed=13, cls=HuginnRMSNorm)
    norm_b = _norm(hidden, dtype, seed=14, eps=1e-5, cls=HuginnRMSNorm)
    weight = _randn(n_out, hidden, dtype=dtype, seed=15, scale=0.1)
    out, new_residual = fused_linear(
        branch, weight, residual=residual, norm_a=norm_a, norm_b=norm_b, norm_sum=True
    )
    want_residual = norm_a(branch + residual)
    torch.testing.assert_close(new_residual, want_residual, **tolerance)
    torch.testing.assert_close(out, F.linear(norm_b(want_residual), weight), **tolerance)


@pytest.mark.parametrize(("dtype", "tolerance"), TOLERANCES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_interleaved_rope_epilogue_equals_huginns_attention_input(dtype, tolerance, with_bias):
    """Huginn's form: pairs (2j, 2j + 1), float32 tables, the q/k bias added in the
    activations' dtype first; into the caches at the rows' slots."""
    rows, hidden, heads, head_dim = 3, 64, 2, 48
    x = _randn(rows, hidden, dtype=dtype, seed=16)
    weight = _randn(3 * heads * head_dim, hidden, dtype=dtype, seed=17, scale=0.2)
    cos, sin = interleaved_rope_tables(torch.tensor([2, 40, 900]), head_dim, 50_000.0)
    bias = _randn(2, heads, head_dim, dtype=dtype, seed=18, scale=0.5) if with_bias else None
    key_cache = torch.zeros(8, heads, head_dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([5, 1, 6])
    q, _, _ = fused_linear(
        x, weight, rope=(cos, sin, heads, heads), interleaved=True, bias=bias,
        cache=(key_cache, value_cache, slots),
    )  # fmt: skip
    query, key, value = (p.reshape(rows, heads, head_dim) for p in F.linear(x, weight).chunk(3, -1))
    if bias is not None:
        query, key = (query + bias[0]).to(dtype), (key + bias[1]).to(dtype)
    torch.testing.assert_close(q, apply_interleaved_rope(query, cos, sin), **tolerance)
    torch.testing.assert_close(key_cache[slots], apply_interleaved_rope(key, cos, sin), **tolerance)
    torch.testing.assert_close(value_cache[slots], value, **tolerance)


@pytest.mark.parametrize(("dtype", "tolerance"), TOLERANCES)
def test_silu_prologue_equals_silu_and_multiply_then_the_gemm(dtype, tolerance):
    rows, inner, n_out = 3, 176, 40
    gate_up = _randn(rows, 2 * inner, dtype=dtype, seed=7, scale=2.0)
    weight = _randn(n_out, inner, dtype=dtype, seed=8, scale=0.1)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.linear(F.silu(gate) * up, weight)
    torch.testing.assert_close(fused_linear(gate_up, weight, silu=True), want, **tolerance)


@pytest.mark.parametrize(("dtype", "tolerance"), TOLERANCES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 64), (2, 2, 12)])
def test_rope_epilogue_equals_projection_then_rotary_and_kv_write(
    dtype, tolerance, heads, kv_heads, head_dim
):
    """GQA at a head size of 64 (two column tiles per half), and 12 (a masked half-tile)."""
    rows, hidden = 6, 96
    x = _randn(rows, hidden, dtype=dtype, seed=9)
    weight = _randn((heads + 2 * kv_heads) * head_dim, hidden, dtype=dtype, seed=10, scale=0.2)
    positions = torch.tensor([0, 1, 5, 77, 300, 4095])
    cos, sin = RotaryEmbedding(head_dim, 10_000.0)(positions, dtype)
    q_w, k_w, v_w = F.linear(x, weight).split(
        (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1
    )
    want_q = apply_rope(q_w.view(rows, heads, head_dim), cos, sin)
    want_k = apply_rope(k_w.view(rows, kv_heads, head_dim), cos, sin)
    want_v = v_w.view(rows, kv_heads, head_dim)
    q, k, v = fused_linear(x, weight, rope=(cos, sin, heads, kv_heads))
    torch.testing.assert_close(q, want_q, **tolerance)
    torch.testing.assert_close(k, want_k, **tolerance)
    torch.testing.assert_close(v, want_v, **tolerance)
    # Into caches at the rows' slots (the attention backend's write); other slots untouched.
    key_cache = torch.full((20, kv_heads, head_dim), 7.0, dtype=dtype)
    value_cache = torch.full_like(key_cache, 7.0)
    slots = torch.tensor([19, 0, 4, 11, 3, 8])
    q2, none_k, none_v = fused_linear(
        x, weight, rope=(cos, sin, heads, kv_heads), cache=(key_cache, value_cache, slots)
    )
    assert none_k is None and none_v is None
    torch.testing.assert_close(q2, want_q, **tolerance)
    torch.testing.assert_close(key_cache[slots], want_k, **tolerance)
    torch.testing.assert_close(value_cache[slots], want_v, **tolerance)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots] = False
    assert (key_cache[untouched] == 7).all() and (value_cache[untouched] == 7).all()
    # Tables over every position (what the models install), each row's read by its position.
    every = RotaryEmbedding(head_dim, 10_000.0)(torch.arange(4096), dtype)
    q3, k3, _ = fused_linear(x, weight, rope=(*every, heads, kv_heads), positions=positions)
    torch.testing.assert_close(q3, want_q, **tolerance)
    torch.testing.assert_close(k3, want_k, **tolerance)


def test_rows_above_one_tile_are_refused():
    weight = torch.zeros(8, 8)
    assert fits(MAX_ROWS, weight) and not fits(MAX_ROWS + 1, weight) and not fits(0, weight)
    assert not fits(1, torch.zeros(8, 16)[:, ::2])  # a strided weight
    with pytest.raises(AssertionError, match="rows"):
        fused_linear(torch.zeros(MAX_ROWS + 1, 8), weight)


def test_the_ouro_engine_with_fused_linears_equals_the_dense_reference(
    tiny_two_loop_dir, monkeypatch
):
    """The model as the runner prepares it on CUDA with `fused_linears` (here interpreted),
    through the emulated decode graphs: tokens and exits equal the dense reference of the
    unfused model. The row bound is lowered to 2 so calls of 1-2 rows take the fused GEMMs
    and calls of 3-4 rows the merged GEMMs beside them; both happened. The Triton attention
    backend: rotary and the K/V write inside the q/k/v GEMM on every fused call (without a
    cache write, as with the torch backend, the unit tests above)."""
    from loopserve.runner.fused_ops import install_fused_kernels

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    work = [  # short prompts: every interpreted program runs in Python
        (f"r{i}", [3 + i, 17, 250][: 1 + i], SamplingParams(
            max_tokens=5, temperature=0.7 if i == 1 else 0.0, seed=i, exit_threshold=0.6,
            ignore_eos=True), i)
        for i in range(4)
    ]  # fmt: skip
    engine = make_engine(
        tiny_two_loop_dir, max_num_seqs=4, graph_mode="emulate", attention_backend="triton"
    )
    references = {rid: reference_for(engine, prompt, params) for rid, prompt, params, _ in work}
    engine.model.merge_projections()
    install_fused_kernels(engine.model, linears=True)
    assert engine.model.fused_linear is fused_linear
    calls = {"rope": 0, "rope_write": 0, "add_norm": 0, "silu": 0, "fused_rows": 0, "wide": 0}

    def counted(*args, **kwargs):
        calls["rope"] += kwargs.get("rope") is not None
        calls["rope_write"] += kwargs.get("cache") is not None
        calls["add_norm"] += kwargs.get("residual") is not None
        calls["silu"] += kwargs.get("silu", False)
        return fused_linear(*args, **kwargs)

    def core_rows(hidden, positions, attn):
        rows = hidden.shape[0]
        calls["fused_rows" if rows <= 2 else "wide"] += 1
        return plain_core(hidden, positions, attn)

    engine.model.use_fused_linears(counted, 2)
    plain_core, engine.model.core = engine.model.core, core_rows
    finished = run_steps(engine, work)
    layers = len(engine.model.model.layers)
    assert calls["fused_rows"] > 0 and calls["wide"] > 0
    assert calls["rope"] == calls["silu"] == layers * calls["fused_rows"]
    assert calls["add_norm"] == 2 * calls["rope"]
    assert calls["rope_write"] == calls["rope"]
    for request_id, *_ in work:
        ref, out = references[request_id], finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), request_id
    assert engine.stats.num_graph_calls > 0


def test_huginn_with_fused_linears_matches_its_torch_path(huginn_small_dir, monkeypatch):
    """Huginn's core steps with `fused_linears` (norms of the sum, interleaved rotary with a
    q/k bias, each block in five launches): teacher-forced logits equal the unfused torch
    path's to float32 rounding, and the engine (Triton backend, interpreted) equals the
    dense reference of the unfused model in tokens and exit steps."""
    from loopserve.models.huginn_dense import generate, teacher_forced_logits
    from loopserve.runner.fused_ops import install_fused_kernels

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    engine = make_engine(  # interpreted kernels: a small Huginn (conftest)
        huginn_small_dir, exit_criterion="kl",
        attention_backend="triton",
    )  # fmt: skip
    model = engine.model
    for block in model.modules():
        if getattr(block, "qk_bias", None) is not None:
            block.qk_bias.data.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(4))
    prompt = [7, 3, 99, 42, 5]
    plain = teacher_forced_logits(model, prompt)
    params = SamplingParams(max_tokens=2, temperature=0.0, exit_threshold=0.01, ignore_eos=True)
    work = [("a", [11, 64], params, 0)]  # one request: every launch runs interpreted
    references = {
        rid: generate(model, tokens, max_new_tokens=2, num_steps=None, criterion="kl",
                      threshold=0.01, min_steps=0, lookup="last_exited", exit_in_prompt=False)
        for rid, tokens, _, _ in work
    }  # fmt: skip
    install_fused_kernels(model, linears=True)
    launches = []
    model.use_fused_linears(lambda *a, **kw: launches.append(kw) or fused_linear(*a, **kw), 16)
    fused = teacher_forced_logits(model, prompt)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    assert any(kw.get("interleaved") and kw.get("bias") is not None for kw in launches)
    assert any(kw.get("norm_sum") and kw.get("rope") is None for kw in launches)
    finished = run_steps(engine, work)
    assert any(kw.get("cache") is not None for kw in launches)  # the engine's K/V writes
    for request_id, *_ in work:
        ref, out = references[request_id], finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.tokens, ref.steps), request_id


def test_fused_linears_on_a_cpu_engine_say_they_run_on_cuda_only(tiny_dir, caplog):
    """The option on a CPU engine: a warning naming the device, and the torch path runs
    (nothing installed)."""
    with caplog.at_level("WARNING", logger="loopserve.runner.model_runner"):
        engine = make_engine(tiny_dir, fused_linears=True)
    assert "fused_linears runs on CUDA only; on cpu" in caplog.text
    assert engine.model.fused_linear is None and engine.model.add_norm_norm is None


def test_the_rotary_tables_cover_the_engines_length_not_the_models(tiny_dir, tmp_path):
    """The fused path's cos/sin tables (read by position) hold the engine's max_model_len
    positions when given, not the checkpoint's maximum (Ouro-1.4B's 65,536 would be 32 MB);
    rows equal the per-call tables at those positions."""
    from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
    from loopserve.runner.fused_ops import install_fused_kernels

    ouro = load_model(str(tiny_dir))
    ouro.merge_projections()
    install_fused_kernels(ouro, linears=True, max_positions=100)
    cos, sin = ouro._rope_tables
    assert cos.shape[0] == sin.shape[0] == 100
    want = ouro.rotary(torch.tensor([0, 57, 99]), cos.dtype)
    assert torch.equal(cos[[0, 57, 99]], want[0]) and torch.equal(sin[[0, 57, 99]], want[1])
    install_fused_kernels(ouro, linears=True)  # no bound: the checkpoint's
    assert ouro._rope_tables[0].shape[0] == ouro.config.max_position_embeddings
    # A bound past the checkpoint's (LOOPSERVE_ALLOW_LONG_MAX_MODEL_LEN=1): covered too, so
    # no position the engine admits reads past the tables.
    longer = ouro.config.max_position_embeddings + 7
    install_fused_kernels(ouro, linears=True, max_positions=longer)
    cos, sin = ouro._rope_tables
    assert cos.shape[0] == longer
    want = ouro.rotary(torch.tensor([longer - 1]), cos.dtype)
    assert torch.equal(cos[[longer - 1]], want[0]) and torch.equal(sin[[longer - 1]], want[1])
    huginn = load_model(str(make_tiny_huginn_checkpoint(tmp_path)))
    install_fused_kernels(huginn, linears=True, max_positions=50)
    assert huginn._rope_tables[0].shape[0] == 50


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_the_memory_plan_reserves_the_rotary_tables(family, tiny_dir, tmp_path, monkeypatch):
    """On CUDA the blocks are sized before the runner builds the fused linears' cos/sin
    tables, so the plan reserves their bytes: with `fused_linears` the KV budget is smaller
    by exactly what the tables take (counted from the tensors the model builds), and not
    at all without it. The device profile is stubbed: the sizing is host arithmetic."""
    from loopserve.config import EngineConfig
    from loopserve.engine import model_setup
    from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
    from loopserve.runner.memory_profile import CudaMemoryProfile

    path = tiny_dir if family == "ouro" else make_tiny_huginn_checkpoint(tmp_path)
    model = load_model(str(path))
    profile = CudaMemoryProfile(total_bytes=1 << 30, peak_bytes=1 << 28, graph_bytes=0)
    monkeypatch.setattr(model_setup, "profile_cuda_memory", lambda *a, **kw: profile)

    def plan(fused: bool) -> tuple[int, int]:
        config = EngineConfig.from_engine_args(
            model=str(path), device="cuda", block_size=16, fused_linears=fused,
            enable_prefix_caching=False,
        )  # fmt: skip
        cache, per_block, inflight = model_setup.size_kv_cache(config, model, 777)
        return cache.num_blocks, budget - inflight, per_block

    budget = int((1 << 30) * 0.9) - (1 << 28)  # total x utilization 0.9, less the peak
    model.use_fused_linears(lambda *a, **kw: None, 16, 777)
    tables = sum(t.numel() * t.element_size() for t in model._rope_tables)
    assert tables == model.rope_table_bytes(777) > 0
    (with_tables, _, _), (without, free, per_block) = plan(True), plan(False)
    assert without == free // per_block
    assert with_tables == (free - tables) // per_block < without
