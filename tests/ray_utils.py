"""One local Ray cluster for the data-parallel and prefill/decode tests (`ray` installed)."""

from __future__ import annotations

import ray


def start_local_ray(num_cpus: int) -> None:
    """A private cluster on loopback: `num_cpus` logical CPUs (replicas take one each), a small
    object store, no dashboard, worker logs kept out of the test output."""
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=80 * 1024**2,
        log_to_driver=False,
    )


def stop_local_ray() -> None:
    ray.shutdown()
