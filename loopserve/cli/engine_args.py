"""Engine flags shared by every CLI command; names equal `LLM(**engine_args)` keywords."""

from __future__ import annotations

import argparse

from loopserve.config import ATTENTION_BACKENDS, EXIT_MODES, LAYOUTS, MODES, PREFILL_MODES


def int_list(text: str) -> list[int]:
    """argparse type for comma-separated positive integers, e.g. `8,16,32`."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model", default=None, help="checkpoint dir or Hub id (default: embedded model)"
    )
    group.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    group.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="auto: triton on CUDA, torch on CPU (triton on CPU needs TRITON_INTERPRET=1)",
    )
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks (default: from a byte budget)"
    )
    group.add_argument("--kv-cache-bytes", type=int, default=None)
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--layout", default="last_exited", choices=LAYOUTS)
    group.add_argument("--max-num-seqs", type=int, default=64)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--prefill-chunk-size", type=int, default=512)
    group.add_argument("--mode", default="refill", choices=MODES)
    group.add_argument("--prefill-mode", default="atomic", choices=PREFILL_MODES)
    group.add_argument("--mixed-prefill-decode", action="store_true")
    group.add_argument("--exit-mode", default="ouro", choices=EXIT_MODES)
    group.add_argument("--lookahead-seed", type=int, default=0)


ENGINE_ARG_NAMES = (
    "model", "dtype", "device", "max_model_len", "block_size", "num_blocks", "kv_cache_bytes",
    "gpu_memory_utilization", "layout", "max_num_seqs", "max_num_batched_tokens",
    "prefill_chunk_size", "mode", "prefill_mode", "mixed_prefill_decode", "exit_mode",
    "lookahead_seed", "attention_backend",
)  # fmt: skip


def engine_args_from(args: argparse.Namespace) -> dict[str, object]:
    return {name: getattr(args, name) for name in ENGINE_ARG_NAMES}
