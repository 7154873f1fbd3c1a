"""`build_pool`: the Ray replica pool that `loopserve serve`'s distributed flags describe."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from loopserve.distributed.args import PDSpec, check_distributed_args

__all__ = ["build_pool"]


def build_pool(
    args: argparse.Namespace,
    engine_args: dict[str, object],
    on_load_error: Callable[[BaseException], None],
):  # -> ReplicaPool | PDReplicaPool
    """The `ReplicaPool` (or, with `--pd`, `PDReplicaPool`) the flags describe; raises
    `UsageError` for bad flags and SystemExit with a hint without Ray."""
    check_distributed_args(args)
    try:
        import ray  # noqa: F401
    except ImportError:
        raise SystemExit(
            "--data-parallel-size > 1, --pd and --ray-address need Ray: "
            "pip install 'loopserve[ray]'"
        ) from None
    from loopserve.distributed.pool import PoolConfig, ReplicaPool

    pd: PDSpec | None = args.pd
    config = PoolConfig(
        num_replicas=args.data_parallel_size if pd is None else pd.num_prefill + pd.num_decode,
        routing=args.routing,
        ray_address=args.ray_address,
        max_pending_requests=args.max_pending_requests,
        max_restarts=args.replica_max_restarts,
        torch_threads=args.torch_threads,
    )
    if pd is not None:
        from loopserve.distributed.pd_pool import PDReplicaPool

        return PDReplicaPool(
            engine_args,
            config,
            pd,
            on_load_error=on_load_error,
            kv_transport=getattr(args, "kv_transport", "ray"),
            kv_transfer_timeout_s=getattr(args, "kv_transfer_timeout_s", 120.0),
            kv_handoff=getattr(args, "kv_handoff", "whole"),
        )
    return ReplicaPool(engine_args, config, on_load_error=on_load_error)
