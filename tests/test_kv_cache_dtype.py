"""An 8-bit KV cache (`kv_cache_dtype` fp8_e4m3 / fp8_e5m2): the engine stores K/V as the
dense references round them, on every path that writes or reads K/V, and the cache holds
more tokens for its bytes."""

from __future__ import annotations

import pytest
import torch

from loopserve.config import EngineConfig
from loopserve.errors import ConfigError
from loopserve.models.huginn_dense import prompt_logprobs_at_exit
from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopserve.models.kv_dtype import kv_storage_dtype, round_trip, to_storage
from loopserve.reference import generate
from loopserve.runner.attention.triton_jit import observe_launches
from loopserve.runner.fused_ops import install_fused_kernels
from loopserve.sampling_params import SamplingParams
from tests.engine_utils import (
    assert_match_reference,
    make_engine,
    random_workload,
    run_steps,
)
from tests.test_huginn_engine import assert_matches_reference, assert_released
from tests.test_huginn_engine import workload as huginn_workload

FP8 = ("fp8_e4m3", "fp8_e5m2")
# Paths that write or read K/V differently, each met by both element types and layouts.
PATHS = {
    "torch": {},
    "triton": {"attention_backend": "triton"},
    "triton_graphs": {"attention_backend": "triton", "graph_mode": "emulate"},
    "swap": {"num_blocks": 56, "preemption_mode": "swap", "max_num_seqs": 4},
    "batch_invariant": {"batch_invariant": True},
    "mixed": {"prefill_mode": "wavefront", "mixed_prefill_decode": True},
}
# Each path meets an element type; the torch paths meet both layouts. The Triton kernels see
# only block tables (a layout is the scheduler's), and each launch is interpreted on CPU, so
# they run last_exited with a small workload, one element type each.
CASES = [
    ("fp8_e4m3", "last_exited", "torch"),
    ("fp8_e5m2", "shared", "torch"),
    ("fp8_e4m3", "last_exited", "triton"),
    ("fp8_e5m2", "last_exited", "triton_graphs"),
    ("fp8_e5m2", "last_exited", "swap"),
    ("fp8_e4m3", "shared", "swap"),
    ("fp8_e4m3", "shared", "batch_invariant"),
    ("fp8_e5m2", "last_exited", "mixed"),
]


def small_workload():
    """Three greedy requests of short prompts, arriving one step apart."""
    return [
        (f"s{i}", [(7 * i + 3 * j) % 256 for j in range(length)],
         SamplingParams(max_tokens=4, temperature=0.0, exit_threshold=threshold,
                        ignore_eos=True), i)
        for i, (length, threshold) in enumerate([(3, 0.5), (6, 1.0), (2, 0.3)])
    ]  # fmt: skip


def test_storage_saturates_and_rounds_to_nearest():
    x = torch.tensor([1000.0, -1e6, float("inf"), 447.0, 0.3, -2.2e-3])
    stored = to_storage(x, torch.float8_e4m3fn)
    assert stored.dtype == torch.float8_e4m3fn
    # Past the largest finite value (448) a value saturates; it never becomes inf or NaN.
    assert stored.float()[:3].tolist() == [448.0, -448.0, 448.0]
    # Rounded to nearest: 0.3 lies between 0.28125 and 0.3125, nearer the latter.
    assert stored.float()[4].item() == 0.3125
    assert torch.equal(round_trip(x, torch.float8_e5m2), to_storage(x, torch.float8_e5m2).float())
    assert round_trip(x, None) is x and to_storage(x, torch.float32) is x
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16


@pytest.mark.parametrize("dtype, layout, path", CASES, ids=["-".join(c) for c in CASES])
def test_an_fp8_engine_equals_the_dense_reference_with_fp8_kv(
    tiny_dir, tiny_two_loop_dir, monkeypatch, dtype, layout, path
):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    overrides = dict(PATHS[path])
    if layout == "shared" and path == "swap":
        overrides["num_blocks"] = 20  # one plane per position: fewer blocks to preempt
    model_dir = tiny_two_loop_dir if path.startswith("triton") else tiny_dir  # interpreted
    engine = make_engine(model_dir, kv_cache_dtype=dtype, layout=layout, **overrides)
    assert engine.runner.kv_cache.dtype == kv_storage_dtype(dtype, torch.float32)
    work = (
        small_workload() if path.startswith("triton") else random_workload(7, 8, 512, sampled=False)
    )
    finished = run_steps(engine, work)
    depths = assert_match_reference(engine, work, finished)
    loops = engine.model.config.total_ut_steps
    assert min(depths) < loops and max(depths) == loops  # early exits and full-depth tokens
    if path == "swap":
        assert engine.stats.num_preemptions > 0
    if path.startswith("triton"):
        return  # too few tokens for the rounding to change one; the torch cases show it
    # The rounding is seen: the reference without it differs for some request.
    default = [
        generate(engine.model, prompt, params, layout=layout).token_ids
        for _, prompt, params, _ in work
    ]
    assert default != [finished[request_id].token_ids for request_id, *_ in work]


