"""Flags of the `loopserve bench` commands, kept torch-free so `bench X --help` stays fast.

Each `add_*_args` declares one command's flags; the command's module (imported only when it
runs) reads them. Engine flags come from the engine-argument table with bench-sized
defaults; output locations are spelled `--output-json` (a file) and `--output-dir`.
"""

from __future__ import annotations

import argparse
import math

from loopserve.engine_args import MODEL_ID_ARGS, add_engine_args
from loopserve.workloads.args import (
    add_output_args,
    add_progress_arg,
    arm_list,
    int_list,
    positive_int,
)
from loopserve.workloads.exits import NAMED_EXIT_DISTRIBUTIONS

ENDPOINT_NAMES = ("chat", "completions")


def add_model_args(
    parser: argparse.ArgumentParser,
    *,
    engine_defaults: dict[str, object],
    engine_helps: dict[str, str] | None = None,
) -> None:
    """The synthetic-model group and the engine group shared by the offline benchmarks."""
    model = parser.add_argument_group("model (synthetic unless --model)")
    model.add_argument("--model", default=None, help="checkpoint dir or Hub id")
    add_engine_args(model, names=MODEL_ID_ARGS)
    model.add_argument("--hidden-size", type=int, default=512, help="synthetic model width")
    model.add_argument("--num-layers", type=int, default=4, help="synthetic model layers")
    model.add_argument("--num-heads", type=int, default=8, help="synthetic attention heads")
    model.add_argument("--num-kv-heads", type=int, default=8, help="synthetic KV heads")
    model.add_argument("--loops", type=int, default=4, help="synthetic model loops (D)")
    model.add_argument("--vocab-size", type=int, default=4096, help="synthetic vocabulary")
    engine = parser.add_argument_group("engine")
    add_engine_args(
        engine, names=list(engine_defaults), defaults=engine_defaults, helps=engine_helps
    )
    engine.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)"
    )


def _add_run_args(parser: argparse.ArgumentParser, *, repeats: int, output_json: str) -> None:
    run = parser.add_argument_group("run")
    run.add_argument("--repeats", type=int, default=repeats, help="interleaved rounds (median)")
    run.add_argument("--seed", type=int, default=0, help="workload seed")
    add_output_args(run, default_json=output_json)
    run.add_argument("--figure", default=None, help="PNG path (None: --output-json with .png)")
    add_progress_arg(run)


PROMPT_ENGINE_DEFAULTS: dict[str, object] = {
    "dtype": "float32",
    "device": "cpu",
    "block_size": 16,
    "max_num_batched_tokens": 256,
    "fill_prompt_chunks": True,  # --no-fill-prompt-chunks: whole chunks only
}


