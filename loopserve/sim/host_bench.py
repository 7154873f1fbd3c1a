"""`loopserve bench host`: host microseconds per core call, beside the device time they must hide.

It lives beside the simulator because it sets real host time against the cost model's device
time (and its output fits `sim.host_model.HostModel`); its flags are in `sim.args`.

A looped model pays every per-call host cost once per loop (four times per token for Ouro),
so host work per core call has to stay well under the device time of that call, or the GPU
idles. By default it measures the configuration a GPU runs: the Triton attention backend and
the CUDA graphs' static buffers (`graph_mode=emulate` is their eager stand-in on CPU). This benchmark takes the model's device work out (the core is replaced by the
identity, `null_core`: no layers, no attention kernels; the prelude, gate, coda and sampler
of a tiny model stay, their cost is small and reported apart) and runs steady decode steps
of exactly `rows` rows: every request is in decode, exits follow a fixed trace, so each step
is one core call of `rows` rows. Per call it reports, from the engine's own counters:

- schedule: `Scheduler.schedule` (row selection, items, block growth);
- runner: the runner's `execute` minus time inside model calls (input preparation, the
  attention metadata, exit decisions, finalize bookkeeping, sampling bookkeeping);
- model: time inside the (trivial) prelude / gate / coda calls;
- apply: `Scheduler.update` and the engine core's bookkeeping;
- output: the engine's output processing (detokenize, `RequestOutput`), for "delta" outputs
  (what the server's streams ask for; a stream's per-step work does not grow with it).

As `loopserve serve` does once its engine has loaded, the process's start-up heap is frozen
after the warm-up (`engine/gc_heap.py`; `--no-freeze-heap` leaves it to the collector), and
the process's pause for one full garbage collection is reported both ways: frozen (what a
server pays) and with the heap given back (what it paid before).

`--replay-device-work` runs the emulated step once per bucket and form and reuses its outputs
(trace exits only): the CPU then runs only the host path, whose caches the step's tensor work
would otherwise evict between its pieces, as on a GPU host where the device runs that work.

Beside it: the simulator's predicted device time of the same call for Ouro-1.4B in bf16 on
an H200 (`--device-profile`), rows at `--context` positions, and host / device. The target
is host <= 0.3x device at 32..256 rows. Numbers are of this machine's CPU; docs/benchmarks.md
has the table and where the time goes.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from loopserve.engine.gc_heap import freeze_startup_heap
from loopserve.engine.llm_engine import LLMEngine
from loopserve.errors import ConfigError
from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopserve.models.tiny import make_tiny_checkpoint
from loopserve.sampling_params import SamplingParams
from loopserve.sim.cost_model import OURO_1P4B, CostModel, ModelShape
from loopserve.sim.hardware import get_device_profile

TARGET_RATIO = 0.3
# Loops used per token, cycled per request: roughly Ouro-1.4B's threshold-0.5 mix (mean 3).
EXIT_TRACE = (3, 3, 2, 3, 4, 3, 3, 3)


def null_core(engine: LLMEngine) -> None:
    """Replace the model's loop by the identity and the finalize copy by nothing: calls keep
    their host path (items, inputs, attention metadata, exits, finalize slots, sampling) and
    lose their device work."""
    identity = lambda hidden, positions, attn: hidden  # noqa: E731
    engine.model.loop = identity  # type: ignore[method-assign]
    model = engine.model
    if model.config.extra_kv_planes:
        # Its enter and leave run attention layers over the once planes: keep their host
        # path (the runner prepares the once planes' attention) and drop their device work.
        width, vocab = model.state_width, model.config.vocab_size
        param = model.lm_head.weight

        def enter(token_ids, positions=None, once=(), initial=None):
            return torch.zeros(len(token_ids), width, dtype=param.dtype, device=param.device)

        def leave(carried, positions=None, once=()):
            return torch.zeros(len(carried), vocab, device=param.device)

        model.enter, model.leave = enter, leave  # type: ignore[method-assign]
        graphs = engine.runner.graphs
        if graphs is not None:
            graphs.enter, graphs.leave = enter, leave
    if engine.runner.graphs is not None:
        engine.runner.graphs.core = identity
    engine.runner.attention.finalize = lambda src, dst: None  # type: ignore[method-assign]


def replay_device_work_of(engine: LLMEngine) -> dict[tuple, int]:
    """From now on the engine's emulated decode step runs once per bucket and form and its
    outputs are reused: between the host path's pieces the CPU no longer runs the step's
    tensor work (the model's arithmetic, which a GPU runs), so it keeps its caches as a GPU
    host's would. The host path is unchanged: the same staging, launch, coda and reads.
    Valid where the host knows the exits (trace exits): stale signals decide nothing.
    Returns the step's runs per (bucket, form) from now on."""
    graphs = engine.runner.graphs
    assert graphs is not None, "the replayed step is the decode graphs' (graph_mode emulate)"
    forward, outputs, runs = graphs._forward, {}, {}

    def replayed(bucket: int, *form):
        key = (bucket, *form)
        if key not in outputs:
            runs[key] = runs.get(key, 0) + 1
            outputs[key] = forward(bucket, *form)
        return outputs[key]

    graphs._forward = replayed  # type: ignore[method-assign]
    return runs


@dataclass(frozen=True)
class HostPoint:
    rows: int
    num_calls: int
    schedule_us: float
    runner_us: float
    model_us: float
    apply_us: float
    output_us: float
    device_us: float  # predicted device time of the call (the profile's GPU)
    # With `segments` > 1: every segment's host us per call (this point is their median's).
    segment_host_us: tuple[float, ...] = ()
    # Full garbage collections the collector ran during the calls (of every segment).
    num_full_collections: int = 0
    # One full garbage collection of the process after the calls: the start-up heap frozen
    # (None: it was not), and given back to the collector; how many objects were frozen.
    gc_frozen_ms: float | None = None
    gc_full_ms: float = 0.0
    num_frozen: int = 0

    @property
    def host_us(self) -> float:
        """Host work per call: everything but the (trivial) model calls."""
        return self.schedule_us + self.runner_us + self.apply_us + self.output_us

    @property
    def ratio(self) -> float:
        return self.host_us / self.device_us


def measure(rows: int, *, context: int, steps: int, device_profile: str, block_size: int = 16,
            engine_args: dict | None = None, family: str = "ouro",
            exit: str = "trace", temperature: float = 0.0,
            top_p: float = 1.0, segments: int = 1, freeze_heap: bool = True,
            replay_device_work: bool = False) -> HostPoint:  # fmt: skip
    """Steady decode calls of `rows` rows at about `context` positions. `family` "huginn":
    Huginn-shaped calls (a tiny Huginn: rows carry [state, e], loop-0 rows run the prelude
    over the once plane, the engine's criterion (kl) is checked at every loop from the
    first, with a threshold it never crosses, and request i runs `EXIT_TRACE[i]` loops per
    token as its `max_loops`, the same mix of loops as Ouro's trace). `temperature` > 0:
    every request samples (request i seeded with i, with `top_p`) instead of taking the
    argmax. `exit` "signal" gives
    Ouro-shaped calls the same regime: the gate read at every loop (`ouro`, a threshold the
    CDF never reaches) and the trace's loop count as each request's `max_loops`.
    `segments` > 1: the `steps` calls are measured in that many runs of consecutive calls
    and the point is the run with the median host time (`segment_host_us` has every run's):
    on a shared VM a burst of other work spoils a few runs, not the median. `freeze_heap`:
    the heap is frozen after the warm-up, as a server's is (given back afterwards).
    `replay_device_work`: the emulated step runs once per bucket and form and its outputs
    are reused (`replay_device_work_of`), so the CPU runs only the host path, as a GPU
    host's does; for Ouro-shaped calls with trace exits (the host knows their exits)."""
    if not 1 <= segments <= steps:
        raise ConfigError(f"--segments must be between 1 and --steps ({steps}), got {segments}")
    huginn = family == "huginn"
    signal = huginn or exit == "signal"
    if replay_device_work and signal:
        raise ConfigError(
            "--replay-device-work needs calls whose exits the host knows (--family ouro "
            "--exit trace): replayed outputs would decide signal exits"
        )
    with tempfile.TemporaryDirectory() as directory:
        if huginn:
            model_dir = make_tiny_huginn_checkpoint(Path(directory))
        else:
            model_dir = make_tiny_checkpoint(Path(directory), seed=0)
        # Every request fits its whole prompt + output in every plane (no preemption).
        planes = 9 if huginn else 4
        blocks = rows * planes * (-(-(context + steps + 72) // block_size))
        args = dict(
            dtype="float32", block_size=block_size, num_blocks=blocks, max_num_seqs=rows,
            max_num_batched_tokens=max(rows, 2048), prefill_chunk_size=2048,
            exit_mode=("criterion" if huginn else "ouro") if signal else "trace",
            enable_prefix_caching=False,
        )  # fmt: skip
        args.update(engine_args or {})
        engine = LLMEngine.from_engine_args(model=str(model_dir), **args)
    prompt_len, max_tokens = context - 1, steps + 64  # per request
    needed = prompt_len + max_tokens
    if needed > engine.max_model_len:
        raise ConfigError(
            f"--context {context} with --steps {steps} needs {needed} positions per request; "
            f"this {family} checkpoint allows {engine.max_model_len}: lower --context or --steps"
        )
    null_core(engine)
    vocab = engine.model.config.vocab_size
    for i in range(rows):
        prompt = [3 + (i * 31 + j * 7) % (vocab - 3) for j in range(prompt_len)]
        trace = EXIT_TRACE[i % len(EXIT_TRACE) :] + EXIT_TRACE[: i % len(EXIT_TRACE)]
        exits = dict(exit_trace=trace * 64)
        if signal:  # a criterion (kl) below 0 and a CDF above 1 - 1e-9 are never reached
            exits = dict(max_loops=trace[0], exit_threshold=0.0 if huginn else 1 - 1e-9)
        params = SamplingParams(  # "delta" outputs: what the server's streams ask for
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=i if temperature > 0 else None,
            ignore_eos=True,
            output_kind="delta",
            **exits,
        )
        engine.add_request(f"h{i}", prompt, params)
    # Warm up until every request decodes (prompt steps done), then measure.
    while engine.core.scheduler.num_waiting or _prompt_rows(engine):
        engine.step()
    if replay_device_work:
        if engine.runner.graphs is None:
            raise ConfigError("--replay-device-work replays the decode graphs' step: it needs "
                              "--graph-mode emulate")  # fmt: skip
        replay_device_work_of(engine)
    for _ in range(8):
        engine.step()
    cost = CostModel(ModelShape.from_config(OURO_1P4B, dtype_bytes=2),
                     get_device_profile(device_profile))  # fmt: skip
    device = cost.core_call(rows=rows, kv_read_positions=rows * context,
                            attention_pairs=rows * context)  # fmt: skip
    num_frozen = freeze_startup_heap() if freeze_heap else 0
    try:
        points = [
            _measure_calls(engine, rows, steps // segments, device.time_s * 1e6)
            for _ in range(segments)
        ]
        frozen_ms = _full_collection_ms() if freeze_heap else None
    finally:
        gc.unfreeze()  # the benchmark's process goes on (the next row count, a test)
    point = points[0]
    if segments > 1:
        point = sorted(points, key=lambda p: p.host_us)[(segments - 1) // 2]
        point = dataclasses.replace(point, segment_host_us=tuple(p.host_us for p in points))
    return dataclasses.replace(
        point, num_full_collections=sum(p.num_full_collections for p in points),
        gc_frozen_ms=frozen_ms, gc_full_ms=_full_collection_ms(), num_frozen=num_frozen,
    )  # fmt: skip


def _full_collection_ms() -> float:
    """How long one full garbage collection of this process takes now, in ms."""
    start_s = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - start_s) * 1e3


def _measure_calls(engine: LLMEngine, rows: int, calls: int, device_us: float) -> HostPoint:
    """`calls` steady decode steps of `engine`, timed from its counters."""
    engine.core.reset_counters()
    full0 = gc.get_stats()[-1]["collections"]
    start_s = time.perf_counter()
    for _ in range(calls):
        engine.step()
    total_s = time.perf_counter() - start_s
    num_full = gc.get_stats()[-1]["collections"] - full0
    stats = engine.stats
    assert stats.num_core_calls == stats.num_steps == calls, (stats.num_core_calls, calls)
    assert stats.num_rows == rows * calls, "every measured call has exactly `rows` rows"
    execute_s, forward_s = stats.execute_time_s, stats.forward_time_s
    apply_s = stats.step_time_s - stats.schedule_time_s - execute_s
    output_s = total_s - stats.step_time_s
    per_call_us = 1e6 / calls
    return HostPoint(
        rows=rows,
        num_calls=calls,
        schedule_us=stats.schedule_time_s * per_call_us,
        runner_us=(execute_s - forward_s) * per_call_us,
        model_us=forward_s * per_call_us,
        apply_us=apply_s * per_call_us,
        output_us=output_s * per_call_us,
        device_us=device_us,
        num_full_collections=num_full,
    )


def _prompt_rows(engine: LLMEngine) -> bool:
    return any(request.in_prompt_phase for request in engine.core.scheduler.running)


def format_table(points: list[HostPoint], device_profile: str) -> str:
    lines = [
        f"| rows | schedule us | runner us | apply us | output us | host us | "
        f"{device_profile} Ouro-1.4B device us | host / device |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in points:
        lines.append(
            f"| {p.rows} | {p.schedule_us:.0f} | {p.runner_us:.0f} | {p.apply_us:.0f} | "
            f"{p.output_us:.0f} | {p.host_us:.0f} | {p.device_us:.0f} | {p.ratio:.2f} |"
        )
    return "\n".join(lines)


def main_from_args(args) -> int:
    torch.set_num_threads(max(1, args.threads))
    if args.attention_backend == "triton":
        # The engine takes Triton on CPU only under the interpreter; the null core launches
        # no attention kernel, so only the backend's host-side metadata work runs.
        os.environ["TRITON_INTERPRET"] = "1"
    engine_args = {"attention_backend": args.attention_backend, "graph_mode": args.graph_mode}
    rows_list = [int(r) for r in args.rows.split(",")]
    points = []
    for rows in rows_list:
        point = measure(rows, context=args.context, steps=args.steps,
                        device_profile=args.device_profile, engine_args=engine_args,
                        family=args.family, exit=args.exit, temperature=args.temperature,
                        top_p=args.top_p, segments=args.segments,
                        freeze_heap=args.freeze_heap,
                        replay_device_work=args.replay_device_work)  # fmt: skip
        points.append(point)
        spread = ""
        if point.segment_host_us:
            low, high = min(point.segment_host_us), max(point.segment_host_us)
            spread = f" (median of {args.segments} runs: {low:.0f}-{high:.0f})"
        print(f"rows={rows}: host {point.host_us:.0f} us/call{spread}, device "
              f"{point.device_us:.0f} us, ratio {point.ratio:.2f}", flush=True)  # fmt: skip
        frozen = "" if point.gc_frozen_ms is None else (
            f"{point.gc_frozen_ms:.2f} ms with the start-up heap frozen "
            f"({point.num_frozen} objects), ")  # fmt: skip
        print(f"  full garbage collections during the calls: {point.num_full_collections}; "
              f"one costs {frozen}{point.gc_full_ms:.1f} ms walking the whole heap",
              flush=True)  # fmt: skip
    table = format_table(points, args.device_profile)
    if args.replay_device_work:
        print("(the emulated step's device work replayed: the CPU ran only the host path)")
    print(table)
    in_range = [p for p in points if 32 <= p.rows <= 256]
    met = all(p.ratio <= TARGET_RATIO for p in in_range)
    print(f"target host <= {TARGET_RATIO}x device at 32..256 rows: "
          f"{'met' if met else 'not met'}")  # fmt: skip
    if args.output_json:
        record = {"points": [dict(asdict(p), host_us=p.host_us, ratio=p.ratio) for p in points],
                  "device_profile": args.device_profile, "context": args.context,
                  "replay_device_work": args.replay_device_work,
                  "target_ratio": TARGET_RATIO, "target_met": met}  # fmt: skip
        Path(args.output_json).write_text(json.dumps(record, indent=1))
    return 0