@pytest.mark.parametrize("linears", [False, True], ids=["rotary", "fused_linears"])
def test_the_fused_kernels_write_the_fp8_bytes_themselves(linears, tmp_path, monkeypatch):
    """The model as the runner prepares it on CUDA: its fused rotary writes the rotated K/V
    bytes itself, and with `fused_linears` the q/k/v GEMM does (calls of up to 16 rows). A
    one-layer, two-loop model: each interpreted program runs in Python."""
    from loopserve.models.tiny import make_tiny_checkpoint

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model_dir = make_tiny_checkpoint(tmp_path, seed=0, num_layers=1, total_ut_steps=2)
    dtype = "fp8_e5m2" if linears else "fp8_e4m3"
    engine = make_engine(model_dir, kv_cache_dtype=dtype, attention_backend="triton")
    engine.model.merge_projections()
    install_fused_kernels(engine.model, linears=linears, max_positions=engine.max_model_len)
    work = small_workload()[:2]
    with observe_launches() as launches:
        finished = run_steps(engine, work)
    assert_match_reference(engine, work, finished)
    kernel = "_fused_linear_kernel" if linears else "_rope_qkv_kernel"
    writes = [lch for lch in launches
              if lch.kernel.fn.__name__ == kernel and lch.constexprs.get("WRITE")]  # fmt: skip
    assert writes and all(lch.constexprs["FP8"] == (2 if linears else 1) for lch in writes)
    assert not any(lch.kernel.fn.__name__ == "_write_kv_kernel" for lch in launches)


def test_prefix_cache_hits_and_cascade_attention_read_fp8_blocks(tiny_dir):
    engine = make_engine(tiny_dir, kv_cache_dtype="fp8_e4m3", cascade_attention=True)
    prefix = [(5 * j + 1) % 256 for j in range(12)]
    work = [
        (f"p{i}", prefix + [i + 3, 2 * i + 9],
         SamplingParams(max_tokens=6, temperature=0.0, exit_threshold=0.5, ignore_eos=True),
         0 if i == 0 else 4)
        for i in range(4)
    ]  # fmt: skip
    finished = run_steps(engine, work)
    assert_match_reference(engine, work, finished)
    assert engine.stats.num_prefix_cache_hit_tokens > 0
    assert engine.runner.attention.cascade_stats.num_groups > 0


@pytest.mark.parametrize("dtype", FP8)
def test_a_huginn_fp8_engine_equals_its_dense_reference(tmp_path, dtype):
    huginn_dir = make_tiny_huginn_checkpoint(tmp_path)
    engine = make_engine(huginn_dir, kv_cache_dtype=dtype, exit_criterion="kl",
                         prefill_chunk_size=5)  # fmt: skip
    assert engine.runner.kv_cache.dtype == kv_storage_dtype(dtype, torch.float32)
    work = huginn_workload(11, "kl")
    finished = run_steps(engine, work)
    steps = assert_matches_reference(engine, work, finished, "kl", kv_cache_dtype=dtype)
    assert min(steps) < 8 and max(steps) == 8
    assert engine.stats.num_prefix_cache_hit_tokens > 0
    assert_released(engine)


def test_huginn_exit_loop_prompt_scores_read_fp8_k_v_as_the_reference_does(tmp_path):
    """The scoring leave (`PeekAttention`) attends to stored coda K/V and its own, unstored:
    its own is rounded as the reference's write-then-read rounds it. The prompt runs in one
    call, as the reference runs it: rounding to fp8 is discontinuous, so the last-bit fp32
    differences between a call of 5 rows and one of 13 (which the fp32 tests' 1e-4 absorbs)
    can move an element to the neighbouring fp8 value (measured: scores 0.025 apart under
    fp8_e5m2 with 5-token chunks, 1e-6 in one call)."""
    huginn_dir = make_tiny_huginn_checkpoint(tmp_path)
    engine = make_engine(huginn_dir, kv_cache_dtype="fp8_e5m2", exit_criterion="kl",
                         prefill_chunk_size=16)  # fmt: skip
    prompt = [7, 3, 99, 42, 5, 17, 64, 11, 4, 5, 6, 9, 30]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=1,
                            exit_threshold=0.03, prompt_logprobs_loop="exit")  # fmt: skip
    out = run_steps(engine, [("p", prompt, params, 0)])["p"]
    want, steps = prompt_logprobs_at_exit(
        engine.model, prompt, criterion="kl", threshold=0.03, kv_cache_dtype="fp8_e5m2"
    )
    got = out.prompt_logprobs[1:]
    assert [entry.loops for entry in got] == steps and min(steps) < engine.num_loops
    assert [entry.logprob for entry in got] == pytest.approx(want.tolist(), abs=1e-4)


