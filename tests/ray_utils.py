"""One local Ray cluster per test process for the data-parallel and prefill/decode tests.

Starting a cluster (GCS, raylet, prestarted workers) and shutting it down costs about 3.5 CPU
seconds and 5 s of wall time (measured on the project's 2-core machine), and with pytest-xdist
each Ray test module ran on both workers: one cluster per module per worker. The first module
that asks starts it; it stays up until the process exits. Each module still proves it left
nothing running: `stop_local_ray` waits until every logical CPU is free again, so a replica
a module failed to shut down fails that module, not a later one.
"""

from __future__ import annotations

import atexit
import time

import ray

# Logical CPUs (replicas take one each): the largest user is a two-replica pool with room
# for a killed replica's restart.
LOGICAL_CPUS = 4


def start_local_ray(num_cpus: int = LOGICAL_CPUS) -> None:
    """The process's private cluster on loopback (started on first use): `num_cpus` logical
    CPUs are what the module needs at most, a small object store, no dashboard, worker logs
    kept out of the test output."""
    assert num_cpus <= LOGICAL_CPUS, f"the shared test cluster has {LOGICAL_CPUS} CPUs"
    if ray.is_initialized():
        return
    ray.init(
        num_cpus=LOGICAL_CPUS,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=80 * 1024**2,
        log_to_driver=False,
    )
    atexit.register(ray.shutdown)


def stop_local_ray(timeout_s: float = 30.0) -> None:
    """A module's end: every actor it started has released its CPU (actor exits are
    asynchronous: wait at most `timeout_s`). The cluster itself stays for the next module."""
    if not ray.is_initialized():
        return
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0.0) < LOGICAL_CPUS:
        if time.monotonic() > deadline:
            raise AssertionError(f"actors left running: {ray.available_resources()}")
        time.sleep(0.1)
