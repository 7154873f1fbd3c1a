"""Offline throughput benchmark: workload sampling and a tiny end-to-end run (no timings)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from loopserve.bench.throughput import (
    ARMS,
    add_cli_args,
    exit_probabilities,
    main_from_args,
    make_workload,
)
from loopserve.errors import ConfigError


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(argv)


TINY = [
    "--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "2",
    "--vocab-size", "256", "--num-requests", "6", "--input-len", "8", "--output-len", "10",
    "--repeats", "1", "--max-num-seqs", "4", "--host-rows", "2", "--threads", "1", "--no-progress",
]  # fmt: skip


def test_exit_distributions_are_probabilities_over_loops() -> None:
    for name in ("uniform", "full", "ouro_1p4b_t0.5"):
        probs = exit_probabilities(name, 4)
        assert len(probs) == 4 and sum(probs) == pytest.approx(1.0)
    assert exit_probabilities("full", 3) == (0.0, 0.0, 1.0)
    with pytest.raises(ConfigError):
        exit_probabilities("ouro_1p4b_t0.5", 3)


def test_workload_is_seeded_and_traces_cover_every_output_token() -> None:
    kwargs = dict(
        input_len=20,
        output_len=12,
        range_ratio=0.5,
        vocab_size=100,
        exit_probs=exit_probabilities("uniform", 4),
    )
    first = make_workload(16, seed=3, **kwargs)
    assert first == make_workload(16, seed=3, **kwargs)
    assert first != make_workload(16, seed=4, **kwargs)
    for request in first:
        assert 10 <= len(request.prompt_token_ids) <= 30
        assert all(0 <= t < 100 for t in request.prompt_token_ids)
        assert request.exit_trace is not None and len(request.exit_trace) == request.output_len
        assert set(request.exit_trace) <= {1, 2, 3, 4}


def test_uniform_trace_exits_run_three_arms_with_equal_tokens(tmp_path) -> None:
    out = tmp_path / "throughput.json"
    threads = torch.get_num_threads()
    argv = [*TINY, "--exit-dist", "uniform", "--cost-rows", "2,4", "--out", str(out)]
    assert main_from_args(_parse(argv)) == 0
    assert torch.get_num_threads() == threads  # --threads is undone after the run
    result = json.loads(out.read_text())
    arms = result["arms"]
    assert set(arms) == {arm.name for arm in ARMS}
    tokens = {name: arm["median"]["output_tokens"] for name, arm in arms.items()}
    assert len(set(tokens.values())) == 1 and tokens["refill"] > 0
    assert arms["full_depth"]["median"]["mean_loops_per_token"] == 4.0
    assert arms["refill"]["median"]["mean_loops_per_token"] < 4.0
    host = result["host_overhead_at_rows"]
    assert host["rows"] == 2 and 0 < host["runner_host_ms"] < host["host_ms"] < host["step_ms"]
    refill = arms["refill"]["median"]
    assert 0 < refill["runner_host_share"] < refill["host_overhead_share"] < 1
    assert set(result["ratios"]) == {"refill_over_full_depth", "refill_over_no_refill"}
    assert len(result["ratios"]["refill_over_no_refill"]["cpu_per_round"]) == 1  # --repeats 1
    cdb = result["cdb"]["refill"]  # continuous depth batching against D / mean loops
    assert cdb["ceiling"] == pytest.approx(4.0 / refill_loops(arms))
    assert cdb["speedup"] == pytest.approx(
        arms["full_depth"]["median"]["wall_s"] / arms["refill"]["median"]["wall_s"]
    )
    for arm in arms.values():  # latency beside throughput for every arm
        m = arm["median"]
        assert 0 < m["ttft_ms_p50"] <= m["ttft_ms_p99"] < 1e3 * m["wall_s"]
        assert 0 < m["itl_ms_p50"] <= m["itl_ms_p99"] and 0 < m["tpot_ms_p50"] <= m["tpot_ms_p99"]
    curve = result["cost_curve"]
    assert curve["rows"] == [2, 4] and all(ms > 0 for ms in curve["step_ms"])
    assert curve["per_row_ms"] != 0 and curve["implied_refill_over_no_refill"] > 0
    assert result["machine"]["torch_threads"] >= 1


def test_latency_percentiles_follow_token_times() -> None:
    """Two requests' token times (s): TTFT the first time, TPOT a request's mean gap, ITL
    every gap."""
    from loopserve.bench.throughput import latency_ms

    got = latency_ms({"a": [0.1, 0.3, 0.5], "b": [0.2, 0.2, 1.0]})
    assert got["ttft_ms_p50"] == pytest.approx(150.0)
    assert got["tpot_ms_p50"] == pytest.approx(300.0)  # 200 and 400
    assert got["itl_ms_p50"] == pytest.approx(200.0)  # 200, 200, 0, 800
    assert got["itl_ms_p99"] == pytest.approx(800.0 - 0.03 * 600.0)  # numpy's interpolation


def refill_loops(arms: dict) -> float:
    return arms["refill"]["median"]["mean_loops_per_token"]


def test_gate_exits_run_through_the_cli(tmp_path) -> None:
    from loopserve.cli.main import main

    out = tmp_path / "gate.json"
    # Threshold 0: the gate CDF (>= 0) crosses at the first loop, so with min_loops 1 every
    # token of the early-exit arms must exit after one loop; full depth runs all 4.
    argv = ["bench", "throughput", *TINY, "--exit-threshold", "0.0", "--out", str(out)]
    argv += ["--host-rows", "1"]  # (its engine also runs the warm-up's larger requests)
    assert main(argv) == 0
    arms = json.loads(out.read_text())["arms"]
    assert arms["full_depth"]["median"]["mean_loops_per_token"] == 4.0
    assert arms["refill"]["median"]["mean_loops_per_token"] == 1.0
    assert arms["no_refill"]["median"]["mean_loops_per_token"] == 1.0
    tokens = {name: arm["median"]["output_tokens"] for name, arm in arms.items()}
    assert len(set(tokens.values())) == 1 and tokens["refill"] > 0


def test_speculative_tokens_add_a_refill_spec_arm_with_equal_tokens(tmp_path) -> None:
    out = tmp_path / "spec.json"
    argv = [*TINY, "--exit-dist", "full", "--speculative-tokens", "2", "--draft-loops", "1"]
    assert main_from_args(_parse([*argv, "--out", str(out)])) == 0
    result = json.loads(out.read_text())
    arms = result["arms"]
    assert set(arms) == {arm.name for arm in ARMS} | {"refill_spec"}
    tokens = {name: arm["median"]["output_tokens"] for name, arm in arms.items()}
    assert len(set(tokens.values())) == 1
    spec, refill = arms["refill_spec"]["median"], arms["refill"]["median"]
    assert spec["mean_loops_per_token"] == 4.0  # speculation changes no exit
    assert result["speculation"]["drafted"] > 0
    assert "refill_spec_over_refill" in result["ratios"]
    assert spec["mean_rows_per_core_call"] > refill["mean_rows_per_core_call"]


def test_group_size_adds_a_group_rollout_arm_counting_one_prefill_per_prompt(tmp_path) -> None:
    out = tmp_path / "group.json"
    argv = [*TINY, "--exit-dist", "full", "--group-size", "3", "--max-num-seqs", "6"]
    argv += ["--out", str(out)]
    assert main_from_args(_parse(argv)) == 0
    group = json.loads(out.read_text())["group_rollout"]
    assert (group["groups"], group["group_size"]) == (2, 3)
    shared, alone = group["arms"]["shared"], group["arms"]["independent"]
    assert shared["median"]["output_tokens"] == alone["median"]["output_tokens"] > 0
    assert (shared["forked"], alone["forked"]) == (4, 0)  # two followers per prompt
    # Prompt rows x loops: one prefill per prompt (4 loops each, every round's prompts new to
    # the prefix cache) against three.
    requests = make_workload(6, input_len=8, output_len=10, range_ratio=0.25, vocab_size=256,
                             exit_probs=exit_probabilities("full", 4), seed=0)  # fmt: skip
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests[:2])
    assert shared["prompt_row_loops"] == 4 * prompt_tokens
    assert alone["prompt_row_loops"] == 3 * shared["prompt_row_loops"]
    assert group["shared_over_independent"]["prompt_row_loops"] == pytest.approx(1 / 3)


def test_a_huginn_checkpoint_gets_room_for_its_once_planes(tmp_path) -> None:
    """The benchmark sizes its KV for every request at once in every plane: Huginn's prelude
    and coda plane too, or a lone request does not fit (it failed with "request needs 18 KV
    blocks ... the cache has 16")."""
    from loopserve.cli.main import main
    from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint

    model_dir = make_tiny_huginn_checkpoint(tmp_path / "huginn", mean_recurrence=3)
    out = tmp_path / "huginn.json"
    argv = ["bench", "throughput", "--model", str(model_dir), "--num-requests", "1",
            "--input-len", "8", "--output-len", "10", "--range-ratio", "0", "--repeats", "1",
            "--exit-threshold", "0.1", "--exit-criterion", "latent-diff", "--threads", "1",
            "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    arms = json.loads(out.read_text())["arms"]
    assert {arm["median"]["output_tokens"] for arm in arms.values()} == {10}
