"""The GPU check: one command that tests and measures the GPU path and calibrates the simulator.

    scripts/gpu_check.sh              # on a CUDA machine (<= 8 min on one H100/H200)
    scripts/gpu_check.sh --dry-run    # the same steps on CPU with a tiny model (seconds)

Steps: (1) `pytest -m gpu tests/test_gpu.py` in a subprocess (Triton vs torch on CUDA, engine
batch invariance on CUDA); (2) an Ouro-1.4B-shaped checkpoint with random weights written
from GPU memory (no download); (3) decode time per loop at 1..256 rows, prefill tokens/s at
chunk 512 and 2048, output tok/s of full_depth / no_refill / refill on a synthetic workload
whose exit depths follow the Ouro-1.4B threshold-0.5 distribution (exit_mode=trace), and one
full-depth stream; (4) beside each number what the simulator's cost model predicts for the
detected device profile; a JSON (`loopserve.sim.calibration` format) with the fitted
efficiencies and call overhead. Eager only for now: CUDA graphs will add a second column.
Needs only torch, numpy, safetensors, tokenizers (and triton on CUDA).
"""

from __future__ import annotations

import argparse
import gc
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
from loopserve.models.config import OuroConfig
from loopserve.models.loader import save_model
from loopserve.models.ouro import OuroForLoopedLM
from loopserve.runner.attention.base import RowSegment
from loopserve.sampling_params import SamplingParams
from loopserve.sim.calibration import TimingPoint, calibration_record, fit_profile
from loopserve.sim.cost_model import OURO_1P4B, CostModel, ModelShape
from loopserve.sim.hardware import get_device_profile
from loopserve.sim.simulator import simulate
from loopserve.sim.workload import SimRequest, WorkloadSpec, build_workload

REPO_ROOT = Path(__file__).resolve().parents[2]
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
        return cls(OURO_1P4B, "cuda", "bfloat16", (1, 8, 32, 64, 128, 256), 512, (512, 2048),
                   num_requests=256, input_len=256, output_len=256, max_num_seqs=128,
                   stream_tokens=256, iters=10)  # fmt: skip

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


def run_gpu_tests(dry_run: bool) -> dict:
    tests = REPO_ROOT / "tests" / "test_gpu.py"
    if not tests.exists():
        return {"ran": False, "reason": f"{tests} not found (run from the source tree)"}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", str(tests), "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    print("\n".join(lines[-15:] if proc.returncode else lines[-1:]), flush=True)
    # Exit code 5 = nothing collected/selected; on CPU every gpu test skips instead.
    return {"ran": True, "returncode": proc.returncode, "summary": lines[-1] if lines else ""}


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
    parser.add_argument("--out", default="gpu_check.json", help="calibration JSON to write")
    parser.add_argument("--skip-tests", action="store_true", help="skip the pytest step")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    plan = Plan.dry() if args.dry_run else Plan.full()
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device visible; use --dry-run on CPU")
    profile_name = args.device_profile or detect_profile(plan.device)
    profile = get_device_profile(profile_name)
    device_name = torch.cuda.get_device_name() if plan.device == "cuda" else "cpu (dry run)"
    print(f"== loopserve GPU check: {device_name}, profile {profile_name}, {plan.dtype}, "
          f"torch {torch.__version__}", flush=True)  # fmt: skip
    tests = {"ran": False, "reason": "--skip-tests"}
    if not args.skip_tests:
        print("== 1. pytest -m gpu", flush=True)
        tests = run_gpu_tests(args.dry_run)
    shape = ModelShape.from_config(plan.config, dtype_bytes=2 if plan.dtype != "float32" else 4)
    cost = CostModel(shape, profile)
    with tempfile.TemporaryDirectory() as workdir:
        print("== 2. random-weight checkpoint", flush=True)
        config = replace(plan.config, extra={**plan.config.extra, "torch_dtype": plan.dtype})
        model_dir = write_checkpoint(config, plan, Path(workdir) / "model")
        base_args = dict(device=plan.device, dtype=plan.dtype, attention_backend="auto",
                         max_num_batched_tokens=2048, prefill_chunk_size=512)  # fmt: skip
        if args.dry_run:
            base_args.update(max_num_batched_tokens=64, prefill_chunk_size=16, num_blocks=256)
        print("== 3. core calls (eager)", flush=True)
        engine = LLMEngine.from_engine_args(model=str(model_dir), **base_args, max_num_seqs=1)
        print(f"attention backend: {engine.runner.attention.name}", flush=True)
        points = measure_core_calls(engine, plan, cost)
        decode = {p.rows: p.measured_s for p in points if p.kind == "decode_loop"}
        if 1 in decode and 64 in decode:
            print(f"decode loop 64 rows / 1 row: {decode[64] / decode[1]:.2f}x "
                  f"(target <= 1.3x)", flush=True)  # fmt: skip
        del engine
        gc.collect()
        print("== 4. throughput (eager)", flush=True)
        throughput = measure_throughput(model_dir, plan, profile_name, base_args)
    fitted = fit_profile(profile, points)
    record = calibration_record(
        profile, fitted, points, device_name=device_name, dtype=plan.dtype,
        dry_run=args.dry_run, torch_version=torch.__version__, tests=tests,
        throughput=throughput, graphs=False, wall_s=time.perf_counter() - start,
    )  # fmt: skip
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"== fitted: {json.dumps(record['fitted'])}", flush=True)
    print(f"wrote {args.out} in {record['wall_s']:.0f} s", flush=True)
    ok = not tests.get("ran") or tests.get("returncode") == 0
    return 0 if ok else 1
