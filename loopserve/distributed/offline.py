"""Offline data parallelism for `LLM(..., data_parallel_size=N)`: N engine replicas as Ray
actors, one batch of prompts split across them, outputs returned in input order.

The split is decided up front by the router's least-load rule over each request's prompt plus
`max_tokens` (a greedy balance of estimated tokens), then every replica runs its share to
completion with the plain offline loop (`EngineReplica.generate_batch`). Outputs do not depend
on the split: each request's tokens are the same whichever batch it shares (batch invariance,
per-request seeded generators). No streaming, no failure recovery: a replica that dies fails
`generate`. The Ray cluster is the one already initialized, else an embedded local one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from loopserve.distributed.ray_init import start_embedded_ray
from loopserve.distributed.replica import EngineReplica, Rejected
from loopserve.distributed.router import RoutedRequest, Router
from loopserve.distributed.transport import (
    DEFAULT_TIMEOUT_S,
    KVTransportError,
    connect_kv_transport,
    resolve_kv_transport,
)
from loopserve.models.loader import require_handoff
from loopserve.outputs import RequestOutput
from loopserve.sampling_params import SamplingParams


class DataParallelEngines:
    """N replicas for the offline API; see the module docstring."""

    def __init__(
        self,
        engine_args: dict[str, object],
        num_replicas: int,
        *,
        torch_threads: int | None = None,
    ) -> None:
        try:
            import ray
        except ImportError:
            raise ImportError(
                "data_parallel_size > 1 needs Ray: pip install 'loopserve[ray]'"
            ) from None
        on_cuda = str(engine_args.get("device") or "cpu").startswith("cuda")
        if not on_cuda and torch_threads is None:
            torch_threads = max(1, (os.cpu_count() or 1) // num_replicas)
        self.num_replicas = num_replicas
        (self.replicas,) = _start_actors(engine_args, [num_replicas], torch_threads)
        self.info = ray.get(self.replicas[0].info.remote())
        self.last_split: list[int] = []  # requests per replica in the last `generate`

    def generate(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[str | list[int]],
        params: Sequence[SamplingParams],
    ) -> list[RequestOutput]:
        """Run every request on one replica; outputs in the order of `request_ids`."""
        import ray

        max_tokens = [sp.max_tokens for sp in params]
        prompts, shares = _split(self.info, request_ids, prompts, max_tokens, self.num_replicas)
        self.last_split = [len(share) for share in shares]
        refs = [
            replica.generate_batch.remote(
                [request_ids[i] for i in share],
                [prompts[i] for i in share],
                [params[i] for i in share],
            )
            for replica, share in zip(self.replicas, shares)
        ]
        outputs: list[RequestOutput | None] = [None] * len(request_ids)
        for share, result in zip(shares, ray.get(refs)):
            if isinstance(result, Rejected):
                raise result.error()
            for index, output in zip(share, result):
                outputs[index] = output
        assert all(output is not None for output in outputs)
        return outputs  # type: ignore[return-value]

    def shutdown(self) -> None:
        _kill(self.replicas)
        self.replicas = []


class DisaggregatedEngines:
    """Offline prefill/decode disaggregation on Ray: `num_prefill` replicas run prompts and
    first tokens and export the requests (`EngineReplica.prefill_export`); each prefill
    replica's hand-offs go, as one Ray object ref (the object store; the driver never
    fetches them), to decode replica `i % num_decode`, which receives, imports and finishes
    them (`decode_import`). Requests are split over prefill replicas by the router's
    least-load rule. Whole hand-offs only, no failure recovery (a replica that dies fails
    `generate`): streamed hand-offs and recovery are the serving pool's
    (`distributed/pd_pool.PDReplicaPool`, `serve --pd ... --kv-handoff stream`).

    `kv_transport` moves the K/V (`loopserve.distributed.transport`): "ray" (default) keeps
    it in the states, in the object store; "torch" sends it point to point over one
    torch.distributed group of all replicas (gloo on CPU, NCCL on CUDA) while the states
    travel without it; "nixl" lets the decode replica read it over NIXL (host memory); "auto"
    is torch on CUDA, else ray. `kv_transfer_timeout_s` bounds
    every transport wait."""

    def __init__(
        self,
        engine_args: dict[str, object],
        num_prefill: int,
        num_decode: int,
        *,
        torch_threads: int | None = 1,
        kv_transport: str = "ray",
        kv_transfer_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        import ray

        require_handoff(engine_args.get("model"))  # type: ignore[arg-type]
        device = str(engine_args.get("device") or "cpu")
        transport_kind = resolve_kv_transport(kv_transport, device)
        on_cuda = device.startswith("cuda")
        self.prefill, self.decode = _start_actors(
            engine_args, [num_prefill, num_decode], torch_threads
        )
        self.info = ray.get(self.prefill[0].info.remote())
        self.last_num_handed_off = 0  # requests exported in the last `generate`
        # Ranks: prefill replicas 0..P-1, decode replicas P..P+Q-1.
        self.transport = connect_kv_transport(
            transport_kind,
            self.prefill + self.decode,
            senders=range(num_prefill),
            receivers=range(num_prefill, num_prefill + num_decode),
            on_cuda=on_cuda,
            timeout_s=kv_transfer_timeout_s,
        )

    def generate(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[str | list[int]],
        params: Sequence[SamplingParams],
    ) -> list[RequestOutput]:
        """Final outputs in the order of `request_ids`."""
        import ray

        # A prefill replica produces one token per request: its outstanding work.
        ones = [1] * len(prompts)
        prompts, shares = _split(self.info, request_ids, prompts, ones, len(self.prefill))
        summaries, exported = [], []
        num_prefill = len(self.prefill)
        for source, (replica, share) in enumerate(zip(self.prefill, shares)):
            summary, states = replica.prefill_export.options(num_returns=2).remote(
                [request_ids[i] for i in share],
                [prompts[i] for i in share],
                [params[i] for i in share],
                destination=self.transport.rank_of(num_prefill + source % len(self.decode)),
            )
            summaries.append(summary)
            exported.append(states)
        self.last_num_handed_off = 0
        for result in ray.get(summaries):  # counts or rejections; the states stay in the store
            if isinstance(result, Rejected):
                raise result.error()
            self.last_num_handed_off += result
        groups: list[list[int]] = [[] for _ in self.decode]
        for i in range(len(self.prefill)):
            groups[i % len(self.decode)].append(i)
        decoded = [
            replica.decode_import.remote(*[exported[i] for i in group])
            for replica, group in zip(self.decode, groups)
        ]
        outputs: list[RequestOutput | None] = [None] * len(request_ids)
        for group, result in zip(groups, ray.get(decoded)):
            order = [index for i in group for index in shares[i]]
            for index, output in zip(order, result):
                outputs[index] = output
        for stats in self.transport.flush(range(num_prefill)):  # every send was received
            if stats.failure is not None:
                raise KVTransportError(stats.failure)
        assert all(output is not None for output in outputs)
        return outputs  # type: ignore[return-value]

    def shutdown(self) -> None:

        try:
            self.transport.close()
        finally:
            _kill(self.prefill + self.decode)
            self.prefill, self.decode = [], []


def _start_actors(
    engine_args: dict[str, object], counts: Sequence[int], torch_threads: int | None
) -> list[list]:
    """`EngineReplica` actors, one group per entry of `counts`, on the Ray cluster already
    initialized (else an embedded local one): one GPU each on CUDA, one CPU each on CPU."""
    import ray

    if not ray.is_initialized():
        start_embedded_ray(max(os.cpu_count() or 1, sum(counts)))
    args = dict(engine_args)
    on_cuda = str(engine_args.get("device") or "cpu").startswith("cuda")
    if on_cuda:
        args["device"] = "cuda"  # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPU
    actor_cls = ray.remote(EngineReplica).options(
        num_cpus=0 if on_cuda else 1, num_gpus=1 if on_cuda else 0
    )
    return [
        [actor_cls.remote(engine_args=args, torch_threads=torch_threads) for _ in range(count)]
        for count in counts
    ]


def _split(
    info,
    request_ids: Sequence[str],
    prompts: Sequence,
    max_tokens: Sequence[int],
    num_replicas: int,
) -> tuple[list, list[list[int]]]:
    """The prompts tokenized once (and checked) with the engine's input processor (`info`:
    its `ModelInfo`), and the request indices per replica by the router's least-load rule
    (prompt + max_tokens)."""
    processor = info.input_processor
    prompts = [processor.process(prompt) for prompt in prompts]
    router = Router(num_replicas)
    shares: list[list[int]] = [[] for _ in range(num_replicas)]
    for index, (request_id, prompt, tokens) in enumerate(zip(request_ids, prompts, max_tokens)):
        replica = router.choose(range(num_replicas), None).replica
        router.assign(replica, [RoutedRequest(request_id, len(prompt.token_ids), tokens)])
        shares[replica].append(index)
    return prompts, shares


def _kill(actors: list) -> None:
    import ray

    for actor in actors:
        ray.kill(actor, no_restart=True)
