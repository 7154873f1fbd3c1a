"""One local Ray cluster for the data-parallel and prefill/decode tests (`ray` installed).

A module starts it and stops it. One cluster per test process, kept for the session, was
tried: a start and stop cost about 3.5 CPU seconds, but an idle cluster's daemons take about
3% of a core for the rest of the session, and the suite ran 409 s with it against 382-395 s
without (2-vCPU Xeon, one run each; measured 2026-12-05).
Before stopping, a module proves it left nothing running: `stop_local_ray` waits until every
logical CPU is free again, so a replica the module failed to shut down fails that module.
"""

from __future__ import annotations

import time

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


def stop_local_ray(timeout_s: float = 30.0) -> None:
    """Wait (at most `timeout_s`: actor exits are asynchronous) until every actor the module
    started has released its CPU, then shut the cluster down."""
    try:
        deadline = time.monotonic() + timeout_s
        total = ray.cluster_resources().get("CPU", 0.0)
        while ray.available_resources().get("CPU", 0.0) < total:
            if time.monotonic() > deadline:
                raise AssertionError(f"actors left running: {ray.available_resources()}")
            time.sleep(0.1)
    finally:
        ray.shutdown()
