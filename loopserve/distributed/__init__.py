"""Scale-out on Ray: engine replicas as Ray actors, a router, and the pool the server uses.

`router` is pure bookkeeping (no Ray); `replica` is the actor class (Ray imported by the pool
only); `pool` is `ReplicaPool`, the `AsyncLLM` stand-in for `loopserve serve
--data-parallel-size N`; `metrics` renders per-replica gauges. Ray is an optional dependency
(`pip install 'loopserve[ray]'`) imported only when a pool starts.
"""
