"""KV moves: host swap space for preempted requests, and hand-off export/import copies.

The scheduler decides what moves (`KVTransfer`: block id pairs, all planes of a request);
this room only copies. Host blocks live in one tensor shaped like the device cache
`[layers, K/V, host_blocks * block_size, kv_heads, head_dim]` (pinned when the device is
CUDA, so copies can use DMA). Hidden states of the request's paused work (a decode token
between loops, prompt chunks between depths) move with it, under the same handles, so the
request resumes exactly where it stopped. Transfers run in the order given, before the
step's core calls: a device block freed by a swap-out may be reused by a later transfer or
by this step's rows. A prompt group's fork copies device blocks to device blocks.

Prefill/decode hand-offs: `SwapSpace.export_blocks` gathers a request's blocks of every
plane into one tensor (`HandoffKV`, handoff_kv.py, decides which); in `KVMoves` a
handed-off request's K/V waits in `staged_imports` until the scheduler admits it with a
`KVTransfer(IMPORT)` (its block ids in this cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loopserve.contracts import KVTransfer, PendingHostKV, SwapKind
from loopserve.runner.decode_slots import DecodeSlots
from loopserve.runner.handles import HandleTable


@dataclass(frozen=True)
class LandedKV:
    """A hand-off's (or chunk's) K/V moved toward the cache's device before its import
    (`HandoffKV.land`): on the device, copied on a side stream that records `ready`, or on
    the host (pinned on CUDA) with `ready` None."""

    tensor: torch.Tensor
    ready: torch.cuda.Event | None = None

    def on(self, device: torch.device) -> torch.Tensor:
        """The K/V on `device`, for the current stream: a landed tensor once that stream has
        waited for its copy (in stream order: the host does not wait), else copied now
        (without blocking the host when pinned)."""
        if self.ready is not None:
            stream = torch.cuda.current_stream(device)
            stream.wait_event(self.ready)
            self.tensor.record_stream(stream)  # the side stream's memory is used here too
            return self.tensor
        return self.tensor.to(device, non_blocking=self.tensor.is_pinned())


@dataclass
class InFlight:
    """Work paused between steps: its carried state [rows, W] after its last loop, plus, for the chunk
    holding the last prompt position, that row's hazards, and the outputs of every depth so
    far: that row's, or every row's for a chunk scored at its exit loops (`score_rule`)."""

    hidden: torch.Tensor
    hazards: list[float] = field(default_factory=list)
    loop_outputs: list[torch.Tensor] = field(default_factory=list)


class SwapSpace:
    def __init__(self, kv_cache: torch.Tensor, num_host_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.device_cache = kv_cache
        shape = (*kv_cache.shape[:2], num_host_blocks * block_size, *kv_cache.shape[3:])
        pin = kv_cache.device.type == "cuda"
        # Allocated on first use: most engines never swap.
        self._shape, self._pin = shape, pin
        self._host: torch.Tensor | None = None
        # Swap-outs copied to pinned staging, not yet scattered into `host_cache`.
        self._pending_out: list[tuple[torch.cuda.Event | None, torch.Tensor, torch.Tensor]] = []
        self.num_bytes_out = 0
        self.num_bytes_in = 0
        # Hand-off imports and chunk writes whose K/V was landed before (`HandoffKV.land`),
        # and those that came as a plain tensor (copied on the engine thread).
        self.num_imports_landed = 0
        self.num_imports_unlanded = 0

    @property
    def host_cache(self) -> torch.Tensor:
        if self._host is None:
            self._host = torch.empty(
                self._shape, dtype=self.device_cache.dtype, pin_memory=self._pin
            )
        return self._host

    def _blocks(self, cache: torch.Tensor) -> torch.Tensor:
        # [layers, K/V, blocks, block_size, kv_heads, head_dim]
        return cache.view(*cache.shape[:2], -1, self.block_size, *cache.shape[3:])

    def copy(self, transfer: KVTransfer) -> None:
        """Device <-> host block copies without a pageable bounce or a wait on the device.

        Out: the blocks are gathered on the device and copied, non-blocking, into a pinned
        staging tensor; the scatter into the host cache happens when the host cache is next
        read (`settle`), by which time the copy has long finished. In: the blocks are
        gathered on the host (pinned) and copied, non-blocking, to the device, where they are
        scattered in stream order before the step's core calls. On CPU both are plain
        copies."""
        if not transfer.block_moves:
            return
        src_ids, dst_ids = zip(*transfer.block_moves)
        if transfer.kind is SwapKind.OUT:
            index = torch.tensor(src_ids, dtype=torch.int64, device=self.device_cache.device)
            gathered = self._blocks(self.device_cache)[:, :, index]
            staging, event = self._copy_to_host(gathered)
            self._pending_out.append((event, staging, torch.tensor(dst_ids, dtype=torch.int64)))
            if not self._pin:
                self.settle()
            self.num_bytes_out += staging.numel() * staging.element_size()
            return
        self.settle()
        host = self._blocks(self.host_cache)
        index = torch.tensor(src_ids, dtype=torch.int64)
        staging = torch.empty(
            (*host.shape[:2], len(src_ids), *host.shape[3:]), dtype=host.dtype, pin_memory=self._pin
        )
        torch.index_select(host, 2, index, out=staging)
        moved = staging.to(self.device_cache.device, non_blocking=self._pin)
        dst_index = torch.tensor(dst_ids, dtype=torch.int64).to(
            self.device_cache.device, non_blocking=self._pin
        )
        self._blocks(self.device_cache)[:, :, dst_index] = moved
        self.num_bytes_in += moved.numel() * moved.element_size()

    def export_blocks(
        self,
        table: tuple[list[int], ...],
        num_positions: int,
        *,
        to_host: bool = True,
        pending: bool = False,
    ) -> torch.Tensor | PendingHostKV:
        """A copy of the K/V of positions [0, num_positions) of every plane of `table`
        (whole blocks, plane-major), on the CPU or, with `to_host=False`, on the cache's
        device (a gathered tensor of its own, for a transport that sends device memory).
        `pending` (to the host): a `PendingHostKV` instead, the host not waiting for the copy
        (on CUDA: into pinned memory, non-blocking, an event recorded after it)."""
        blocks = -(-num_positions // self.block_size)
        ids = [plane[i] for plane in table for i in range(blocks)]
        index = torch.tensor(ids, dtype=torch.int64, device=self.device_cache.device)
        kv = self._blocks(self.device_cache)[:, :, index]  # advanced indexing: a new tensor
        if not to_host:
            return kv
        if not pending:
            return kv.to("cpu", copy=True)
        return PendingHostKV(*self._copy_to_host(kv))

    def _copy_to_host(self, gathered: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A host copy of `gathered` (device blocks) that the host does not wait for: on CUDA
        into pinned memory, non-blocking and stream-ordered after the steps that wrote the
        blocks, with an event recorded after it (wait for it before reading the copy); on
        CPU a finished copy and no event."""
        staging = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=self._pin)
        staging.copy_(gathered, non_blocking=self._pin)
        if not self._pin:
            return staging, None
        done = torch.cuda.Event()
        done.record()
        return staging, done

    def check_import(self, kv: torch.Tensor | LandedKV) -> None:
        """A handed-off K/V tensor must have this cache's layers, block size, heads, dtype."""
        if isinstance(kv, LandedKV):
            kv = kv.tensor
        cache = self.device_cache
        expected = (*cache.shape[:2], self.block_size, *cache.shape[3:])
        shape = (*kv.shape[:2], *kv.shape[3:])
        if kv.dtype != cache.dtype:
            raise ValueError(
                f"hand-off K/V stored as {kv.dtype} does not fit this cache ({cache.dtype}): "
                "the prefill and decode replicas need the same dtype and kv_cache_dtype"
            )
        if shape != expected:
            raise ValueError(f"hand-off K/V {tuple(kv.shape)} does not fit this cache")

    def import_blocks(self, kv: torch.Tensor | LandedKV, transfer: KVTransfer) -> None:
        """Write a handed-off request's blocks (`kv`, as `export_blocks` made it, or landed)
        into the device blocks `transfer` names."""
        if not transfer.block_moves:
            return
        device = self.device_cache.device
        src_ids, dst_ids = zip(*transfer.block_moves)
        if isinstance(kv, LandedKV):
            self.num_imports_landed += 1
            kv = kv.on(device)
        else:
            self.num_imports_unlanded += 1
        src = kv[:, :, torch.tensor(src_ids, dtype=torch.int64, device=kv.device)].to(device)
        dst_index = torch.tensor(dst_ids, dtype=torch.int64, device=device)
        self._blocks(self.device_cache)[:, :, dst_index] = src

    def copy_on_device(self, transfer: KVTransfer) -> None:
        """Device block to device block, every layer (a prompt group's fork)."""
        if not transfer.block_moves:
            return
        src_ids, dst_ids = zip(*transfer.block_moves)
        device = self.device_cache.device
        blocks = self._blocks(self.device_cache)
        src = torch.tensor(src_ids, dtype=torch.int64, device=device)
        blocks[:, :, torch.tensor(dst_ids, dtype=torch.int64, device=device)] = blocks[:, :, src]

    def settle(self) -> None:
        """Finish pending swap-outs: wait for each one's copy (long done by now) and scatter
        its staging tensor into the host cache."""
        host = self._blocks(self.host_cache) if self._pending_out else None
        for event, staging, dst_index in self._pending_out:
            if event is not None:
                event.synchronize()
            host[:, :, dst_index] = staging
        self._pending_out.clear()


