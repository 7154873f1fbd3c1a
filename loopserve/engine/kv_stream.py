"""Streamed prefill/decode hand-off: a request's K/V leaves its prefill engine chunk by chunk.

A whole hand-off (engine/handoff.py) moves a request's K/V of every plane after its first
token, while its user waits; for a looped model that is D planes per position. A streamed one
moves each plane's run of prompt blocks as soon as it is final, while the engine computes the
later chunks (and, for a shallow plane, the chunk's deeper depths), so only the last blocks
travel after the first token:

- decode side: `LLMEngine.reserve_import` allocates the request's blocks (its prompt and first
  token, or its whole reservation) before any K/V comes; blocks its own prefix cache holds
  serve the first ones and are not sent (the count is the sender's `skip_blocks`).
  `write_kv_chunk` writes each `KVChunk` into the reserved blocks as it arrives; the final
  `import_request` (a `HandoffState` whose `first_block` says where its K/V starts) admits the
  request, and only the blocks not yet written move then. `release_import` frees a reservation
  whose request will not come (its prefill replica died): nothing half-received is ever used.
- prefill side (`KVStreamOut`, owned by the engine): `LLMEngine.stream_export(id,
  skip_blocks)` marks a request; after each step `take_kv_chunks` returns, per marked request,
  the prompt blocks of each plane that became final since the last call. A block of a plane is
  final when every position in it ran the depth after which that plane is final
  (`StepRules.plane_final_depth`: plane d's after depth d under LAST_EXITED; SHARED's plane
  and a family's once planes after the last depth; `Request.prompt_positions_done`), so under
  the per-depth and wavefront prompt arms a chunk's shallow planes leave while it still runs
  its deeper depths, and only the last chunk's last plane waits for the first token. Planes
  whose new blocks are the same run travel as one `KVChunk` (`planes` names them; None: every
  plane, as an atomic chunk's do). `export_request` then carries the blocks from the first
  one some plane has not sent on. A request preempted by recompute sends its blocks again
  from `skip_blocks` (the receiver's copies are overwritten: the recomputed K/V, not a mix,
  is what it decodes from).

Torch-free: the K/V tensors are the runner's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from loopserve.contracts import KVHandle
from loopserve.engine.handoff import KVChunk
from loopserve.scheduler.request import RequestStatus

if TYPE_CHECKING:
    from loopserve.execution import StepRules
    from loopserve.runner.model_runner import ModelRunner
    from loopserve.scheduler.request import Request
    from loopserve.scheduler.scheduler import Scheduler


@dataclass
class _Outgoing:
    skip_blocks: int  # blocks per plane the receiver has (its prefix cache): never sent
    next_block: list[int]  # per plane, the first block not sent yet
    num_preemptions: int  # the request's count when `next_block` was last valid


class KVStreamOut:
    """The prefill side of streamed hand-offs (see the module docstring)."""

    def __init__(self, block_size: int, num_planes: int, rules: StepRules) -> None:
        self.block_size = block_size
        self.num_planes = num_planes  # every plane of a request's table, once planes included
        self.rules = rules
        self._streams: dict[str, _Outgoing] = {}

    def start(self, request_id: str, skip_blocks: int) -> None:
        self._streams[request_id] = _Outgoing(skip_blocks, [skip_blocks] * self.num_planes, 0)

    def take(
        self, scheduler: Scheduler, runner: ModelRunner, *, to_host: bool, pending: bool = False
    ) -> list[KVChunk]:
        """The chunks of each streamed request whose final prompt blocks grew in some plane
        since the last call; requests that finished or were aborted are forgotten."""
        chunks = []
        for request_id, out in list(self._streams.items()):
            request = scheduler.requests.get(request_id)
            if request is None:
                del self._streams[request_id]
                continue
            self._check_preempted(out, request.num_preemptions)
            if request.status is not RequestStatus.RUNNING or scheduler.has_pending_copy(
                request_id
            ):
                continue  # no blocks now, or a fork's copy into them still to come
            table = scheduler.kv.tables[request_id]
            for (first, end), planes in self._grown(request, out).items():
                handle = KVHandle(request_id, table, end * self.block_size)
                selected = None if len(planes) == self.num_planes else tuple(planes)
                kv = runner.handoff.export_blocks(
                    handle, first, to_host=to_host, planes=selected, pending=pending
                )
                chunks.append(KVChunk(request_id, first, end - first, kv, selected))
        return chunks

    def _grown(self, request: Request, out: _Outgoing) -> dict[tuple[int, int], list[int]]:
        """(first block, end block) -> the planes whose final blocks grew by that run, in
        plane order; `out.next_block` moves past them."""
        final_depth = self.rules.final_prompt_depth(request)
        done: dict[int, int] = {}  # depth -> complete blocks of positions that ran it
        runs: dict[tuple[int, int], list[int]] = {}
        for plane in range(self.num_planes):
            depth = self.rules.plane_final_depth(plane, final_depth)
            if depth not in done:
                done[depth] = request.prompt_positions_done(depth) // self.block_size
            first, end = out.next_block[plane], done[depth]
            if end > first:
                runs.setdefault((first, end), []).append(plane)
                out.next_block[plane] = end
        return runs

    def finish(self, request_id: str, num_preemptions: int) -> int:
        """The request leaves (its final hand-off): the first block per plane that hand-off
        must carry, the first one some plane has not sent (0 for a request not streamed)."""
        out = self._streams.pop(request_id, None)
        if out is None:
            return 0
        self._check_preempted(out, num_preemptions)
        return min(out.next_block)

    @staticmethod
    def _check_preempted(out: _Outgoing, num_preemptions: int) -> None:
        if num_preemptions != out.num_preemptions:  # recomputed: send everything again
            out.next_block = [out.skip_blocks] * len(out.next_block)
            out.num_preemptions = num_preemptions
