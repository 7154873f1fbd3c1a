"""A Ray cluster on loopback owned by this process, for tests that join an existing cluster
(`loopserve serve --ray-address`): prints its GCS address on one line, then waits until its
standard input closes (or SIGTERM) and shuts the cluster down.

It is started with `ray.init` rather than `ray start`: `ray start` records its address in
/tmp/ray/ray_current_cluster, which every later `ray.init()` on the machine would join (the
other Ray tests start clusters of their own, in parallel)."""

from __future__ import annotations

import signal
import sys

import ray


def main() -> None:
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=80 * 1024**2,
        log_to_driver=False,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(ray.get_runtime_context().gcs_address, flush=True)
    try:
        sys.stdin.read()  # until the test closes it
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
