"""The GPU check: one command that tests and measures the GPU path and calibrates the simulator.

    scripts/gpu_check.sh --part tests   # pytest -m gpu (<= 4.5 min on one H200)
    scripts/gpu_check.sh --part perf    # measurements + calibration (<= 4.5 min)
    scripts/gpu_check.sh --dry-run      # every step on CPU with a tiny model (seconds)

Steps, each isolated (a failing step is recorded with its traceback and the next one runs):
(tests) `pytest -m gpu tests/test_gpu.py tests/test_gpu_graphs.py` in a subprocess with a
timeout (Triton vs torch on CUDA, engine batch invariance on CUDA, captured graphs vs eager,
async vs sync); (perf) kernels per layer of both families (`bench kernels`' split), an
Ouro-1.4B-shaped checkpoint with random weights written from GPU
memory (no download); decode time per loop at 1..256 rows, eager and through the CUDA-graph
path (its eager emulation in a dry run), prefill tokens/s at chunk 512 and 2048, output tok/s
of full_depth / no_refill / refill on a synthetic workload whose exit depths follow the
Ouro-1.4B threshold-0.5 distribution (exit_mode=trace), and one full-depth stream; beside each
number what the simulator's cost model predicts for the detected device profile (a second or
two per arm on the host CPU); the step that admits a handed-off request beside the decode
steps around it, its K/V imported as a plain host tensor and landed first (`measure.
measure_handoff_landing`); last, `loopserve bench host` on the machine's own CPU (host us
per decode call at 32..256 rows, measured and with the device work replayed).

Output: `--out FILE` (JSON, `loopserve.sim.calibration` format plus a `steps` list) is
rewritten after every step, so a run cut short keeps what finished; the console output goes
to FILE with `.log`, the pytest log to `.pytest.log`, beside it. Needs only torch, numpy,
safetensors, tokenizers (and triton on CUDA; pytest for the tests part).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from loopserve.engine.llm_engine import LLMEngine
from loopserve.gpu_check.measure import (
    Plan,
    measure_core_calls,
    measure_graph_decode,
    measure_handoff_landing,
    measure_host_work,
    measure_throughput,
    write_checkpoint,
)
from loopserve.gpu_check.record import CheckRecord, Tee
from loopserve.sim.calibration import FORMAT, TimingPoint, calibration_record, fit_profile
from loopserve.sim.cost_model import CostModel, ModelShape
from loopserve.sim.hardware import get_device_profile

REPO_ROOT = Path(__file__).resolve().parents[2]
GPU_TEST_FILES = ("test_gpu.py", "test_gpu_graphs.py")


def detect_profile(device: str) -> str:
    if not device.startswith("cuda"):
        return "h200"  # dry run: predictions for the GPU the check targets
    name = torch.cuda.get_device_name().upper()
    for key in ("H200", "H100", "A100", "B200"):
        if key in name:
            return key.lower()
    print(f"warning: no profile for {name!r}; predicting with h100", flush=True)
    return "h100"


PYTEST_TIMEOUT_S = 240  # the tests part's budget on one H200 (docs/gpu.md)


def run_gpu_tests(dry_run: bool, log_path: Path | None = None) -> dict:
    """`pytest -m gpu` on the GPU test files in a subprocess, with a timeout; its whole log
    goes to `log_path`, its stdout and stderr tails to the record and the console."""
    files = [REPO_ROOT / "tests" / name for name in GPU_TEST_FILES]
    missing = [str(path) for path in files if not path.exists()]
    if missing:
        return {
            "ran": False,
            "reason": f"{', '.join(missing)} not found (run from the source tree)",
        }
    if importlib.util.find_spec("pytest") is None:
        return {"ran": False, "reason": f"pytest is not importable by {sys.executable}"}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", *map(str, files), "-q", "-rs",
           "-p", "no:cacheprovider"]  # fmt: skip
    timeout_s = 120 if dry_run else PYTEST_TIMEOUT_S
    try:
        proc = subprocess.run(
            cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
        )
        stdout, stderr, returncode = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        stdout = err.stdout.decode() if isinstance(err.stdout, bytes) else err.stdout or ""
        stderr = err.stderr.decode() if isinstance(err.stderr, bytes) else err.stderr or ""
        returncode = None
    if log_path is not None:
        log_path.write_text(f"$ {' '.join(cmd)}\n{stdout}\n--- stderr ---\n{stderr}")
    lines = stdout.strip().splitlines()
    print("\n".join(lines[-15:] if returncode else lines[-1:]), flush=True)
    if stderr.strip() and returncode:
        print("stderr:\n" + "\n".join(stderr.strip().splitlines()[-15:]), flush=True)
    # Exit code 5 = nothing collected/selected; on CPU every gpu test skips instead.
    return {
        "ran": True,
        "returncode": returncode,
        "timed_out": returncode is None,
        "summary": lines[-1] if lines else "",
        "stderr_tail": "\n".join(stderr.strip().splitlines()[-15:]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="loopserve GPU check (see docs/gpu.md)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, same steps")
    parser.add_argument("--device-profile", default=None, help="default: detected")
    parser.add_argument("--out", default="gpu_check.json", help="the JSON record to write")
    parser.add_argument("--part", choices=("tests", "perf", "all"), default="all",
                        help="tests: pytest -m gpu; perf: measurements and calibration "
                        "(each part <= 4.5 min on one H200, docs/gpu.md)")  # fmt: skip
    parser.add_argument("--skip-tests", action="store_true", help="same as --part perf")
    args = parser.parse_args(argv)
    part = "perf" if args.skip_tests else args.part
    start = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout = Tee(sys.stdout, out.with_suffix(".log"))
    plan = Plan.dry() if args.dry_run else Plan.full()
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device visible; use --dry-run on CPU")
    profile_name = args.device_profile or detect_profile(plan.device)
    profile = get_device_profile(profile_name)
    device_name = torch.cuda.get_device_name() if plan.device == "cuda" else "cpu (dry run)"
    print(f"== loopserve GPU check: {device_name}, profile {profile_name}, {plan.dtype}, "
          f"torch {torch.__version__}, part {part}", flush=True)  # fmt: skip
    record = CheckRecord(out, {
        "format": FORMAT, "device_profile": profile_name, "device_name": device_name,
        "dtype": plan.dtype, "dry_run": args.dry_run, "torch_version": torch.__version__,
        "part": part, "tests": {"ran": False, "reason": f"--part {part}"},
    })  # fmt: skip
    if part in ("tests", "all"):
        tests = record.step("pytest -m gpu", run_gpu_tests, args.dry_run,
                            out.with_suffix(".pytest.log"))  # fmt: skip
        record.data["tests"] = tests or {"ran": False, "reason": "the step failed"}
        record.write()
    if part in ("perf", "all"):
        run_perf(record, plan, profile, profile_name)
    record.data["wall_s"] = time.perf_counter() - start
    record.write()
    print(f"wrote {out} in {record.data['wall_s']:.0f} s", flush=True)
    tests = record.data["tests"]
    failed = [s["name"] for s in record.data["steps"] if s["status"] == "failed"]
    ok = (not tests.get("ran") or tests.get("returncode") == 0) and not failed
    return 0 if ok else 1


def count_kernels_per_layer() -> dict:
    """`loopserve bench kernels`' split for both families, default and with fused linears,
    recorded beside the timings they explain. The count is made by dispatch on the host and
    is the same on every machine, so this reads the simulator's record of it
    (`KERNEL_COUNTS`, `FUSED_LINEAR_KERNEL_COUNTS`), which tests/test_kernel_count.py holds
    equal to the counter, instead of spending the GPU machine's minutes recounting."""
    from loopserve.sim.cost_model import FUSED_LINEAR_KERNEL_COUNTS, KERNEL_COUNTS

    counts = {}
    for family in ("ouro", "huginn"):
        (per_layer, per_loop), fused = KERNEL_COUNTS[family], FUSED_LINEAR_KERNEL_COUNTS[family]
        counts[family] = {"per_layer": per_layer, "per_loop": per_loop,
                          "fused_linears": {"per_layer": fused[0], "per_loop": fused[1]}}  # fmt: skip
        print(f"{family}: {per_layer:g} kernels per layer + {per_loop:g} per loop; "
              f"--fused-linears {fused[0]:g} + {fused[1]:g}", flush=True)  # fmt: skip
    return counts


