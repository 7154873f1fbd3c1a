"""The `loopserve serve` flags for engine replicas on Ray (data parallel, or prefill/decode
disaggregation with `--pd`), and the pool they build."""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from dataclasses import dataclass

from loopserve.distributed.router import ROUTING_POLICIES
from loopserve.distributed.transport import KV_TRANSPORTS
from loopserve.engine_args import ENGINE_ARGS_BY_NAME

# `--prefill-mode`'s help without its default (the engine's: atomic), for a command that
# leaves the flag unset and picks the arm itself.
PROMPT_ARM_HELP = ENGINE_ARGS_BY_NAME["prefill_mode"].help + " "

STREAM_WITH_TORCH = (
    "--kv-handoff stream sends chunks by Ray's object store or NIXL (--kv-transport ray, nixl "
    "or auto); --kv-transport torch sends whole hand-offs only (NCCL sends device memory in "
    "pair order, and streamed chunks leave the engine in host memory)"
)


@dataclass(frozen=True, slots=True)
class PDSpec:
    """`--pd prefill=P,decode=Q`: P prefill replicas and Q decode replicas."""

    num_prefill: int
    num_decode: int

    def __str__(self) -> str:
        return f"prefill={self.num_prefill},decode={self.num_decode}"


_PD_SPEC = re.compile(r"^\s*(\w+)\s*=\s*([^,]*?)\s*$")


def parse_pd_spec(text: str) -> PDSpec:
    """`prefill=P,decode=Q` (either order, both required, each >= 1) as a `PDSpec`; raises
    `argparse.ArgumentTypeError` naming what is wrong."""
    usage = "expected prefill=P,decode=Q with P, Q >= 1 replicas (e.g. prefill=1,decode=1)"
    counts: dict[str, int] = {}
    for part in text.split(","):
        match = _PD_SPEC.match(part)
        if match is None:
            raise argparse.ArgumentTypeError(f"{text!r}: {part!r} is not role=count; {usage}")
        role, value = match.group(1), match.group(2)
        if role not in ("prefill", "decode"):
            raise argparse.ArgumentTypeError(f"{text!r}: unknown role {role!r}; {usage}")
        if role in counts:
            raise argparse.ArgumentTypeError(f"{text!r}: {role} is given twice; {usage}")
        try:
            counts[role] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: {role}={value!r} is not a whole number; {usage}"
            ) from None
        if counts[role] < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: {role} must be >= 1; {usage}")
    missing = [role for role in ("prefill", "decode") if role not in counts]
    if missing:
        raise argparse.ArgumentTypeError(f"{text!r}: {' and '.join(missing)} missing; {usage}")
    return PDSpec(counts["prefill"], counts["decode"])


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data parallel (Ray)")
    group.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas, each a Ray actor with its own GPU (CUDA) or CPU; above 1 the "
        "server routes requests across them (needs `pip install 'loopserve[ray]'`)",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (e.g. `auto` or `ray://head:10001`) instead of starting an "
        "embedded one on loopback; implies replicas on Ray even with --data-parallel-size 1",
    )
    group.add_argument(
        "--routing",
        default="least_load",
        choices=ROUTING_POLICIES,
        help="least_load: fewest outstanding tokens; prefix: same prompt prefix (first full KV "
        "blocks) to the same replica unless it is much busier",
    )
    group.add_argument(
        "--pd",
        type=parse_pd_spec,
        default=None,
        metavar="prefill=P,decode=Q",
        help="prefill/decode disaggregation: P replicas run prompts and first tokens, then hand "
        "each request (its KV of every plane, by --kv-transport) to one of Q decode "
        "replicas; P + Q replicas in all, so it excludes --data-parallel-size above 1. "
        "--routing applies among the prefill replicas; decode replicas go by load",
    )
    group.add_argument(
        "--replica-max-restarts",
        type=int,
        default=4,
        help="times Ray restarts a replica that died (-1: without limit)",
    )
    group.add_argument(
        "--kv-transport",
        default="ray",
        choices=KV_TRANSPORTS,
        help="how prefill/decode hand-offs move their K/V: ray (the object store, host "
        "memory), torch (point to point over torch.distributed: NCCL on CUDA, gloo on CPU), "
        "nixl (the decode replica reads it over NIXL's UCX backend; pip install -e "
        "'.[nixl]'), auto (torch on CUDA, else ray)",
    )
    group.add_argument(
        "--kv-handoff",
        default="whole",
        choices=("whole", "stream"),
        help="with --pd: whole moves each request's K/V after its first token; stream "
        "reserves blocks on a decode replica before the prompt runs and sends each plane's "
        "prompt blocks as soon as they are final, while later chunks compute (by Ray's object "
        "store or NIXL: --kv-transport ray, nixl or auto); prompts then run --prefill-mode "
        "per_depth unless another arm is given, so plane d leaves after loop d while the "
        "chunk's deeper loops run",
    )
    group.add_argument(
        "--kv-transfer-timeout-s",
        type=float,
        default=120.0,
        help="with --kv-transport torch: seconds a hand-off's send or receive may wait for "
        "its peer before the transport is marked failed (later hand-offs then use the object "
        "store); also the torch.distributed group's timeout. With nixl: seconds a read may "
        "take, and a sent K/V stays registered unread",
    )


