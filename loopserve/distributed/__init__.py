"""Scale-out on Ray: engine replicas as Ray actors, a router, and the pool the server uses.

`router` is pure bookkeeping (no Ray); `replica` is the actor class (Ray imported by the pool
only), with its prefill/decode methods in `replica_handoff` and its results and markers in
`replica_messages`; `pool` is `ReplicaPool`, an `EngineClient` (engine/client.py) for `loopserve serve
--data-parallel-size N` (submissions), on `pool_replicas.ReplicaSet` (start, probes, restarts,
health); `pool_stream` and `pd_stream` (with `pd_decode_leg`) follow one submission, opened by
`placement`; `pd_pool` adds prefill/decode roles; `metrics` renders per-replica gauges. Ray is
an optional dependency (`pip install 'loopserve[ray]'`) imported only when a pool starts.
"""
