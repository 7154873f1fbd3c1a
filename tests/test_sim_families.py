"""The simulator prices every registered family: Huginn's prelude, coda and adapter, its
once-per-position K/V plane, and exit criteria that run the coda after every loop."""

from __future__ import annotations

import math

import pytest

from loopserve.errors import ConfigError
from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopserve.sim.cost_model import (
    HUGINN_0125,
    OURO_1P4B,
    OURO_2P6B,
    CostModel,
    ModelShape,
    sim_model_config,
)
from loopserve.sim.hardware import get_device_profile
from loopserve.sim.metrics import summarize
from loopserve.sim.simulator import Simulator
from loopserve.sim.workload import WorkloadSpec, build_workload

H200 = get_device_profile("h200")


def test_both_families_configs_are_the_looped_config_seam():
    """The cost model, the KV manager and the memory plan read a family only through
    `LoopedConfig`: both configs provide it, and their once-per-position layers differ."""
    from loopserve.models.family import LoopedConfig

    for config in (OURO_1P4B, HUGINN_0125):
        assert isinstance(config, LoopedConfig)
    assert (OURO_1P4B.num_prelude_layers, OURO_1P4B.num_coda_layers) == (0, 0)
    assert (HUGINN_0125.num_prelude_layers, HUGINN_0125.num_coda_layers) == (2, 2)
    assert OURO_1P4B.exit_gate_params == 2048 + 1 and HUGINN_0125.exit_gate_params == 0


def test_huginn_0125_shape_matches_its_published_size():
    shape = ModelShape.from_config(HUGINN_0125)
    params = shape.total_weight_bytes / shape.dtype_bytes
    assert 3.4e9 < params < 3.7e9  # "3.5B parameters"
    # The model card's guideline: about 1.5B recurrent parameters per step.
    assert 1.4e9 < shape.core_params < 1.7e9
    # K/V per position: 4 core layers x 55 heads x 96 dims x K and V x 2 bytes per plane, and
    # the 2 prelude + 2 coda layers once: one extra plane of the same size.
    assert shape.kv_bytes_per_token_per_depth == 2 * 4 * 55 * 96 * 2 == 84_480
    assert shape.kv_bytes_per_token_once == 84_480 and shape.extra_kv_planes == 1
    assert shape.vectors_per_row == 2  # the state and the injected prelude output
    ouro = ModelShape.from_config(OURO_1P4B)
    assert ouro.extra_kv_planes == 0 and ouro.vectors_per_row == 1
    assert ModelShape.from_config(OURO_2P6B).core_params > 1.9 * ouro.core_params


def test_huginn_prelude_and_coda_layers_cost_what_a_core_layer_costs():
    shape = ModelShape.from_config(HUGINN_0125)
    cost = CostModel(shape, H200)
    base = cost.core_call(rows=64, kv_read_positions=64 * 100, attention_pairs=64 * 100)
    with_prelude = cost.core_call(rows=64, prelude_rows=64, kv_read_positions=64 * 100,
                                  attention_pairs=64 * 100, prelude_kv_read=64 * 100,
                                  prelude_pairs=64 * 100)  # fmt: skip
    # Two prelude layers over the same rows: about half a core step's bytes more.
    extra = with_prelude.bytes_moved - base.bytes_moved
    assert 0.4 < extra / base.bytes_moved < 0.6
    head_only = CostModel(ModelShape.from_config(OURO_1P4B), H200).coda(8)
    assert cost.coda(8, kv_read_positions=800, attention_pairs=800).bytes_moved > (
        ModelShape.from_config(HUGINN_0125).lm_head_weight_bytes
    )
    assert head_only.bytes_moved > 0


@pytest.mark.parametrize("layout, planes", [("last_exited", 33), ("shared", 2)])
def test_huginn_requests_hold_one_plane_per_step_plus_the_once_plane(layout, planes):
    spec = WorkloadSpec(num_requests=6, dataset="synthetic", input_len=16, output_len=12,
                        exit_dist="uniform")  # fmt: skip
    workload = build_workload(spec, HUGINN_0125.num_loops)
    sim = Simulator(HUGINN_0125, H200, {"max_num_seqs": 4, "layout": layout})
    assert sim.kv.num_planes == planes
    result = summarize(sim.run(workload, on_step=lambda s: s.check_invariants()))
    assert result.num_finished == 6
    assert result.num_output_tokens == sum(r.output_len for r in workload)


