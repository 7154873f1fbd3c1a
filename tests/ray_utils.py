"""One local Ray cluster per test process, for the data-parallel and prefill/decode tests
(`ray` installed).

The first module that needs it starts it, and it serves every later one in that process; it
stops when the process exits. A module still proves it left nothing running:
`stop_local_ray` waits until every logical CPU is free again, so a replica the module failed to
shut down fails that module. Measured 2026-12-06 on a 2-vCPU Xeon VM, the eight modules that
use it under `-n 2`, alternating: 165 and 159 s with a cluster per module, 127 and 134 s with
one per process (a start costs about 3.6 s and a stop 1.5 s; an idle cluster's daemons take
about 2% of a core). An earlier trial of one cluster per process, one full-suite run each way,
read 409 against 382-395 s: within this VM's run-to-run spread.
"""

from __future__ import annotations

import atexit
import time

import ray

CLUSTER_CPUS = 4  # logical: the most any module's replicas take at once


def start_local_ray(num_cpus: int = CLUSTER_CPUS) -> None:
    """The process's private cluster on loopback (started on first use): `CLUSTER_CPUS`
    logical CPUs (replicas take one each; a module needs `num_cpus`), a small object store,
    no dashboard, worker logs kept out of the test output."""
    assert num_cpus <= CLUSTER_CPUS, num_cpus
    if ray.is_initialized():
        return
    atexit.register(ray.shutdown)
    ray.init(
        num_cpus=CLUSTER_CPUS,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=80 * 1024**2,
        log_to_driver=False,
    )


def stop_local_ray(timeout_s: float = 30.0) -> None:
    """Wait (at most `timeout_s`: actor exits are asynchronous) until every actor the module
    started has released its CPU; the cluster stays for the next module. A module that left
    one running fails, and the cluster goes with its actors (the next module starts a fresh
    one, not one with a leaked replica in it)."""
    deadline = time.monotonic() + timeout_s
    total = ray.cluster_resources().get("CPU", 0.0)
    while ray.available_resources().get("CPU", 0.0) < total:
        if time.monotonic() > deadline:
            left = ray.available_resources()
            ray.shutdown()
            raise AssertionError(f"actors left running: {left}")
        time.sleep(0.1)