def test_an_fp8_cache_holds_four_times_the_blocks_of_fp32_for_its_bytes(tiny_dir):
    # Without prefix caching: its score store keeps a hidden vector (model dtype) per slot.
    sized = dict(num_blocks=None, kv_cache_bytes=8 * 1024**2, enable_prefix_caching=False)
    wide = make_engine(tiny_dir, **sized)
    narrow = make_engine(tiny_dir, kv_cache_dtype="fp8_e4m3", **sized)
    assert narrow.runner.kv_cache.element_size() == 1
    assert narrow.kv.pool.num_blocks == pytest.approx(4 * wide.kv.pool.num_blocks, rel=0.01)
    assert narrow.runner.kv_cache.nbytes == pytest.approx(wide.runner.kv_cache.nbytes, rel=0.01)


def test_bad_or_conflicting_settings_are_refused_by_name():
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        EngineConfig.from_engine_args(kv_cache_dtype="int4")


def test_an_e4m3_cache_is_refused_where_triton_cannot_convert_it():
    from loopserve.engine.model_setup import check_kv_cache_dtype

    def config(dtype, backend="auto"):
        return EngineConfig.from_engine_args(
            device="cuda", kv_cache_dtype=dtype, attention_backend=backend
        )

    with pytest.raises(ConfigError, match="compute capability 8.9 or later.*this GPU: 8.0"):
        check_kv_cache_dtype(config("fp8_e4m3"), 80)
    check_kv_cache_dtype(config("fp8_e4m3"), 89)
    check_kv_cache_dtype(config("fp8_e5m2"), 80)
    check_kv_cache_dtype(config("fp8_e4m3", "torch"), 80)  # torch converts it anywhere


def test_the_simulator_holds_twice_the_blocks_and_reads_half_the_k_v_with_fp8():
    from loopserve.sim.cost_model import OURO_1P4B
    from loopserve.sim.hardware import get_device_profile
    from loopserve.sim.simulator import Simulator

    h200 = get_device_profile("h200")
    sims = {
        kv: Simulator(OURO_1P4B, h200, {"kv_cache_dtype": kv, "enable_prefix_caching": False})
        for kv in ("auto", "fp8_e4m3")
    }
    auto, fp8 = sims["auto"], sims["fp8_e4m3"]
    assert fp8.shape.kv_bytes_per_token_per_depth * 2 == auto.shape.kv_bytes_per_token_per_depth
    blocks = fp8.config.cache.num_blocks / auto.config.cache.num_blocks
    assert blocks == pytest.approx(2, rel=0.01)
    # a decode loop of 64 rows at 1,024 positions each reads half the K/V bytes
    call = dict(rows=64, kv_read_positions=64 * 1024, attention_pairs=64 * 1024)
    costs = [sim.cost_model.core_call(**call).bytes_moved for sim in (auto, fp8)]
    kv_auto = 64 * 1024 * auto.shape.kv_bytes_per_token_per_depth
    assert costs[0] - costs[1] == pytest.approx(kv_auto / 2, rel=0.01)


