"""Several simulated replicas on one virtual clock: colocated data parallelism and
prefill/decode (PD) disaggregation.

Each replica is a `Simulator` (its own `EngineCore`, scheduler and KV pool on its own simulated
GPU). The cluster owns the shared clock: each replica has the time it is next free, and the loop
always advances the earliest event: an arrival or a KV hand-off landing (delivered first on a
tie) or the step of the busy replica that is free earliest. A replica idle when work reaches it
starts at the event's time. With one colocated replica this is exactly `Simulator.run`.

- Colocated: requests are routed at arrival to the replica with the least outstanding work
  (prompt tokens not yet prefilled + output tokens not yet produced, lowest index on ties).
- PD: prompts are routed (same rule) to prefill replicas, which run them with `max_tokens=1`
  (prompt at full depth and the first token). When the first token is out, the request's KV
  (prompt positions x planes x KV bytes per token per depth) is sent to the decode replica with
  the least outstanding work and takes `bytes / link_bandwidth` seconds on the link. Each
  prefill replica's sending link and each decode replica's receiving link (a GPU's own NIC
  or NVLink ports) carry one transfer at a time, first come, first served, so a hand-off
  waits for the ones ahead of it on either end (`Cluster._send`). The decode replica queues it with
  `Scheduler.add_imported` and decodes from the second token; its step that admits the
  request copies the K/V into its blocks: within HBM when the hand-off landed in device
  memory (`handoff_landing="device"`, the default: NVLink, and RDMA into registered GPU
  memory as NIXL over VRAM does, write GPU memory), over the host link when it landed in
  host memory (`"host"`: the object store, the torch transport, NIXL over DRAM). Either
  copy is serial with that step, which every decode row on the replica waits for.
- PD streaming (`streaming=True`): instead of the whole K/V after the first token, each prompt
  chunk's K/V is sent plane by plane as soon as it is final on the prefill replica (plane d
  once the chunk ran depth d under LAST_EXITED, so the per-depth and wavefront prompt arms send
  a chunk's shallow planes while it runs its deeper depths; everything else once it ran its
  last depth), as the engine's `KVStreamOut` does (a request's sends go one after another on
  its link, to the decode replica chosen with its first chunk: the one with the fewest streamed
  hand-offs in flight, then the least outstanding work, as the engine's router picks it), and
  what no chunk sent (positions served by the prefill replica's prefix cache) follows the first
  token. Each chunk is written into the decode replica's reserved blocks as it lands, holding
  that replica for the copy (as `LLMEngine.write_kv_chunk` does between steps), and the import
  then copies only the rest. The hand-off lands when the last byte does; the share of a
  request's link time that ran before its first token is hidden behind prefill
  (`pd_scenario.ClusterStats.hidden_transfer_share`).

Client view: the first token is streamed when the prefill replica produces it, so a PD
request's gap between tokens 1 and 2 includes the transfer and the decode queue; `itl` counts
every gap, `decode_itl` leaves the hand-off gap out (the gaps a decode replica controls).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from dataclasses import dataclass, field

from loopserve.contracts import ItemKind
from loopserve.models.config import OuroConfig
from loopserve.sim.hardware import DeviceProfile
from loopserve.sim.metrics import RequestRecord
from loopserve.sim.simulator import Simulator
from loopserve.sim.workload import SimRequest

GB = 1e9
# Link bandwidths per direction, from datasheets.
# NVIDIA H200 SXM datasheet: NVLink 900 GB/s per GPU (both directions together) -> 450 GB/s.
NVLINK4_BYTES_PER_S = 450 * GB
# NVIDIA ConnectX-7 / Quantum-2 NDR InfiniBand: 400 Gb/s per port -> 50 GB/s.
IB_NDR_BYTES_PER_S = 50 * GB
LINKS = {"nvlink": NVLINK4_BYTES_PER_S, "ib": IB_NDR_BYTES_PER_S}
# Where a hand-off's K/V lands on the decode replica: GPU memory, or host memory.
LANDINGS = ("device", "host")


@dataclass(frozen=True)
class Transfer:
    """One KV hand-off: prefill replica -> decode replica."""

    request_id: str
    src: int
    dst: int
    num_bytes: int
    start_s: float
    end_s: float
    exposed_s: float = 0.0  # from the first token to the landing
    busy_s: float = 0.0  # the link's transmission time: num_bytes / bandwidth
    hidden_s: float = 0.0  # of `busy_s`, what the link sent before the first token


@dataclass
class ClusterRun:
    records: list[RequestRecord]
    transfers: list[Transfer]
    clock_s: float  # makespan: t=0 to the last token
    handoff_index: dict[str, int] = field(default_factory=dict)  # PD: gap index of the hand-off
    # request id -> [(replica kind, replica index, tokens produced there)]
    produced: dict[str, list[tuple[str, int, int]]] = field(default_factory=dict)


class _Replica:
    def __init__(self, kind: str, index: int, sim: Simulator) -> None:
        self.kind, self.index, self.sim = kind, index, sim
        self.free_s = 0.0  # when its next step may start
        self.held_s = 0.0  # how far landed streamed chunks' writes moved `free_s` (decode)

    @property
    def busy(self) -> bool:
        return self.sim.core.has_unfinished_requests()

    def outstanding_work(self) -> int:
        return sum(
            r.num_prompt_tokens
            - r.num_prefilled_tokens
            + r.params.max_tokens
            - len(r.output_token_ids)
            for r in self.sim.scheduler.requests.values()
            if not r.is_finished
        )


def _least_loaded(replicas: list[_Replica]) -> _Replica:
    return min(replicas, key=lambda r: (r.outstanding_work(), r.index))


class Cluster:
    """`num_prefill == 0`: `num_decode` colocated replicas; otherwise PD disaggregation."""

    def __init__(
        self,
        model_config: OuroConfig,
        device: DeviceProfile,
        engine_args: dict[str, object] | None = None,
        *,
        num_colocated: int = 0,
        num_prefill: int = 0,
        num_decode: int = 0,
        link_bytes_per_s: float = NVLINK4_BYTES_PER_S,
        seed: int = 0,
        streaming: bool = False,
        handoff_landing: str = "device",
    ) -> None:
        if num_prefill and not num_decode or not (num_colocated or num_prefill):
            raise ValueError("need colocated replicas, or prefill and decode replicas")
        if num_colocated and (num_prefill or num_decode):
            raise ValueError("colocated and PD replicas do not mix")
        if handoff_landing not in LANDINGS:
            raise ValueError(f"handoff_landing must be one of {LANDINGS}, not {handoff_landing!r}")
        on_device = handoff_landing == "device"

        def make(kind: str, i: int) -> _Replica:
            sim = Simulator(model_config, device, engine_args, seed=seed + i,
                            imports_on_device=on_device)  # fmt: skip
            return _Replica(kind, i, sim)

        self.colocated = [make("colocated", i) for i in range(num_colocated)]
        self.prefill = [make("prefill", i) for i in range(num_prefill)]
        self.decode = [make("decode", i) for i in range(num_decode)]
        self.replicas = self.colocated + self.prefill + self.decode
        self.link_bytes_per_s = link_bytes_per_s
        self.streaming = streaming
        # Each replica's own link, one way: when a prefill replica's sending side and a decode
        # replica's receiving side are next free (hand-offs share them first come, first
        # served; `_send`). Reset by each `run`.
        self._out_free: list[float] = []
        self._in_free: list[float] = []

    def _send(self, src: int, dst: int, ready_s: float, num_bytes: int) -> tuple[float, float]:
        """Send `num_bytes` from prefill replica `src` to decode replica `dst`, ready at
        `ready_s`: the bytes go when both ends' links are free (after what each already
        carries: a replica's link, a GPU's own NIC or NVLink ports, is shared by its
        hand-offs) and take `num_bytes` over the link's bandwidth; returns when the first
        byte leaves and when the last lands. Nothing to send lands at once."""
        if not num_bytes:
            return ready_s, ready_s
        start_s = max(ready_s, self._out_free[src], self._in_free[dst])
        end_s = start_s + num_bytes / self.link_bytes_per_s
        self._out_free[src] = self._in_free[dst] = end_s
        return start_s, end_s

    def transfer_bytes(self, prompt_len: int) -> int:
        """KV of the prompt at every plane of the decode replica's layout."""
        sim = self.decode[0].sim
        return prompt_len * sim.kv.num_planes * sim.shape.kv_bytes_per_token_per_depth

    def run(self, workload: list[SimRequest]) -> ClusterRun:
        arrivals = sorted(enumerate(workload), key=lambda x: (x[1].arrival_s, x[0]))
        arrivals.reverse()  # pop() from the end
        by_id = {sim.request_id: (order, sim) for order, sim in enumerate(workload)}
        records = {
            s.request_id: RequestRecord(s.request_id, s.prompt_len, s.output_len, s.arrival_s)
            for s in workload
        }
        produced: dict[str, list[tuple[str, int, int]]] = {s.request_id: [] for s in workload}
        # (end_s, seq, request_id, dst, chunk bytes): a streamed chunk, or (0) a hand-off
        landing: list[tuple[float, int, str, int, int]] = []
        seq = itertools.count()
        transfers: list[Transfer] = []
        handoff: dict[str, int] = {}
        first_token: dict[str, tuple[int, int]] = {}  # request id -> (token id, loops)
        # Streaming: request id -> [first send start, its link free at, bytes sent so far,
        # the decode replica it goes to (chosen with its first chunk, which it reserves)].
        streams: dict[str, list] = {}
        clock = 0.0
        entry = self.colocated or self.prefill
        self._out_free, self._in_free = [0.0] * len(self.prefill), [0.0] * len(self.decode)
        while True:
            busy = [r for r in self.replicas if r.busy]
            next_step = min((r.free_s for r in busy), default=math.inf)
            next_arrival = arrivals[-1][1].arrival_s if arrivals else math.inf
            next_landing = landing[0][0] if landing else math.inf
            if min(next_step, next_arrival, next_landing) == math.inf:
                break
            if next_arrival <= next_step and next_arrival <= next_landing:
                order, sim = arrivals.pop()
                replica = _least_loaded(entry)
                if self.prefill:
                    sim = dataclasses.replace(sim, output_len=1, exit_trace=sim.exit_trace[:1])
                request = replica.sim.make_request(sim, order, sim.arrival_s)
                self._deliver(replica, sim.arrival_s)
                replica.sim.core.add_request(request)
                continue
            if next_landing <= next_step:
                end_s, _, request_id, dst, chunk = heapq.heappop(landing)
                if chunk:  # written into the decode replica's reserved blocks as it lands
                    replica = self.decode[dst]
                    write_s = replica.sim.executor.write_streamed(request_id, chunk)
                    start_s = max(replica.free_s, end_s)
                    replica.free_s = start_s + write_s
                    replica.held_s += replica.free_s - start_s
                    continue
                order, sim = by_id[request_id]
                replica = self.decode[dst]
                request = replica.sim.make_request(sim, order, sim.arrival_s)
                token_id, loops = first_token[request_id]
                request.output_token_ids.append(token_id)
                request.exit_depths.append(loops)
                self._deliver(replica, end_s)
                replica.sim.scheduler.add_imported(request)
                continue
            replica = min(busy, key=lambda r: (r.free_s, self.replicas.index(r)))
            result = replica.sim.core.step()
            if result.output is None:
                assert result.error is not None
                raise result.error
            if result.scheduled.is_empty:
                raise RuntimeError("the scheduler planned an empty step with work pending")
            replica.free_s += result.output.stats.model_time_s + replica.sim.host_time_s
            now = replica.free_s
            clock = max(clock, now)
            if self.streaming and replica.kind == "prefill":
                self._stream_chunks(result.scheduled.items, replica, now, streams, landing, seq)
            for request in result.touched:
                rid = request.request_id
                record = records[rid]
                # Every token this step appended (a speculating request may append several).
                new = max(len(request.output_token_ids) - len(record.token_times_s), 1)
                record.token_times_s.extend([now] * new)
                runs = produced[rid]
                if runs and runs[-1][:2] == (replica.kind, replica.index):
                    runs[-1] = (replica.kind, replica.index, runs[-1][2] + new)
                else:
                    runs.append((replica.kind, replica.index, new))
                if not request.is_finished:
                    continue
                if replica.kind == "prefill" and record.output_len > 1:
                    first_token[rid] = (request.output_token_ids[0], request.exit_depths[0])
                    num_bytes = self.transfer_bytes(request.num_prompt_tokens)
                    if rid in streams:  # the chunks already on their way
                        start_s, link_free_s, sent, dst, sends = streams.pop(rid)
                    else:
                        start_s, link_free_s, sent, sends = None, now, 0, []
                        dst = _least_loaded_after(self.decode, landing)
                    rest = num_bytes - sent
                    sent_s, end_s = self._send(replica.index, dst, max(link_free_s, now), rest)
                    if start_s is None:  # a whole hand-off: it starts when its link is free
                        start_s = sent_s
                    # Link time before the first token: the chunks' sends, up to now.
                    hidden_s = sum(max(0.0, min(end, now) - begin) for begin, end in sends)
                    transfers.append(
                        Transfer(rid, replica.index, dst, num_bytes, start_s, end_s, end_s - now,
                                 num_bytes / self.link_bytes_per_s, hidden_s)
                    )  # fmt: skip
                    heapq.heappush(landing, (end_s, next(seq), rid, dst, 0))
                    handoff[rid] = 0  # the gap between tokens 1 and 2
                else:
                    record.finished_s = now
                    record.exit_depths = list(request.exit_depths)
        return ClusterRun(list(records.values()), transfers, clock, handoff, produced)

    def _stream_chunks(
        self, items, replica: _Replica, now: float, streams: dict, landing: list, seq
    ) -> None:
        """Send the K/V that this prefill step of `replica` made final, plane by plane as
        the engine's `KVStreamOut` does (`StepRules.plane_final_depth`: a prompt chunk's
        plane d once it ran depth d under LAST_EXITED, the rest when it ran its last depth),
        after the request's earlier sends and what else its link carries; each lands on the
        decode replica chosen with the request's first chunk."""
        rules, total = replica.sim.executor.rules, replica.sim.kv.num_planes
        for item in items:
            if item.kind is not ItemKind.PROMPT:
                continue
            final_depth = rules.final_prompt_depth(item)
            ran = range(item.depth, item.depth + item.num_depths)
            planes = sum(rules.plane_final_depth(p, final_depth) in ran for p in range(total))
            if not planes:
                continue
            num_bytes = self.transfer_bytes(item.token_count) * planes // total
            stream = streams.get(item.request_id)
            if stream is None:
                dst = _fewest_streams(self.decode, landing, streams)
                stream = streams[item.request_id] = [now, now, 0, dst, []]
            send = self._send(replica.index, stream[3], max(stream[1], now), num_bytes)
            stream[1] = send[1]
            stream[2] += num_bytes
            stream[4].append(send)
            heapq.heappush(landing, (stream[1], next(seq), item.request_id, stream[3], num_bytes))

    @staticmethod
    def _deliver(replica: _Replica, at_s: float) -> None:
        if not replica.busy:
            replica.free_s = max(replica.free_s, at_s)