def uses_ray(args: argparse.Namespace) -> bool:
    return args.data_parallel_size > 1 or args.ray_address is not None or args.pd is not None


def default_prefill_mode(kv_handoff: str, engine_args: Mapping[str, object]) -> str:
    """The prompt arm for replicas whose `prefill_mode` nobody chose: per_depth when they
    stream hand-offs, atomic (the engine's default) otherwise.

    Under the atomic arm a chunk runs all its loops in one step, so its planes are final, and
    leave, only after its last loop: a prompt's last chunk goes after the first token. Under
    per_depth a chunk runs one loop per step and plane d leaves while loops d+1.. run (a
    prefill replica runs only prompts, so its time to first token is the atomic arm's).
    Streaming stays on atomic where per_depth cannot help or cannot run: one K/V per position
    (`layout='shared'`: final only after the last loop) and `prompt_exits` (atomic only)."""
    engine_default = str(ENGINE_ARGS_BY_NAME["prefill_mode"].default)
    if kv_handoff != "stream" or engine_args.get("prompt_exits"):
        return engine_default
    if engine_args.get("layout", "last_exited") == "shared":
        return engine_default
    return "per_depth"


def with_default_prefill_mode(kv_handoff: str, engine_args: dict[str, object]) -> dict[str, object]:
    """`engine_args` with `prefill_mode` filled in where it is unset (missing or None) by
    `default_prefill_mode`; as they are where it is set."""
    if engine_args.get("prefill_mode") is not None:
        return engine_args
    return {**engine_args, "prefill_mode": default_prefill_mode(kv_handoff, engine_args)}


def resolve_prefill_mode(args: argparse.Namespace) -> str | None:
    """Fill in `args.prefill_mode` when the flag was left out (`default_prefill_mode`); a
    start-up note when the choice is worth one: per_depth picked for streaming, or streaming
    asked for under an explicit atomic arm (None: nothing to say)."""
    kv_handoff = getattr(args, "kv_handoff", "whole")
    if getattr(args, "prefill_mode", None) is None:
        args.prefill_mode = default_prefill_mode(kv_handoff, vars(args))
        if args.prefill_mode == "per_depth":
            return (
                "--kv-handoff stream: prompts run one loop per step (--prefill-mode per_depth, "
                "the default when streaming), so each plane's blocks leave while the deeper "
                "loops run; --prefill-mode atomic sends a chunk's planes after its last loop"
            )
        return None
    if kv_handoff != "stream" or args.prefill_mode != "atomic":
        return None
    return (
        "--kv-handoff stream with --prefill-mode atomic: a prompt chunk's K/V leaves after "
        "its last loop, every plane at once, so a prompt's last chunk goes after its first "
        "token; per_depth (the default when streaming) sends each plane after its loop while "
        "the deeper loops run, so more of the transfer hides behind prefill "
        "(docs/deployment.md)"
    )


def check_distributed_args(args: argparse.Namespace) -> None:
    """Raise `UsageError` for a bad combination of the flags above."""
    from loopserve.errors import UsageError

    if args.data_parallel_size < 1:
        raise UsageError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.pd is not None and args.data_parallel_size > 1:
        raise UsageError(
            f"--pd {args.pd} and --data-parallel-size {args.data_parallel_size} exclude each "
            "other: --pd sets the replicas itself (prefill + decode); drop "
            "--data-parallel-size, or give more replicas per role in --pd"
        )
    timeout_s = getattr(args, "kv_transfer_timeout_s", 120.0)
    if not timeout_s > 0:
        raise UsageError(f"--kv-transfer-timeout-s must be > 0, got {timeout_s}")
    kv_handoff = getattr(args, "kv_handoff", "whole")
    if kv_handoff == "stream" and args.pd is None:
        raise UsageError("--kv-handoff stream needs --pd: it is how prefill replicas hand off")
    if kv_handoff == "stream" and getattr(args, "kv_transport", "ray") == "torch":
        raise UsageError(STREAM_WITH_TORCH)
    if args.pd is not None and getattr(args, "async_scheduling", False):
        raise UsageError(
            "--pd needs --async-scheduling off: a request is handed off between two tokens, "
            "and asynchronous scheduling plans the next token's loops before the hand-off "
            "could happen"
        )