def test_a_criterion_that_reads_logits_every_loop_costs_coda_time():
    spec = WorkloadSpec(num_requests=16, dataset="synthetic", input_len=64, output_len=16,
                        exit_dist="uniform")  # fmt: skip
    workload = build_workload(spec, HUGINN_0125.num_loops)
    runs = {}
    for every_loop in (False, True):
        # Leaves at exits either way (auto would batch them only without the criterion).
        args = {"max_num_seqs": 8, "coda_batching": "off"}
        sim = Simulator(HUGINN_0125, H200, args, coda_every_loop=every_loop)
        sim.run(workload)
        runs[every_loop] = sim.executor.stats
    assert runs[True].core_time_s == pytest.approx(runs[False].core_time_s)
    assert runs[True].coda_time_s > 2 * runs[False].coda_time_s


def test_sim_model_config_reads_presets_and_any_family_config(tmp_path):
    assert sim_model_config(None) is OURO_1P4B
    assert sim_model_config("Huginn-0125") is HUGINN_0125
    tiny = sim_model_config(str(make_tiny_huginn_checkpoint(tmp_path / "h") / "config.json"))
    assert tiny.mean_recurrence == 8 and tiny.n_embd == 32


def test_ouro_2p6b_public_config_loads_and_is_the_simulator_preset(tmp_path):
    """The fields of a public copy of Ouro-2.6B's config.json: the engine's config class and
    family registry read it, and its shape is the simulator's `ouro-2.6b` preset."""
    import json
    import shutil
    from pathlib import Path

    from loopserve.models.config import OuroConfig
    from loopserve.models.registry import OURO, read_config

    fixture = Path(__file__).parent / "fixtures" / "ouro_2p6b_config.json"
    shutil.copy(fixture, tmp_path / "config.json")
    family, config = read_config(tmp_path)
    assert family is OURO and isinstance(config, OuroConfig)
    assert config.num_hidden_layers == 48 and config.num_loops == 4
    assert config.eos_token_id == (2,)
    shape = ModelShape.from_config(config)
    assert shape == ModelShape.from_config(OURO_2P6B)
    assert 2.6e9 < shape.total_weight_bytes / shape.dtype_bytes < 2.7e9  # "2.6B"
    # K/V per position per plane in bf16: 48 layers x 16 KV heads x 128 x K and V x 2 bytes.
    assert config.kv_bytes_per_block(1, 2) == 48 * 16 * 128 * 2 * 2 == 393_216
    assert json.loads(fixture.read_text())["total_ut_steps"] == 4


def test_ouro_2p6b_config_with_every_documented_field_loads(tmp_path):
    """The fixture plus the fields a published Ouro config.json carries beyond it (as its
    model documentation lists them: `architectures`, `auto_map`, `layer_types` x 48,
    `use_sliding_window`, `early_exit_threshold`, ...) loads to the same config; a sliding
    layer type is refused by name."""
    import json
    from pathlib import Path

    from loopserve.errors import ModelLoadError
    from loopserve.models.config import OuroConfig

    fixture = json.loads((Path(__file__).parent / "fixtures" / "ouro_2p6b_config.json").read_text())
    documented = {
        "architectures": ["OuroForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_ouro.OuroConfig",
            "AutoModel": "modeling_ouro.OuroModel",
            "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
        },
        "layer_types": ["full_attention"] * 48,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 48,
        "early_exit_threshold": 1.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }
    full = OuroConfig.from_dict({**fixture, **documented})
    assert full == OuroConfig.from_dict(fixture)
    assert full.extra["early_exit_threshold"] == 1.0 and full.num_loops == 4
    with pytest.raises(ModelLoadError, match="sliding-window"):
        OuroConfig.from_dict({**fixture, "layer_types": ["sliding_attention"] * 48})