def add_wcpb_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `loopserve bench wcpb`."""
    work = parser.add_argument_group("workload")
    work.add_argument(
        "--prompt-lens", type=int_list, default=[2048] * 4, help="prompt lengths, e.g. 2048,2048"
    )
    work.add_argument(
        "--chunk-sizes", type=int_list, default=[128, 64, 32, 16], help="prefill chunk sizes"
    )
    work.add_argument(
        "--arms", type=arm_list, default=["atomic", "wavefront"], help="prompt arms to compare"
    )
    add_model_args(parser, engine_defaults=PROMPT_ENGINE_DEFAULTS)
    _add_run_args(parser, repeats=3, output_json="bench_results/wcpb.json")


def add_interference_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `loopserve bench interference`."""
    work = parser.add_argument_group("workload")
    work.add_argument("--num-decode", type=int, default=16, help="decode population size")
    work.add_argument(
        "--decode-prompt-len", type=int, default=32, help="prompt tokens of each decode request"
    )
    work.add_argument(
        "--decode-max-tokens", type=int, default=512, help="decode length; must outlast prompts"
    )
    work.add_argument(
        "--prompt-lens", type=int_list, default=[2048] * 4, help="injected prompt lengths"
    )
    work.add_argument(
        "--inject-at",
        type=int_list,
        default=[8] * 4,
        help="prompt j arrives once every decode request has this many tokens (e.g. 8,16,24,32)",
    )
    work.add_argument("--prefill-chunk-size", type=int, default=64, help="prompt tokens per chunk")
    work.add_argument(
        "--arms",
        type=arm_list,
        default=["atomic", "per_depth", "mixed"],
        help="prompt arms to compare",
    )
    add_model_args(parser, engine_defaults=PROMPT_ENGINE_DEFAULTS)
    _add_run_args(parser, repeats=3, output_json="bench_results/interference.json")


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `loopserve bench throughput`."""
    work = parser.add_argument_group("workload")
    work.add_argument("--num-requests", type=int, default=64, help="requests per run")
    work.add_argument("--input-len", type=int, default=32, help="mean prompt tokens")
    work.add_argument("--output-len", type=int, default=64, help="mean output tokens")
    work.add_argument("--range-ratio", type=float, default=0.25, help="lengths uniform ±ratio")
    work.add_argument(
        "--exit-dist",
        default="uniform",
        choices=NAMED_EXIT_DISTRIBUTIONS,
        help="loops per token, sampled into exit traces",
    )
    work.add_argument(
        "--exit-threshold",
        type=float,
        default=None,
        help="instead of traces, the gate exits at this cumulative probability (1.0: never early; "
        "Huginn: the criterion's threshold)",
    )
    work.add_argument(
        "--exit-criterion",
        default="kl",
        help="Huginn checkpoints: the convergence criterion requests exit by (with "
        "--exit-threshold); ignored for Ouro",
    )
    work.add_argument("--seed", type=int, default=0, help="workload seed")
    work.add_argument(
        "--group-size",
        type=int,
        default=0,
        help="> 1: also a group-rollout arm, num_requests // n prompts x n sampled "
        "continuations each, with prompt groups on (one prefill per prompt) and off",
    )
    add_model_args(
        parser,
        engine_defaults={
            "dtype": "float32",
            "device": "cpu",
            "block_size": 16,
            "num_blocks": None,
            "kv_cache_dtype": "auto",
            "max_num_seqs": 64,
            "max_num_batched_tokens": 2048,
            "prefill_chunk_size": 512,
            "speculative_tokens": 0,
            "draft_loops": 2,
            "speculative_max_seqs": 32,
            "coda_batching": "auto",
            "coda_batch_max_wait": 8,
            "coda_batch_min_rows": None,
        },
        engine_helps={
            "num_blocks": "KV blocks (None: enough for the workload's largest requests)",
            "speculative_tokens": "> 0: a fourth arm, refill with self-speculative decoding "
            "(K drafted positions per request), beside the others",
        },
    )
    run = parser.add_argument_group("run")
    run.add_argument("--repeats", type=int, default=5, help="interleaved rounds (median)")
    run.add_argument("--host-rows", type=int, default=32, help="rows of the host-overhead run")
    run.add_argument(
        "--cost-rows",
        type=int_list,
        default=[],
        help="also time single-call decode steps at these row counts (e.g. 8,16,32,64) and "
        "fit step time = fixed + per_row x rows",
    )
    add_output_args(run, default_json="bench_results/throughput.json")
    add_progress_arg(run)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `loopserve bench serve`; the defaults finish in minutes against a CPU server."""
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address")
    target.add_argument(
        "--model", default=None, help="model id (None: the first of GET /v1/models)"
    )
    target.add_argument(
        "--endpoint", choices=ENDPOINT_NAMES, default="completions", help="API to call"
    )
    target.add_argument("--timeout-s", type=float, default=600.0, help="per-request limit")
    work = parser.add_argument_group("workload")
    work.add_argument(
        "--dataset", choices=["sharegpt", "random"], default="random", help="prompt source"
    )
    work.add_argument("--tokenizer", default=None, help="tokenizer.json for exact ShareGPT lengths")
    work.add_argument("--num-prompts", type=int, default=32, help="requests to send")
    work.add_argument(
        "--random-input-len", type=int, default=128, help="random dataset: prompt tokens"
    )
    work.add_argument(
        "--random-output-len", type=int, default=32, help="random dataset: output tokens"
    )
    work.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="random lengths uniform ±ratio"
    )
    work.add_argument(
        "--request-rate", type=float, default=math.inf, help="req/s; inf = all at once"
    )
    work.add_argument(
        "--max-concurrency", type=int, default=None, help="requests in flight (None: no cap)"
    )
    work.add_argument("--seed", type=int, default=0, help="sampling and arrival seed")
    work.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (default: generate exactly the sampled output length)",
    )
    slo = parser.add_argument_group("SLO (goodput counts requests meeting all that are set)")
    slo.add_argument("--slo-ttft-ms", type=float, default=None, help="time to first token")
    slo.add_argument("--slo-tpot-ms", type=float, default=None, help="time per output token")
    slo.add_argument("--slo-e2e-ms", type=float, default=None, help="end-to-end latency")
    out = parser.add_argument_group("output")
    add_output_args(out, default_dir="bench_results/serve")
    add_progress_arg(out)


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `loopserve bench speculative`."""
    parser.add_argument("--model", default=None, help="checkpoint (None: the embedded model)")
    parser.add_argument(
        "--configs", default="1:1,3:1,1:2,3:2", help="K:d pairs (speculative tokens : draft loops)"
    )
    parser.add_argument("--streams", default="1,8", help="requests in flight, comma-separated")
    parser.add_argument("--temperatures", default="0,0.7", help="comma-separated")
    parser.add_argument("--output-len", type=int, default=64, help="tokens per request")
    parser.add_argument(
        "--rounds-of-requests", type=int, default=2, help="requests per run = streams x this"
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    add_output_args(parser, default_json="bench_results/speculative.json")
    add_progress_arg(parser)


def add_kernels_args(parser) -> None:
    """Flags of `loopserve bench kernels` (`loopserve.bench.kernels`)."""
    parser.add_argument("--family", choices=("ouro", "huginn"), default="ouro",
                        help="the tiny checkpoint's family")  # fmt: skip
    parser.add_argument("--rows", type=positive_int, default=4, help="rows of the decode call")
    parser.add_argument("--attention-backend", choices=("triton", "torch"), default="triton",
                        help="the attention backend counted (CUDA resolves to triton)")  # fmt: skip
    parser.add_argument("--fused-linears", action="store_true",
                        help="count the model as --fused-linears runs it (GEMMs with their "
                        "neighbours fused in; calls of up to 16 rows)")  # fmt: skip
    add_engine_args(parser, names=["kv_cache_dtype"])
    parser.add_argument("--output-json", default=None, help="write the counts here")