class KVMoves:
    """Every copy of a request's K/V (and paused work) out of or into the device cache."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_host_blocks: int,
        block_size: int,
        inflight: HandleTable[InFlight],
    ) -> None:
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.inflight = inflight
        self.swap = SwapSpace(kv_cache, num_host_blocks, block_size)
        # Hidden states of swapped-out requests: request_id -> handle -> state (on the host),
        # and the state of the decode token each had in flight.
        self.swapped_inflight: dict[str, dict[int, InFlight]] = {}
        self.swapped_decode: dict[str, dict[str, torch.Tensor]] = {}
        # Handed-off requests not yet admitted: request_id -> (K/V blocks, generator state,
        # the runner's per-request state, `LoopCalls.export_state`).
        self.staged_imports: dict[
            str, tuple[torch.Tensor | LandedKV, bytes | None, dict | None]
        ] = {}

    def stage_import(
        self,
        request_id: str,
        kv: torch.Tensor | LandedKV,
        generator_state: bytes | None,
        runner_state: dict | None = None,
    ) -> None:
        self.swap.check_import(kv)
        self.staged_imports[request_id] = (kv, generator_state, runner_state)

    def drop(self, request_id: str) -> None:
        self.swapped_inflight.pop(request_id, None)
        self.swapped_decode.pop(request_id, None)
        self.staged_imports.pop(request_id, None)

    def apply(self, transfer: KVTransfer, decode: DecodeSlots) -> None:
        """Copy the blocks, and move the request's paused work with them: its handles' states
        (same handles) and its decode token's state (a new slot when it comes back)."""
        request_id = transfer.request_id
        if transfer.kind is SwapKind.IMPORT:
            self._import(transfer)
            return
        if transfer.kind is SwapKind.FORK:
            self.swap.copy_on_device(transfer)
            return
        self.swap.copy(transfer)
        if transfer.kind is SwapKind.OUT:
            handles = self.inflight.handles_of(request_id)
            states = {h: self.inflight.resume(h) for h in handles if h in self.inflight}
            self.inflight.release(request_id)
            self.swapped_inflight[request_id] = {
                h: InFlight(s.hidden.cpu(), s.hazards, [r.cpu() for r in s.loop_outputs])
                for h, s in states.items()
            }
            token = decode.take_state(request_id)
            if token is not None:
                self.swapped_decode[request_id] = {k: v.cpu() for k, v in token.items()}
            return
        device = self.kv_cache.device
        for handle, state in self.swapped_inflight.pop(request_id).items():
            hidden = state.hidden.to(device)
            rows = [r.to(device) for r in state.loop_outputs]
            self.inflight.keep(request_id, handle, InFlight(hidden, state.hazards, rows))
        token = self.swapped_decode.pop(request_id, None)
        if token is not None:
            decode.put_state(request_id, {k: v.to(device) for k, v in token.items()})

    def _import(self, transfer: KVTransfer) -> None:
        kv = self.staged_imports.pop(transfer.request_id)[0]
        self.swap.import_blocks(kv, transfer)
