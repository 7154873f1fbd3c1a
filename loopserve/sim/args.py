"""Flags of `loopserve simulate`, kept torch-free so `simulate --help` stays fast."""

from __future__ import annotations

import argparse
import math

from loopserve.distributed.args import PROMPT_ARM_HELP
from loopserve.engine_args import add_engine_args
from loopserve.sim.hardware import DEVICE_PROFILES
from loopserve.workloads.args import add_output_args, add_progress_arg, int_list
from loopserve.workloads.arms import PROMPT_ARMS, SIM_POLICIES
from loopserve.workloads.interference import InterferenceSpec

# The engine flags `simulate` takes (same names, defaults and help as every other command).
SIM_ENGINE_ARGS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "prefill_chunk_size",
    "prefill_mode",
    "mixed_prefill_decode",
    "fill_prompt_chunks",
    "block_size",
    "num_blocks",
    "gpu_memory_utilization",
    "layout",
    "kv_cache_dtype",
    "kv_reservation",
    "kv_watermark",
    "preemption_mode",
    "swap_space",
    "scheduling_policy",
    "enable_prefix_caching",
    "cascade_attention",
    "speculative_tokens",
    "draft_loops",
    "speculative_max_seqs",
    "coda_batching",
    "coda_batch_max_wait",
    "coda_batch_min_rows",
)


# The embedded default model, greedy, 780 positions at full depth (docs/speculative.md).
EMBEDDED_STABLE_DIST = (0.349, 0.308, 0.215, 0.128)


