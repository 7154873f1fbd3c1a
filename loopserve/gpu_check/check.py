"""The GPU check: one command that tests and measures the GPU path and calibrates the simulator.

    scripts/gpu_check.sh --part tests   # pytest -m gpu (<= 4.5 min on one H200)
    scripts/gpu_check.sh --part perf    # measurements + calibration (<= 4.5 min)
    scripts/gpu_check.sh --dry-run      # every step on CPU with a tiny model (seconds)

Steps, each isolated (a failing step is recorded with its traceback and the next one runs):
(tests) `pytest -m gpu tests/test_gpu.py tests/test_gpu_graphs.py` in a subprocess with a
timeout (Triton vs torch on CUDA, engine batch invariance on CUDA, captured graphs vs eager,
async vs sync); (perf) an Ouro-1.4B-shaped checkpoint with random weights written from GPU
memory (no download); decode time per loop at 1..256 rows, eager and through the CUDA-graph
path (its eager emulation in a dry run), prefill tokens/s at chunk 512 and 2048, output tok/s
of full_depth / no_refill / refill on a synthetic workload whose exit depths follow the
Ouro-1.4B threshold-0.5 distribution (exit_mode=trace), and one full-depth stream; beside each
number what the simulator's cost model predicts for the detected device profile (a second or
two per arm on the host CPU).

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
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from loopserve.engine.llm_engine import LLMEngine
from loopserve.gpu_check.record import CheckRecord, Tee
from loopserve.models.config import OuroConfig
from loopserve.models.loader import save_model
from loopserve.models.ouro import OuroForLoopedLM
from loopserve.runner.attention.base import RowSegment
from loopserve.sampling_params import SamplingParams
from loopserve.sim.calibration import FORMAT, TimingPoint, calibration_record, fit_profile
from loopserve.sim.cost_model import OURO_1P4B, CostModel, ModelShape
from loopserve.sim.hardware import get_device_profile
from loopserve.sim.simulator import simulate
from loopserve.sim.workload import SimRequest, WorkloadSpec, build_workload

REPO_ROOT = Path(__file__).resolve().parents[2]
GPU_TEST_FILES = ("test_gpu.py", "test_gpu_graphs.py")
TINY = replace(
    OURO_1P4B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
)


@dataclass(frozen=True)
class Plan:
    """What to measure; `full()` on a GPU, `dry()` on CPU."""

    config: OuroConfig
    device: str
    dtype: str
    decode_rows: tuple[int, ...]
    decode_context: int
    prefill_chunks: tuple[int, ...]
    num_requests: int
    input_len: int
    output_len: int
    max_num_seqs: int
    stream_tokens: int
    iters: int

    @classmethod
    def full(cls) -> Plan:
        # Sized so the perf part fits its 4.5-minute budget on one H200 (docs/gpu.md).
        return cls(OURO_1P4B, "cuda", "bfloat16", (1, 8, 32, 64, 128, 256), 512, (512, 2048),
                   num_requests=128, input_len=256, output_len=128, max_num_seqs=64,
                   stream_tokens=128, iters=10)  # fmt: skip

    @classmethod
    def dry(cls) -> Plan:
        return cls(TINY, "cpu", "float32", (1, 8), 24, (16, 48), num_requests=4, input_len=12,
                   output_len=4, max_num_seqs=4, stream_tokens=4, iters=1)  # fmt: skip


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


def write_checkpoint(config: OuroConfig, plan: Plan, directory: Path, seed: int = 0) -> Path:
    """Random weights made in device memory (scaled like a trained model's), saved as a
    checkpoint the engine loads like any other."""
    dtype = getattr(torch, plan.dtype)
    generator = torch.Generator(device=plan.device).manual_seed(seed)
    with torch.device(plan.device):
        model = OuroForLoopedLM(config).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:  # norms, gate bias
                param.fill_(1.0 if "norm" in name else 0.0)
                continue
            noise = torch.randn(param.shape, generator=generator, device=plan.device)
            param.copy_(noise / param.shape[-1] ** 0.5)
    save_model(model, directory)
    del model
    return directory


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_call(fn, device: str, iters: int) -> float:
    fn()
    fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / iters


@torch.inference_mode()
def measure_core_calls(engine: LLMEngine, plan: Plan, cost: CostModel) -> list[TimingPoint]:
    """Decode loops (rows x one token at `decode_context`) and prompt chunks from position 0,
    each as one eager core call over the engine's own KV cache (the engine is idle)."""
    model, attention = engine.model, engine.runner.attention
    block_size = engine.config.cache.block_size
    num_blocks = engine.config.cache.num_blocks
    hidden_size, device = model.config.hidden_size, plan.device
    dtype = model.lm_head.weight.dtype
    points = []
    shapes = [("decode_loop", rows, plan.decode_context) for rows in plan.decode_rows]
    shapes += [("prefill_call", chunk, chunk) for chunk in plan.prefill_chunks]
    for kind, rows, context in shapes:
        per_item = -(-context // block_size)
        items = rows if kind == "decode_loop" else 1
        if items * per_item > num_blocks:
            print(f"skip {kind} rows={rows}: needs {items * per_item} KV blocks", flush=True)
            continue
        tables = [list(range(i * per_item, (i + 1) * per_item)) for i in range(items)]
        if kind == "decode_loop":
            segments = [RowSegment(t, context - 1, 1) for t in tables]
            positions = torch.full((rows,), context - 1, device=device)
            predicted = cost.core_call(
                rows=rows, kv_read_positions=rows * context, attention_pairs=rows * context
            )
        else:
            segments = [RowSegment(tables[0], 0, rows)]
            positions = torch.arange(rows, device=device)
            predicted = cost.core_call(
                rows=rows, kv_read_positions=rows, attention_pairs=rows * (rows + 1) // 2
            )
        hidden = torch.randn(rows, hidden_size, device=device).to(dtype)

        def core_call(hidden=hidden, positions=positions, segments=segments) -> None:
            model.core(hidden, positions, attention.prepare(segments))

        measured = time_call(core_call, device, plan.iters)
        point = TimingPoint(kind, rows, context, predicted.bytes_moved, predicted.flops,
                            measured, predicted.time_s)  # fmt: skip
        points.append(point)
        extra = ""
        if kind == "prefill_call":
            loops = model.num_loops
            mfu = predicted.flops / (measured * cost.device.peak_bf16_flops_per_s)
            extra = (f"  prefill {rows / (loops * measured):,.0f} tok/s "
                     f"(predicted {rows / (loops * predicted.time_s):,.0f}), "
                     f"{mfu:.0%} of dense bf16 peak")  # fmt: skip
        print(f"{kind:12s} rows={rows:5d} ctx={context:5d}  measured {measured * 1e3:8.3f} ms  "
              f"predicted {predicted.time_s * 1e3:8.3f} ms  ratio "
              f"{measured / predicted.time_s:5.2f}{extra}", flush=True)  # fmt: skip
    return points


@torch.inference_mode()
def measure_graph_decode(
    model_dir: Path, plan: Plan, base_args: dict, eager: dict[int, float]
) -> dict[int, float]:
    """Decode loops at the same rows and context as the eager points, through the runner's
    static, row-bucketed path: captured CUDA graphs on CUDA, their eager emulation in a dry run
    (which checks the plumbing, not the speed)."""
    mode = "auto" if plan.device.startswith("cuda") else "emulate"
    engine = LLMEngine.from_engine_args(
        model=str(model_dir), **base_args, max_num_seqs=max(plan.decode_rows), graph_mode=mode
    )
    graphs = engine.runner.graphs
    if graphs is None:
        print(f"no graph path: {engine.runner.graph_capture_error}", flush=True)
        return {}
    context, block_size = plan.decode_context, engine.config.cache.block_size
    per_item = -(-context // block_size)
    hidden_size = engine.model.config.hidden_size
    dtype = engine.model.lm_head.weight.dtype
    measured = {}
    for rows in plan.decode_rows:
        if rows * per_item > engine.config.cache.num_blocks or not graphs.fits(rows, context - 1):
            print(f"skip graphed decode rows={rows}", flush=True)
            continue
        tables = [list(range(i * per_item, (i + 1) * per_item)) for i in range(rows)]
        positions = [context - 1] * rows
        hidden = torch.randn(rows, hidden_size, device=plan.device).to(dtype)
        measured[rows] = time_call(
            lambda h=hidden, p=positions, t=tables: graphs.run(h, p, t), plan.device, plan.iters
        )
        ratio = f"  eager/graphs {eager[rows] / measured[rows]:5.2f}x" if rows in eager else ""
        print(f"{'graph_decode':12s} rows={rows:5d} ctx={context:5d}  measured "
              f"{measured[rows] * 1e3:8.3f} ms{ratio}", flush=True)  # fmt: skip
    if 1 in measured and 1 in eager:
        print(f"graphs vs eager at 1 row: {eager[1] / measured[1]:.2f}x (target >= 2x)", flush=True)
    del engine
    gc.collect()
    return measured


def run_workload(engine: LLMEngine, workload: list[SimRequest], seed: int) -> float:
    """Output tokens/s of the engine over the workload, every request arriving at t=0."""
    generator = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    for request in workload:
        prompt = torch.randint(3, vocab, (request.prompt_len,), generator=generator).tolist()
        params = SamplingParams(max_tokens=request.output_len, temperature=0.0,
                                ignore_eos=True, exit_trace=request.exit_trace)  # fmt: skip
        engine.add_request(request.request_id, prompt, params)
    synchronize(str(engine.config.device))
    start = time.perf_counter()
    num_tokens = 0
    while engine.has_unfinished_requests():
        num_tokens += sum(len(out.new_token_ids) for out in engine.step() if out.new_token_ids)
    return num_tokens / (time.perf_counter() - start)


def measure_throughput(model_dir: Path, plan: Plan, profile_name: str, base_args: dict) -> list:
    profile = get_device_profile(profile_name)
    arms = [
        ("full_depth", "refill", "full", plan.num_requests, plan.max_num_seqs, plan.output_len),
        ("no_refill", "no_refill", "ouro_1p4b_t0.5", plan.num_requests, plan.max_num_seqs,
         plan.output_len),
        ("refill", "refill", "ouro_1p4b_t0.5", plan.num_requests, plan.max_num_seqs,
         plan.output_len),
        ("single_stream_full_depth", "refill", "full", 1, 1, plan.stream_tokens),
    ]  # fmt: skip
    results = []
    for arm, mode, exit_dist, num_requests, max_num_seqs, output_len in arms:
        spec = WorkloadSpec(num_requests, dataset="synthetic", exit_dist=exit_dist, seed=0,
                            input_len=plan.input_len, output_len=output_len, range_ratio=0.5)  # fmt: skip
        workload = build_workload(spec, plan.config.total_ut_steps)
        args = dict(base_args, mode=mode, exit_mode="trace", max_num_seqs=max_num_seqs)
        engine = LLMEngine.from_engine_args(model=str(model_dir), **args)
        measured = run_workload(engine, workload, seed=1)
        del engine
        gc.collect()
        if plan.device.startswith("cuda"):
            torch.cuda.empty_cache()
        sim_args = {k: v for k, v in args.items() if k not in ("device", "dtype")}
        sim_args.pop("attention_backend", None)  # the cost model prices ideal kernels
        predicted = simulate(plan.config, profile, workload, sim_args).output_throughput
        results.append({"arm": arm, "measured_tok_s": measured, "predicted_tok_s": predicted})
        print(f"throughput {arm:26s} measured {measured:10,.1f} tok/s  predicted "
              f"{predicted:10,.1f} tok/s  ratio {measured / predicted:5.2f}", flush=True)  # fmt: skip
    by_arm = {r["arm"]: r for r in results}
    for key in ("measured_tok_s", "predicted_tok_s"):
        ratio = by_arm["refill"][key] / by_arm["full_depth"][key]
        print(f"refill / full_depth ({key.split('_')[0]}): {ratio:.2f}x", flush=True)
    return results


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


def run_perf(record: CheckRecord, plan: Plan, profile, profile_name: str) -> None:
    """The measurement steps; each one's results join the record as soon as it finishes,
    and the calibration (`fitted`, `points`) is rewritten after the core-call step."""
    shape = ModelShape.from_config(plan.config, dtype_bytes=2 if plan.dtype != "float32" else 4)
    cost = CostModel(shape, profile)
    base_args = dict(device=plan.device, dtype=plan.dtype, attention_backend="auto",
                     max_num_batched_tokens=2048, prefill_chunk_size=512)  # fmt: skip
    if plan.device == "cpu":
        base_args.update(max_num_batched_tokens=64, prefill_chunk_size=16, num_blocks=256)
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
        throughput = record.step("throughput", measure_throughput, model_dir, plan,
                                 profile_name, base_args)  # fmt: skip
        record.data["throughput"] = throughput or []
        record.write()
