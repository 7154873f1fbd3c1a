"""Prompt-scheduling benchmarks (`bench wcpb`, `bench interference`): tiny end-to-end runs.

Structure and mechanics only (rows per call, mixed calls, validation); no timing assertions.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from loopserve.bench import prompt_interference, prompt_sched
from loopserve.bench.prompt_sched import CallRecorder, InvalidRunError, build_engine
from loopserve.cli.main import main as cli_main
from loopserve.errors import ConfigError
from loopserve.sampling_params import SamplingParams

TINY_MODEL = [
    "--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "2",
    "--vocab-size", "256", "--repeats", "1", "--no-progress",
]  # fmt: skip
WCPB = ["--prompt-lens", "96,80", "--chunk-sizes", "32,8", "--max-num-batched-tokens", "64"]
INTERFERENCE = [
    "--num-decode", "3", "--decode-prompt-len", "5", "--decode-max-tokens", "200",
    "--prompt-lens", "48,40", "--inject-at", "2,3", "--prefill-chunk-size", "8",
    "--max-num-batched-tokens", "32",
]  # fmt: skip


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from a second thread and stall badly on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_cli_args(parser)
    return parser.parse_args(argv)


def test_wcpb_reports_every_arm_and_chunk_and_wavefront_fills_calls(tmp_path) -> None:
    out = tmp_path / "wcpb.json"
    args = _parse(prompt_sched, TINY_MODEL + WCPB + ["--out", str(out)])
    assert prompt_sched.main_from_args(args) == 0
    result = json.loads(out.read_text())
    assert {"config", "machine", "results", "ratios"} <= result.keys()
    assert "loadavg_1m_start" in result["machine"] and "loadavg_1m_end" in result["machine"]
    cells = {(r["arm"], r["chunk_size"]): r for r in result["results"]}
    assert set(cells) == {(a, c) for a in ("atomic", "wavefront") for c in (32, 8)}
    for row in result["results"]:
        median = row["median"]
        assert median["prompt_tokens"] == 176 and median["prompt_tokens_per_s"] > 0
        assert median["num_prompt_core_calls"] > 0 and len(row["runs"]) == 1
        assert row["first_tokens_agree"], "arms must emit the same first tokens"
    small = {arm: cells[arm, 8]["median"] for arm in ("atomic", "wavefront")}
    wave, atomic = (small[a]["mean_rows_per_prompt_core_call"] for a in ("wavefront", "atomic"))
    assert wave >= atomic
    # Atomic runs one chunk per prompt per call: 2 prompts x 8 rows at most.
    assert atomic <= 16 < wave
    assert set(result["ratios"]) == {"32", "8"}
    assert tmp_path.joinpath("wcpb.png").stat().st_size > 0


def test_interference_runs_from_the_cli_and_counts_mixed_calls(tmp_path) -> None:
    out = tmp_path / "interference.json"
    argv = ["bench", "interference", *TINY_MODEL, *INTERFERENCE, "--out", str(out)]
    assert cli_main(argv) == 0
    result = json.loads(out.read_text())
    assert list(result["arms"]) == ["atomic", "per_depth", "mixed"]
    for arm, data in result["arms"].items():
        median = data["median"]
        assert 0 < median["itl_p50_ms"] <= median["itl_p99_ms"] <= median["itl_max_ms"]
        assert median["ttft_mean_s"] > 0 and median["prompt_token_loops_per_s"] > 0
        assert median["decode_rows_per_core_call"] > 0 and median["prompt_rows_per_core_call"] > 0
        assert (median["num_mixed_core_calls"] > 0) == (arm == "mixed"), arm
    assert tmp_path.joinpath("interference.png").stat().st_size > 0


def test_call_recorder_counts_each_depth_of_an_atomic_chunk(tmp_path) -> None:
    args = _parse(prompt_sched, TINY_MODEL + ["--max-num-batched-tokens", "16"])
    model_dir = prompt_sched.model_dir_for(args, str(tmp_path), 64)
    engine = build_engine(args, model_dir, "atomic", chunk_size=16, num_blocks=64, max_num_seqs=1)
    recorder = CallRecorder(engine)
    engine.add_request("p", list(range(40)), SamplingParams(max_tokens=1, exit_trace=(4,)))
    while engine.has_unfinished_requests():
        engine.step()
    summary = recorder.summary()
    assert recorder.num_steps == 3  # chunks of 16, 16, 8, each one step of D=4 calls
    assert summary.num_core_calls == summary.num_prompt_core_calls == 12
    assert summary.prompt_rows_per_prompt_core_call == pytest.approx(40 / 3)
    assert summary.num_mixed_core_calls == 0 and summary.decode_rows_per_core_call == 0


def test_mixed_arm_without_mixed_calls_is_rejected(tmp_path) -> None:
    args = _parse(prompt_interference, TINY_MODEL + INTERFERENCE)
    model_dir = prompt_sched.model_dir_for(args, str(tmp_path), 256)
    work = prompt_interference.make_workload(args, 256, 4)
    # An atomic engine reported as the mixed arm: the check must notice no call mixed kinds.
    engine = build_engine(args, model_dir, "atomic", chunk_size=8, num_blocks=256, max_num_seqs=5)
    with pytest.raises(InvalidRunError, match="no core call mixing"):
        prompt_interference.run_arm(engine, work, "mixed")


def test_population_that_ends_before_the_prompts_is_an_error(tmp_path) -> None:
    argv = INTERFERENCE + ["--decode-max-tokens", "4", "--arms", "atomic"]
    args = _parse(prompt_interference, TINY_MODEL + argv + ["--out", str(tmp_path / "x.json")])
    with pytest.raises(ConfigError, match="raise --decode-max-tokens"):
        prompt_interference.main_from_args(args)


def test_list_arguments_are_validated() -> None:
    with pytest.raises(SystemExit):
        _parse(prompt_sched, ["--arms", "atomic,bogus"])
    with pytest.raises(SystemExit):
        _parse(prompt_sched, ["--chunk-sizes", "16,x"])
    with pytest.raises(ConfigError, match="distinct"):
        prompt_sched.main_from_args(_parse(prompt_sched, ["--chunk-sizes", "16,16"]))


@pytest.mark.parametrize("bench", ["wcpb", "interference"])
def test_the_prompt_benchmarks_name_themselves_when_given_another_family(tmp_path, capsys, bench):
    """They replay Ouro exit traces: a Huginn checkpoint is a one-line usage error naming the
    benchmark (it said "loopserve supports ('ouro',)", which is not so)."""
    from loopserve.cli.main import main
    from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint

    model_dir = make_tiny_huginn_checkpoint(tmp_path / "huginn", mean_recurrence=2)
    assert main(["bench", bench, "--model", str(model_dir), "--no-progress"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and f"bench {bench} runs Ouro checkpoints only" in error
    assert "huginn_raven" in error and "loopserve supports" not in error