def test_a_full_depth_arm_prices_no_criterion_coda():
    """full_depth never turns a criterion on, so `coda_every_loop` leaves it unchanged, while
    refill under the same flag pays the criterion's codas."""
    from loopserve.sim.sweep import ARMS, SweepSetup, run_point

    spec = WorkloadSpec(num_requests=8, dataset="synthetic", input_len=32, output_len=8,
                        exit_dist="huginn_0125_argmax10")  # fmt: skip
    lengths = [(r.prompt_len, r.output_len) for r in build_workload(spec, 32)]
    results = {}
    for every_loop in (False, True):
        setup = SweepSetup(HUGINN_0125, H200, spec, {"max_num_seqs": 8}, lengths,
                           coda_every_loop=every_loop)  # fmt: skip
        for arm in ("full_depth", "refill"):
            results[arm, every_loop] = run_point(setup, ARMS[arm], math.inf).result
    full, full_every = results["full_depth", False], results["full_depth", True]
    assert full_every.output_throughput == pytest.approx(full.output_throughput)
    refill, refill_every = results["refill", False], results["refill", True]
    assert refill_every.output_throughput < 0.95 * refill.output_throughput


def test_simulate_cli_runs_huginn_on_its_authors_recorded_steps(tmp_path):
    """`loopserve simulate --model-config huginn-0125` with a step distribution its authors
    recorded (32 steps; the speculative drafts' 4-loop default is not read without
    speculation): every policy runs, and refill's tokens use the distribution's steps."""
    import json

    from loopserve.cli.main import main
    from loopserve.workloads.exits import exit_distribution

    argv = ["simulate", "--model-config", "huginn-0125", "--dataset", "synthetic"]
    argv += ["--num-requests", "12", "--input-len", "32", "--output-len", "16"]
    argv += ["--policies", "refill", "full_depth", "--exit-dist", "huginn_0125_argmax10"]
    argv += ["--output-dir", str(tmp_path), "--no-progress"]
    assert main(argv) == 0
    records = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))]
    assert records, "the run wrote its results"
    text = json.dumps(records)
    assert "refill" in text and "full_depth" in text
    dist = exit_distribution("huginn_0125_argmax10", 32)
    assert dist.probs[10] == 56 / 130 and sum(dist.probs[:10]) == 0  # 11 steps at least
    assert exit_distribution("huginn_0125_latent_diff", 32).mean_loops == pytest.approx(4000 / 154)
    with pytest.raises(ConfigError, match="defined for 32 steps"):
        exit_distribution("huginn_0125_latent_diff", 4)


def test_simulate_defaults_to_the_models_own_exits_and_names_a_workload_too_long(tmp_path, capsys):
    """Without --exit-dist the simulated model's measured exits are used (Ouro-1.4B's
    gate, Huginn-0125's latent-diff steps; the Ouro default failed for Huginn: "defined for 4
    loops"); a workload longer than the model holds is a usage error naming the flags (it
    was a bare ValueError)."""
    import json

    from loopserve.cli.main import main
    from loopserve.sim.cli import default_exit_dist
    from loopserve.sim.cost_model import HUGINN_0125, OURO_1P4B

    assert default_exit_dist(OURO_1P4B) == "ouro_1p4b_t0.5"
    assert default_exit_dist(HUGINN_0125) == "huginn_0125_latent_diff"
    argv = ["simulate", "--model-config", "huginn-0125", "--dataset", "synthetic",
            "--num-requests", "6", "--input-len", "32", "--output-len", "8",
            "--policies", "refill", "--output-dir", str(tmp_path), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    record = json.loads((tmp_path / "simulate.json").read_text())
    assert record["args"]["exit_dist"] == "huginn_0125_latent_diff"
    argv[argv.index("--input-len") + 1] = "5000"  # Huginn-0125 holds 4096 positions
    assert main([*argv, "--range-ratio", "0"]) == 2
    error = capsys.readouterr().err
    assert "exceed the simulated model's 4096" in error and "--input-len" in error
    assert "Traceback" not in error


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--policies", "full_depth", "--exit-dist", "nosuch"], "unknown exit distribution"),
        (["--fused-linears"], "--kernel-us"),
        (["--kernels-per-layer", "5"], "--kernel-us"),
    ],
)
def test_simulate_refuses_flags_it_would_ignore(flags, message, tmp_path, capsys):
    """A bad --exit-dist with full_depth alone ran (no arm sampled it), and the kernel
    pricing flags without --kernel-us priced nothing: each is a usage error now, before any
    simulation runs."""
    from loopserve.cli.main import main

    argv = ["simulate", "--dataset", "synthetic", "--num-requests", "1", "--input-len", "8",
            "--output-len", "8", "--output-dir", str(tmp_path), "--no-progress", *flags]  # fmt: skip
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "simulate.json").exists()
