"""Starting the embedded local Ray cluster that replicas run on (when none is joined).

Ray starts its worker processes, our engine replicas among them, at nice level 15 by default
(`RAY_worker_niceness`), below the API server and anything else on the machine. On a host
whose cores are busy with other work, that starves the replicas: a two-test prefill/decode
run took 199 s instead of 23 s with two busy loops on 2 cores (measured). The replicas are the
work this process exists for, so the embedded cluster starts them at the normal level unless
the operator set `RAY_worker_niceness` themselves. A joined cluster (`--ray-address`) keeps
its own settings.
"""

from __future__ import annotations

import os

WORKER_NICENESS_ENV = "RAY_worker_niceness"


def start_embedded_ray(num_cpus: int, object_store_memory: int | None = None) -> None:
    """`ray.init` of a local cluster with node address 127.0.0.1, without the dashboard,
    engine workers at the normal nice level (see the module docstring). With Ray 2.60 its
    ports still listen on every interface (docs/deployment.md, "Security")."""
    import ray

    os.environ.setdefault(WORKER_NICENESS_ENV, "0")  # read by the raylet ray.init starts
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=object_store_memory,
    )