def _probs(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated probabilities, got {text}"
        ) from None
    if not values or min(values) < 0 or sum(values) <= 0:
        raise argparse.ArgumentTypeError(f"probabilities must be >= 0 with a positive sum: {text}")
    return values


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 (or inf), got {text}")
    return value


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device-profile",
        default="h100",
        choices=sorted(DEVICE_PROFILES),
        help="simulated GPU",
    )
    parser.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="a calibration JSON written by the GPU check (loopserve.gpu_check): simulate its "
        "device profile with the fitted efficiencies and per-call overhead (overrides "
        "--device-profile); None: the datasheet profile",
    )
    parser.add_argument(
        "--kernel-us",
        type=float,
        default=0.0,
        help="device microseconds each kernel costs beyond its roofline inside a CUDA graph "
        "(launch gap, ramp, tail), charged per kernel the model's layers launch (counted by "
        "`loopserve bench kernels`); 0: not priced (docs/simulator.md, 'Kernel pricing')",
    )
    parser.add_argument(
        "--kernels-per-layer",
        type=float,
        default=None,
        help="with --kernel-us: price this many kernels per layer instead of the measured "
        "count (to model a fused build)",
    )
    parser.add_argument(
        "--fused-linears",
        action="store_true",
        help="with --kernel-us: core calls of up to 16 rows launch what the engine's "
        "--fused-linears build launches (5 per layer; counted by `loopserve bench kernels "
        "--fused-linears`)",
    )
    parser.add_argument(
        "--model-config",
        default=None,
        help="a checkpoint's config.json (Ouro or Huginn), or a preset: ouro-1.4b (default), "
        "ouro-2.6b, huginn-0125",
    )
    parser.add_argument(
        "--coda-every-loop",
        action="store_true",
        help="price an exit criterion that runs the coda after every loop (Huginn's kl, "
        "entropy-diff, minp-kl, argmax-stability); off: the coda runs at exits only",
    )
    parser.add_argument(
        "--draft-stable-dist",
        type=_probs,
        default=EMBEDDED_STABLE_DIST,
        help="with --speculative-tokens > 0: P(s = j) for j = 0..D-1, s the first loop from "
        "which the coda's argmax stays the emitted token (a draft after loop j is right iff "
        "j >= s); default: measured on the embedded model (docs/speculative.md; `loopserve "
        "bench speculative` measures it)",
    )
    parser.add_argument(
        "--dataset",
        default="sharegpt",
        choices=["sharegpt", "synthetic"],
        help="request lengths: ShareGPT conversations or uniform synthetic lengths",
    )
    parser.add_argument("--input-len", type=int, default=256, help="synthetic prompt length")
    parser.add_argument("--output-len", type=int, default=256, help="synthetic output length")
    parser.add_argument("--range-ratio", type=float, default=0.5, help="synthetic length spread")
    parser.add_argument("--num-requests", type=int, default=1000, help="requests per run")
    parser.add_argument(
        "--request-rate", type=_rate, nargs="+", default=[math.inf], help="req/s; inf = offline"
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="requests in flight (None: no cap)"
    )
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["refill"],
        choices=SIM_POLICIES,
        help="policies (arms) to compare",
    )
    parser.add_argument(
        "--exit-dist",
        default=None,
        help="ouro_1p4b_t0.5 | huginn_0125_latent_diff | huginn_0125_argmax10 | uniform | full | "
        "probs:p1,..,pD | trace:l1,l2,.. (None: the model's measured one, ouro_1p4b_t0.5 for "
        "Ouro-1.4B, huginn_0125_latent_diff for Huginn-0125, else uniform)",
    )
    add_engine_args(
        parser,
        names=SIM_ENGINE_ARGS,
        title="engine (simulated)",
        defaults={"prefill_mode": None},
        helps={
            "prefill_mode": PROMPT_ARM_HELP + "(None: atomic; with --scenario pd the streamed "
            "setup runs per_depth, as `serve --pd --kv-handoff stream` picks)"
        },
    )
    parser.add_argument(
        "--client-max-tokens",
        type=int,
        default=None,
        help="max_tokens clients send (e.g. 2048); requests still stop at their sampled "
        "length (None: clients send the exact output length)",
    )
    parser.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="a system prompt of this many tokens before every prompt (prefix caching)",
    )
    parser.add_argument(
        "--host-overhead-ms", type=float, default=0.0, help="host time added per step"
    )
    parser.add_argument(
        "--host-model",
        default=None,
        help="price host time per core call: 'cpu' (the bench host fit of docs/benchmarks.md) "
        "or a `loopserve bench host --output-json` file; steps are host-bound when it exceeds "
        "their device time (overlapped, ideally, with --async-scheduling)",
    )
    parser.add_argument(
        "--roofline",
        default="call",
        choices=["call", "phase"],
        help="one roofline per core call, or linear and attention phases priced separately",
    )
    parser.add_argument(
        "--slo-ms", type=float, default=50.0, help="P99 normalized latency SLO (ms/token)"
    )
    parser.add_argument(
        "--find-capacity",
        action="store_true",
        help="bisect the rate per policy between min and max of --request-rate",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    add_output_args(parser, default_dir="sim_out")
    parser.add_argument("--no-plot", action="store_true", help="skip simulate.png")
    add_progress_arg(parser)
    parser.add_argument(
        "--sched-bench", action="store_true", help="scheduler CPU microbenchmark and exit"
    )
    scenario = parser.add_argument_group(
        "prompt-scheduling scenarios (--scenario; see loopserve.sim.scenarios)"
    )
    scenario.add_argument(
        "--scenario",
        choices=["wcpb", "interference", "pd", "brownout"],
        default=None,
        help="instead of a rate sweep: wcpb (long prompts only), interference (decode "
        "population + injected long prompts), pd (--colocated replicas vs --pd prefill,decode "
        "replicas on --dataset lengths with a long-prompt mix, at each --request-rate) or "
        "brownout (goodput against rate with and without overload brownout around the "
        "capacity without it: loopserve.sim.brownout); uses --device-profile, "
        "--max-num-batched-tokens, --prefill-chunk-size and --exit-dist",
    )
    scenario.add_argument(
        "--pd", type=int_list, default=[2, 2], help="pd: prefill,decode replica counts"
    )
    scenario.add_argument("--colocated", type=int, default=4, help="pd: colocated replicas")
    scenario.add_argument(
        "--link",
        choices=["nvlink", "ib"],
        default="nvlink",
        help="pd: KV hand-off link (nvlink: 450 GB/s per direction; ib: NDR 50 GB/s)",
    )
    scenario.add_argument(
        "--handoff-landing",
        choices=["device", "host"],
        default="device",
        help="pd: where a hand-off's K/V lands on the decode replica (device: GPU memory, "
        "written by the link as NIXL over VRAM does, then copied within HBM; host: host "
        "memory, then copied over the host link), the copy serial with the decode step",
    )
    scenario.add_argument(
        "--long-share", type=float, default=0.15, help="pd: share of requests with a long prompt"
    )
    scenario.add_argument(
        "--long-lens",
        type=int_list,
        default=[4096, 8192],
        help="pd: long prompt length range (min,max)",
    )
    scenario.add_argument(
        "--arms",
        nargs="+",
        default=None,
        choices=PROMPT_ARMS,
        help="prompt arms (None: atomic wavefront for wcpb, atomic per_depth mixed for "
        "interference)",
    )
    scenario.add_argument(
        "--prompt-lens", type=int_list, default=[8064] * 4, help="long prompt lengths"
    )
    scenario.add_argument(
        "--chunk-sizes", type=int_list, default=[128, 64, 32, 16], help="wcpb chunk sizes"
    )
    scenario.add_argument(
        "--num-decode",
        type=int,
        default=InterferenceSpec.num_decode,
        help="interference: decode population size",
    )
    scenario.add_argument(
        "--decode-prompt-len",
        type=int,
        default=InterferenceSpec.decode_prompt_len,
        help="interference: prompt tokens of each decode request",
    )
    scenario.add_argument(
        "--decode-max-tokens",
        type=int,
        default=InterferenceSpec.decode_max_tokens,
        help="interference: decode length; must outlast the prompts",
    )
    scenario.add_argument(
        "--inject-at",
        type=int_list,
        default=None,
        help="prompt j arrives once every decode request has this many tokens (None: 8 each)",
    )


def add_host_bench_args(parser) -> None:
    """Flags of `loopserve bench host` (`loopserve.sim.host_bench`)."""
    parser.add_argument("--rows", default="1,8,32,128,256", help="rows per core call")
    parser.add_argument(
        "--family",
        default="ouro",
        choices=("ouro", "huginn"),
        help="the shape of the calls: Ouro's (hidden state, gate) or Huginn's ([state, e], "
        "once planes, a convergence criterion)",
    )
    parser.add_argument(
        "--exit",
        default="trace",
        choices=("trace", "signal"),
        help="how Ouro-shaped calls exit: trace (replayed loop counts, no gate read) or signal "
        "(its gate read at every loop, as Huginn's criterion is, with a threshold never "
        "reached and each request's max_loops the trace's loop count: the same calls as "
        "Huginn's, for the family comparison); Huginn-shaped calls always read their signal",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's sampling temperature (0: greedy); above 0 each request samples "
        "with its own seeded generator",
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's top_p")
    parser.add_argument("--context", type=int, default=256, help="positions per row")
    parser.add_argument("--steps", type=int, default=200, help="measured calls per row count")
    parser.add_argument(
        "--segments",
        type=int,
        default=1,
        help="measure the calls in this many runs and report the run with the median host "
        "time (its spread printed beside it): a burst of other work on a shared machine "
        "spoils a few runs, not the median",
    )
    parser.add_argument(
        "--no-freeze-heap",
        dest="freeze_heap",
        action="store_false",
        help="leave the start-up heap to the garbage collector (by default it is frozen after "
        "the warm-up, as `loopserve serve` freezes it once the engine loads)",
    )
    parser.add_argument(
        "--replay-device-work",
        action="store_true",
        help="run the emulated decode step once per bucket and form, then reuse its outputs: "
        "the CPU runs only the host path between calls, as a GPU host does (the model's "
        "arithmetic no longer evicts its caches); trace exits only",
    )
    parser.add_argument("--device-profile", default="h200", help="simulated GPU")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--attention-backend",
        default="triton",
        choices=("triton", "torch"),
        help="the backend whose host path is measured (triton: the GPU's)",
    )
    parser.add_argument(
        "--graph-mode",
        default="emulate",
        choices=("emulate", "off"),
        help="emulate: the static buffers of CUDA graphs (the GPU default)",
    )
    parser.add_argument("--output-json", default=None, help="write the points here")