def _in_flight(num_decode: int, landing: list, streams: dict | None = None) -> list[int]:
    """Hand-offs in flight per decode replica: each request once, however many of its
    chunks are on their way, with `streams` also those whose chunks have all landed but
    whose first token is not out yet."""
    dst_of = {request_id: dst for _, _, request_id, dst, _ in landing}
    dst_of.update((request_id, stream[3]) for request_id, stream in (streams or {}).items())
    counts = [0] * num_decode
    for dst in dst_of.values():
        counts[dst] += 1
    return counts


def _fewest_streams(decode: list[_Replica], landing: list, streams: dict) -> int:
    """Decode replica for a streamed hand-off's reservation, as the engine's router picks it
    (`Router.choose_handoff`): the fewest streamed hand-offs in flight (chunks on their way
    or a hand-off not yet landed), then the least outstanding work."""
    counts = _in_flight(len(decode), landing, streams)
    return min(range(len(decode)), key=lambda i: (counts[i], decode[i].outstanding_work(), i))


def _least_loaded_after(decode: list[_Replica], landing: list) -> int:
    """Decode replica with the least outstanding work, counting hand-offs still in flight
    (a streamed request once, however many of its chunks are)."""
    counts = _in_flight(len(decode), landing)
    return min(range(len(decode)), key=lambda i: (decode[i].outstanding_work(), counts[i], i))