def test_the_command_line_takes_the_flag_and_names_it_when_wrong(tmp_path):
    import subprocess
    import sys

    from loopserve.models.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path, seed=3, with_tokenizer=True)
    argv = [sys.executable, "-m", "loopserve.cli.main", "generate", "--model", str(model),
            "--dtype", "float32", "--num-blocks", "32", "--max-tokens", "3",
            "--prompt-token-ids", "5,6"]  # fmt: skip
    done = subprocess.run([*argv, "--kv-cache-dtype", "fp8_e4m3"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "prompt:" in done.stdout
    done = subprocess.run([*argv, "--kv-cache-dtype", "int4"], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2 and "--kv-cache-dtype" in done.stderr


def test_an_fp8_hand_off_carries_the_rounded_k_v_and_a_mismatch_is_refused(tiny_dir):
    from tests.test_pd_handoff import assert_clean, handoff_workload, run_disaggregated

    prefill = make_engine(tiny_dir, kv_cache_dtype="fp8_e5m2")
    decode = make_engine(tiny_dir, kv_cache_dtype="fp8_e5m2", num_blocks=300)
    work = handoff_workload(11, 4, 512)
    finished, exported, _ = run_disaggregated(prefill, decode, work)
    assert sorted(exported) == sorted(request_id for request_id, *_ in work)
    assert_match_reference(prefill, [(r, p, s, 0) for r, p, s, _ in work], finished)
    assert decode.stats.num_output_tokens > 0
    assert_clean(prefill)
    assert_clean(decode)
    # A decode replica with another element type refuses the K/V rather than misread it.
    wide = make_engine(tiny_dir)
    prefill.add_request("m", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))
    while not prefill.can_export("m"):
        prefill.step()
    with pytest.raises(ValueError, match="same dtype and kv_cache_dtype"):
        wide.import_request(prefill.export_request("m"))


def _hard_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of `dtype`, each midpoint between neighbours (ties) and the float
    on either side of it, saturation, infinities, NaN, signed zeros and random values."""
    every = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = every[torch.isfinite(every)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    inf = torch.tensor(float("inf"))
    edges = torch.tensor([float("nan"), -float("nan"), 0.0, -0.0, 1e-30, -1e-45, 1e6, -1e6,
                          float("inf"), -float("inf"), 449.0, 464.0, 61440.0, -7.9])  # fmt: skip
    rng = torch.Generator().manual_seed(0)
    return torch.cat([finite, mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf),
                      edges, torch.randn(2000, generator=rng) * 50])  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_kernel_writes_store_the_bytes_torch_rounds_to(dtype, model_dtype):
    """`write_kv` and the rotary K/V write encode in the kernel (`fp8_bits`, integer
    arithmetic): byte for byte what `to_storage` stores, ties and saturation included.
    (The interpreter's own float-to-fp8 cast gets 7.9 wrong, so a cast would fail here.)"""
    from loopserve.runner.attention.triton_kernels import write_kv
    from loopserve.runner.fused_ops import rope_qkv

    heads, dim = 4, 64  # wide rows: few interpreted programs
    values = _hard_values(dtype).to(model_dtype)
    rows = -(-values.numel() // (heads * dim))
    values = torch.cat([values, values[: rows * heads * dim - values.numel()]])
    kv = values.view(rows, heads, dim)
    expected = to_storage(kv, dtype).view(torch.uint8)
    slots = torch.randperm(rows + 7, generator=torch.Generator().manual_seed(1))[:rows]
    key_cache = torch.zeros(rows + 7, heads, dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    write_kv(kv, kv.flip(0), key_cache, value_cache, slots)
    assert torch.equal(key_cache[slots].view(torch.uint8), expected)
    assert torch.equal(value_cache[slots].view(torch.uint8), expected.flip(0))
    # Rotary with cos 1, sin 0 leaves q and k as they are (x + (-y * 0): finite, nonzero
    # values, as an infinity's pair would turn NaN and a zero's sign would follow its
    # pair's); k and v land rounded in the cache.
    kv = torch.where(torch.isfinite(kv) & (kv != 0), kv, 1.0)
    expected = to_storage(kv, dtype).view(torch.uint8)
    qkv = torch.cat([kv, kv, kv.flip(0)], dim=1).reshape(rows, 3 * heads * dim)
    cos = torch.ones(rows, dim, dtype=model_dtype)
    rope_qkv(qkv, cos, torch.zeros_like(cos), heads, heads,
             cache=(key_cache, value_cache, slots))  # fmt: skip
    assert torch.equal(key_cache[slots].view(torch.uint8), expected)
    assert torch.equal(value_cache[slots].view(torch.uint8), expected.flip(0))


def test_huginns_fused_rotary_with_an_8_bit_cache_rotates_then_writes(tmp_path, monkeypatch):
    """Huginn's interleaved rotary leaves the 8-bit write to `write_kv` (the fused form spills
    under Triton 3.6): the engine as on CUDA (Triton backend, fused kernels; interpreted)
    equals the dense reference, and each such layer launches the write."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    layers = dict(n_layers_in_prelude=1, n_layers_in_recurrent_block=1, n_layers_in_coda=1)
    huginn_dir = make_tiny_huginn_checkpoint(tmp_path, mean_recurrence=3, **layers)
    engine = make_engine(huginn_dir, kv_cache_dtype="fp8_e4m3", attention_backend="triton",
                         exit_criterion="kl")  # fmt: skip
    install_fused_kernels(engine.model, linears=False, max_positions=engine.max_model_len)
    work = [
        (f"h{i}", [(5 * i + 3 * j) % 120 + 3 for j in range(length)],
         SamplingParams(max_tokens=3, temperature=0.0, exit_threshold=0.1, ignore_eos=True), i)
        for i, length in enumerate([4, 2])
    ]  # fmt: skip
    with observe_launches() as launches:
        finished = run_steps(engine, work)
    assert_matches_reference(engine, work, finished, "kl", kv_cache_dtype="fp8_e4m3")
    names = [lch.kernel.fn.__name__ for lch in launches]
    rotary = [lch for lch in launches if lch.kernel.fn.__name__ == "_rope_qkv_kernel"]
    assert rotary and not any(lch.constexprs["WRITE"] for lch in rotary)
    assert names.count("_write_kv_kernel") >= len(rotary)
