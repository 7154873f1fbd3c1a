"""Device measurements of the GPU check (`check.py` runs them): what to measure (`Plan`), a
random Ouro-shaped checkpoint written from device memory, decode time per loop eager and
through the graph path, prefill tokens/s, and output tokens/s of the decode arms beside the
simulator's prediction for the same work. Each function synchronizes around what it times.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from loopserve.contracts import DecodeRows
from loopserve.engine.llm_engine import LLMEngine
from loopserve.models.config import OuroConfig
from loopserve.models.loader import save_model
from loopserve.models.ouro import OuroForLoopedLM
from loopserve.runner.attention.base import RowSegment
from loopserve.sampling_params import SamplingParams
from loopserve.sim.calibration import TimingPoint
from loopserve.sim.cost_model import OURO_1P4B, CostModel
from loopserve.sim.hardware import get_device_profile
from loopserve.sim.simulator import simulate
from loopserve.sim.workload import SimRequest, WorkloadSpec, build_workload

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
    runner = engine.runner
    num_planes = runner.rules.num_planes
    measured = {}
    for rows in plan.decode_rows:
        if rows * per_item > engine.config.cache.num_blocks or not graphs.fits(rows, context - 1):
            print(f"skip graphed decode rows={rows}", flush=True)
            continue
        # `rows` tokens at loop 0, every plane on the request's own blocks; the inputs are
        # staged once, so each timed call is one graphed decode step (replay).
        ids = tuple(f"g{i}" for i in range(rows))
        tables = {
            rid: tuple(list(range(i * per_item, (i + 1) * per_item)) for _ in range(num_planes))
            for i, rid in enumerate(ids)
        }
        decode_rows = DecodeRows.continuing(ids, [context - 1] * rows, [0] * rows, [1] * rows)
        host = runner.decode.host_columns(decode_rows, tables)
        bucket = graphs.stage(decode_rows, host)

        def graphed_call(bucket=bucket, decode_rows=decode_rows, host=host):
            return graphs.launch(bucket, decode_rows, host).out

        measured[rows] = time_call(graphed_call, plan.device, plan.iters)
        for rid in ids:
            runner.decode_slots.release(rid)
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


def measure_host_work(plan: Plan, directory: Path) -> dict:
    """`loopserve bench host` on this machine's CPU (its GPU's host): host us per decode call
    and host / predicted H200 device time, as measured (the emulated step's arithmetic on the
    CPU too) and with the device work replayed (`--replay-device-work`: the CPU runs only the
    host path, as this host's does when its GPU runs the step). Each in a subprocess: the
    benchmark runs the Triton backend's host path under Triton's interpreter, which must not
    reach this process's CUDA kernels. {"measured"|"replayed": {rows: {host_us, ratio}}}."""
    cuda = plan.device.startswith("cuda")
    rows, steps, context = ("32,128,256", "400", "256") if cuda else ("4", "12", "24")
    results = {}
    for name, extra in (("measured", []), ("replayed", ["--replay-device-work"])):
        path = directory / f"host_{name}.json"
        command = [sys.executable, "-m", "loopserve.cli.main", "bench", "host", "--rows", rows,
                   "--steps", steps, "--context", context, "--segments", "3",
                   "--output-json", str(path), *extra]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, timeout=240)
        if proc.returncode != 0:
            raise RuntimeError(f"bench host {name} failed: {proc.stderr[-2000:]}")
        points = json.loads(path.read_text())["points"]
        results[name] = {p["rows"]: {"host_us": p["host_us"], "ratio": p["ratio"]} for p in points}
        for p in points:
            print(f"host work ({name}) rows={p['rows']:4d}: {p['host_us']:7.0f} us per call, "
                  f"{p['ratio']:.2f}x the H200 device time", flush=True)  # fmt: skip
    return results


def measure_handoff_landing(model_dir: Path, plan: Plan, base_args: dict) -> dict:
    """What landing a hand-off saves the decode rows of the replica that imports it
    (docs/deployment.md, "Landing"). An engine decodes `plan.max_num_seqs // 2` requests; a
    request with a long prompt (`plan.prefill_chunks[-1]` tokens) runs beside them until it
    can leave, is exported to host memory (as a transport delivers it) and imported back
    into the same engine: "unlanded", as a plain tensor the admitting step copies; "landed",
    after `LLMEngine.land_kv` in a worker thread while the decode steps go on. Per arm, in
    ms (synchronized around each step): the steady steps' median before it, the steps run
    while it landed (their median and count), and the step that admitted it; and the K/V's
    bytes. On CUDA each step is timed on its own stream, so a landing copy on the side stream
    is waited for only where a step waits for it."""
    import threading
    from statistics import median

    device = plan.device
    decode_rows = max(1, plan.max_num_seqs // 2)
    engine = LLMEngine.from_engine_args(
        model=str(model_dir), **base_args, max_num_seqs=decode_rows + 1
    )
    vocab = engine.model.config.vocab_size
    generator = torch.Generator().manual_seed(3)

    def prompt(length: int) -> list[int]:
        return torch.randint(3, vocab, (length,), generator=generator).tolist()

    # Enough tokens for the decode rows to run through both arms (a token per loops_per_token
    # steps; the prompts' chunks, the steady steps and the landing take a few hundred).
    endless = SamplingParams(max_tokens=plan.output_len * 8, temperature=0.0, ignore_eos=True)
    for i in range(decode_rows):
        engine.add_request(f"decode-{i}", prompt(plan.input_len), endless)
    handed_off = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def wait() -> None:  # the steps' stream only: a landing copy on its own stream goes on
        if device.startswith("cuda"):
            torch.cuda.current_stream().synchronize()

    def timed_step() -> float:
        wait()
        start = time.perf_counter()
        engine.step()
        wait()
        return (time.perf_counter() - start) * 1e3

    results: dict = {}
    for arm in ("unlanded", "landed"):
        request_id = f"handoff-{arm}"
        engine.add_request(request_id, prompt(plan.prefill_chunks[-1]), handed_off)
        while not engine.can_export(request_id):
            engine.step()
        state = engine.export_request(request_id)
        steady = [timed_step() for _ in range(plan.iters)]
        during: list[float] = []
        item = state
        if arm == "landed":
            landed: list = []
            worker = threading.Thread(target=_land_into, args=(engine, state.kv, landed))
            worker.start()
            while worker.is_alive():
                during.append(timed_step())
            worker.join()
            item = replace(state, kv=landed[0])
        engine.import_request(item)
        admit = timed_step()
        while engine.has_unfinished_requests() and request_id not in {
            r.request_id for r in engine.scheduler.running
        }:  # not admitted in that step (no room yet): time the one that admits it
            admit = timed_step()
        engine.abort_request(request_id)
        engine.step()
        kv_bytes = state.kv.numel() * state.kv.element_size()  # type: ignore[attr-defined]
        results[arm] = {"steady_ms": median(steady), "admit_ms": admit,
                        "during_landing_ms": median(during) if during else None,
                        "steps_during_landing": len(during), "kv_bytes": kv_bytes}  # fmt: skip
        print(f"hand-off {arm:8s} ({kv_bytes / 1e6:,.1f} MB): admitting step {admit:8.2f} ms, "
              f"steady {median(steady):7.2f} ms, {len(during)} steps while landing",
              flush=True)  # fmt: skip
    return results


def _land_into(engine: LLMEngine, kv: torch.Tensor, out: list) -> None:
    out.append(engine.land_kv(kv))