def run_perf(record: CheckRecord, plan: Plan, profile, profile_name: str) -> None:
    """The measurement steps; each one's results join the record as soon as it finishes,
    and the calibration (`fitted`, `points`) is rewritten after the core-call step."""
    shape = ModelShape.from_config(plan.config, dtype_bytes=2 if plan.dtype != "float32" else 4)
    cost = CostModel(shape, profile)
    base_args = dict(device=plan.device, dtype=plan.dtype, attention_backend="auto",
                     max_num_batched_tokens=2048, prefill_chunk_size=512)  # fmt: skip
    if plan.device == "cpu":
        base_args.update(max_num_batched_tokens=64, prefill_chunk_size=16, num_blocks=256)
    record.data["kernels"] = record.step("kernels per layer", count_kernels_per_layer) or {}
    record.write()
    with tempfile.TemporaryDirectory() as workdir:
        config = replace(plan.config, extra={**plan.config.extra, "torch_dtype": plan.dtype})
        model_dir = record.step("random-weight checkpoint", write_checkpoint, config, plan,
                                Path(workdir) / "model")  # fmt: skip
        if model_dir is None:
            for name in ("core calls", "graphed decode", "throughput"):
                record.skip(name, "no checkpoint")
            return

        def core_calls() -> list[TimingPoint]:
            engine = LLMEngine.from_engine_args(model=str(model_dir), **base_args, max_num_seqs=1)
            print(f"attention backend: {engine.runner.attention.name}", flush=True)
            points = measure_core_calls(engine, plan, cost)
            decode = {p.rows: p.measured_s for p in points if p.kind == "decode_loop"}
            if 1 in decode and 64 in decode:
                print(f"decode loop 64 rows / 1 row: {decode[64] / decode[1]:.2f}x "
                      "(target <= 1.3x)", flush=True)  # fmt: skip
            del engine
            gc.collect()
            return points

        points = record.step("core calls", core_calls) or []
        if points:
            fitted = fit_profile(profile, points)
            record.data.update(calibration_record(profile, fitted, points))
            record.data.update(device_profile=profile_name)
            print(f"== fitted: {json.dumps(record.data['fitted'])}", flush=True)
            record.write()
        eager = {p.rows: p.measured_s for p in points if p.kind == "decode_loop"}
        graph_decode = record.step("graphed decode", measure_graph_decode, model_dir, plan,
                                   base_args, eager)  # fmt: skip
        record.data["graph_decode_s"] = graph_decode or {}
        record.write()
        if plan.device.startswith("cuda"):  # the fused GEMMs run on CUDA only
            from loopserve.sim.cost_model import FUSED_LINEAR_MAX_ROWS as MAX_ROWS  # no Triton

            narrow = replace(plan, decode_rows=tuple(r for r in plan.decode_rows if r <= MAX_ROWS))
            fused = record.step("graphed decode, fused linears", measure_graph_decode, model_dir,
                                narrow, {**base_args, "fused_linears": True}, eager)  # fmt: skip
            record.data["graph_decode_fused_linears_s"] = fused or {}
            for rows, seconds in sorted((fused or {}).items()):
                if rows in (graph_decode or {}):
                    print(f"fused linears / cuBLAS GEMMs at {rows} rows: "
                          f"{seconds / graph_decode[rows]:.2f}x (< 1: the fused path is faster)",
                          flush=True)  # fmt: skip
            record.write()
        else:
            record.skip("graphed decode, fused linears", "the fused GEMMs run on CUDA only")
        throughput = record.step("throughput", measure_throughput, model_dir, plan,
                                 profile_name, base_args)  # fmt: skip
        record.data["throughput"] = throughput or []
        record.write()
        landing = record.step("hand-off landing", measure_handoff_landing, model_dir, plan,
                              base_args)  # fmt: skip
        record.data["handoff_landing"] = landing or {}
        record.write()
        # Last: the host CPU's work per decode call (no GPU time; a cut run loses only this).
        host = record.step("host work per call", measure_host_work, plan, Path(workdir))
        record.data["host_work"] = host or {}
        record.write()
