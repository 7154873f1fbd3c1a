"""The `loopserve serve` flags for data-parallel replicas on Ray, and the pool they build."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from loopserve.distributed.router import ROUTING_POLICIES
from loopserve.distributed.transport import KV_TRANSPORTS


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
        "auto (torch on CUDA, else ray)",
    )


def uses_ray(args: argparse.Namespace) -> bool:
    return args.data_parallel_size > 1 or args.ray_address is not None


def build_pool(
    args: argparse.Namespace,
    engine_args: dict[str, object],
    on_load_error: Callable[[BaseException], None],
):  # -> ReplicaPool
    """The `ReplicaPool` the flags describe; raises SystemExit with a hint without Ray."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise SystemExit(
            "--data-parallel-size > 1 and --ray-address need Ray: pip install 'loopserve[ray]'"
        ) from None
    from loopserve.distributed.pool import PoolConfig, ReplicaPool

    if args.data_parallel_size < 1:
        raise SystemExit(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    config = PoolConfig(
        num_replicas=args.data_parallel_size,
        routing=args.routing,
        ray_address=args.ray_address,
        max_pending_requests=args.max_pending_requests,
        max_restarts=args.replica_max_restarts,
        torch_threads=args.torch_threads,
    )
    return ReplicaPool(engine_args, config, on_load_error=on_load_error)
