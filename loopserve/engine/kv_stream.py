"""Streamed prefill/decode hand-off: a request's K/V leaves its prefill engine chunk by chunk.

A whole hand-off (engine/handoff.py) moves a request's K/V of every plane after its first
token, while its user waits; for a looped model that is D planes per position. A streamed one
moves each run of prompt blocks as soon as every depth wrote it, while the engine computes the
later chunks, so only the last blocks travel after the first token:

- decode side: `LLMEngine.reserve_import` allocates the request's blocks (its prompt and first
  token, or its whole reservation) before any K/V comes; blocks its own prefix cache holds
  serve the first ones and are not sent (the count is the sender's `skip_blocks`).
  `write_kv_chunk` writes each `KVChunk` into the reserved blocks as it arrives; the final
  `import_request` (a `HandoffState` whose `first_block` says where its K/V starts) admits the
  request, and only the blocks not yet written move then. `release_import` frees a reservation
  whose request will not come (its prefill replica died): nothing half-received is ever used.
- prefill side (`KVStreamOut`, owned by the engine): `LLMEngine.stream_export(id,
  skip_blocks)` marks a request; after each step `take_kv_chunks` returns a chunk per marked
  request whose complete prompt blocks grew (a block is complete when every position in it ran
  every depth: `Request.num_prefilled_tokens`, which only moves when a chunk finishes its last
  depth, under every prompt arm). `export_request` then carries the blocks from the next unsent
  one on. A request preempted by recompute sends its blocks again from `skip_blocks` (the
  receiver's copies are overwritten: the recomputed K/V, not a mix, is what it decodes from).

Torch-free: the K/V tensors are the runner's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from loopserve.contracts import KVHandle
from loopserve.engine.handoff import KVChunk
from loopserve.scheduler.request import RequestStatus

if TYPE_CHECKING:
    from loopserve.runner.model_runner import ModelRunner
    from loopserve.scheduler.scheduler import Scheduler


@dataclass
class _Outgoing:
    skip_blocks: int  # blocks per plane the receiver has (its prefix cache): never sent
    next_block: int  # the first block per plane not sent yet
    num_preemptions: int  # the request's count when `next_block` was last valid


class KVStreamOut:
    """The prefill side of streamed hand-offs (see the module docstring)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._streams: dict[str, _Outgoing] = {}

    def start(self, request_id: str, skip_blocks: int) -> None:
        self._streams[request_id] = _Outgoing(skip_blocks, skip_blocks, 0)

    def take(self, scheduler: Scheduler, runner: ModelRunner, *, to_host: bool) -> list[KVChunk]:
        """A chunk for each streamed request whose complete prompt blocks grew since the last
        call; requests that finished or were aborted are forgotten."""
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
            complete = request.num_prefilled_tokens // self.block_size
            if complete <= out.next_block:
                continue
            handle = KVHandle(
                request_id, scheduler.kv.tables[request_id], complete * self.block_size
            )
            kv = runner.export_blocks(handle, out.next_block, to_host=to_host)
            chunks.append(KVChunk(request_id, out.next_block, complete - out.next_block, kv))
            out.next_block = complete
        return chunks

    def finish(self, request_id: str, num_preemptions: int) -> int:
        """The request leaves (its final hand-off): the first block per plane that hand-off
        must carry (0 for a request not streamed)."""
        out = self._streams.pop(request_id, None)
        if out is None:
            return 0
        self._check_preempted(out, num_preemptions)
        return out.next_block

    @staticmethod
    def _check_preempted(out: _Outgoing, num_preemptions: int) -> None:
        if num_preemptions != out.num_preemptions:  # recomputed: send everything again
            out.next_block = out.skip_blocks
            out.num_preemptions = num_preemptions
