"""A request's state leaving or entering this runner for prefill/decode disaggregation: the
K/V a hand-off or a streamed chunk carries, and what the runner keeps of a request besides.

`HandoffKV` copies only; what moves is decided above it (`engine/handoff.py`,
`engine/kv_stream.py`): a whole hand-off's blocks of every plane (`export_request`), a
streamed chunk's blocks of some planes (`export_blocks`), a chunk written into blocks a
reservation holds (`write_blocks`), and a handed-off request's state staged until the
scheduler admits it (`stage_import`). K/V tensors are plane-major: `[layers, K/V,
planes * blocks, block_size, kv_heads, head_dim]`.

Landing (`land`): a K/V tensor that arrived in host memory (the object store, NIXL over
DRAM) is moved toward the cache's device before its import, off the engine thread (the
serving path calls it from a worker thread: `AsyncLLM.land`). On CUDA it is copied into
page-locked memory and, while free device memory allows (`LANDING_SHARE`), on to the device
on a side stream of its own, recording an event; the import then only waits for that event
in stream order and scatters the blocks within device memory, so neither the engine thread
nor the steps before it wait on the link's bytes. A tensor that stays pinned on the host is
copied without blocking the host when the import runs. On CPU landing only wraps the tensor
(`LandedKV` without an event), so the CPU path is the one it always was; `SwapSpace` counts
landed and unlanded imports either way (`num_imports_landed`, `num_imports_unlanded`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from loopserve.contracts import KVHandle, KVTransfer, PendingHostKV, SwapKind
from loopserve.runner.handles import HandleTable
from loopserve.runner.loop_calls import LoopCalls
from loopserve.runner.sampler import generator_state
from loopserve.runner.swap import InFlight, KVMoves, LandedKV

# A K/V tensor lands on the device only if it takes at most this share of the device's free
# memory at that moment (the rest is left to the engine's own transient allocations); a
# larger one stays pinned on the host and is copied, non-blocking, when it is imported.
LANDING_SHARE = 0.5


class HandoffKV:
    """The runner's side of hand-offs (see the module docstring)."""

    def __init__(
        self,
        moves: KVMoves,
        inflight: HandleTable[InFlight],
        samplers: Mapping[str, tuple],
        calls: LoopCalls,
    ) -> None:
        self.moves, self.inflight, self.samplers, self.calls = moves, inflight, samplers, calls
        self._landing_stream: torch.cuda.Stream | None = None
        self._landing_lock = threading.Lock()
        # K/V tensors landed on the device (copied there, or already there: a transport that
        # sends device memory), and left on the host (pinned: too large for the free device
        # memory; or a CPU engine).
        self.num_landed_device = 0
        self.num_landed_host = 0

    def _landed(self, landed: LandedKV) -> LandedKV:
        with self._landing_lock:
            if landed.tensor.device.type == "cpu":
                self.num_landed_host += 1
            else:
                self.num_landed_device += 1
        return landed

    def land(self, kv: object) -> object:
        """`kv` (a hand-off's or chunk's K/V tensor) moved toward the cache's device ahead of
        its import, as a `LandedKV` (see the module docstring); anything else (None inside a
        descriptor, a `LandedKV`) as it is. Thread-safe: meant for a worker thread, beside
        the engine thread's steps."""
        if not isinstance(kv, torch.Tensor):
            return kv
        device = self.moves.kv_cache.device
        if device.type != "cuda" or kv.device.type != "cpu":  # nothing to move, or no pinning
            return self._landed(LandedKV(kv))
        pinned = kv if kv.is_pinned() else kv.pin_memory()
        free_bytes, _ = torch.cuda.mem_get_info(device)
        if pinned.numel() * pinned.element_size() > LANDING_SHARE * free_bytes:
            return self._landed(LandedKV(pinned))
        with self._landing_lock:
            if self._landing_stream is None:
                self._landing_stream = torch.cuda.Stream(device)
            stream = self._landing_stream
        try:
            with torch.cuda.stream(stream):
                moved = pinned.to(device, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(stream)
        except torch.cuda.OutOfMemoryError:
            return self._landed(LandedKV(pinned))
        return self._landed(LandedKV(moved, ready))

    def export_request(
        self,
        handle: KVHandle,
        *,
        to_host: bool = True,
        first_block: int = 0,
        pending: bool = False,
    ) -> tuple[torch.Tensor | PendingHostKV, bytes | None]:
        """A copy of the K/V `handle` names (every plane, see `SwapSpace.export_blocks`; from block
        `first_block` of each plane on; `pending`: see `SwapSpace.export_blocks`) and the
        request's generator state (None when greedy); nothing of it may be in flight."""
        request_id = handle.request_id
        assert not self.inflight.handles_of(request_id), f"{request_id} has work in flight"
        kv = self.export_blocks(handle, first_block, to_host=to_host, pending=pending)
        return kv, generator_state(self.samplers[request_id][1])

    def export_blocks(
        self,
        handle: KVHandle,
        first_block: int,
        *,
        to_host: bool = True,
        planes: tuple[int, ...] | None = None,
        pending: bool = False,
    ) -> torch.Tensor | PendingHostKV:
        """A copy of blocks `[first_block, ...)` of every plane (or of `planes`, in that order)
        that cover the positions `handle` names as written (a streamed hand-off's chunk: a
        prompt's blocks are final in a plane once the depth that writes it ran,
        `StepRules.plane_final_depth`, also while later chunks still run)."""
        tables = handle.block_tables
        chosen = tables if planes is None else tuple(tables[p] for p in planes)
        table = tuple(plane[first_block:] for plane in chosen)
        positions = handle.num_positions - first_block * self.moves.block_size
        return self.moves.swap.export_blocks(table, positions, to_host=to_host, pending=pending)

    @staticmethod
    def drop_leading_blocks(
        kv: torch.Tensor | LandedKV, num_blocks: int, count: int
    ) -> torch.Tensor | LandedKV:
        """`kv` (`num_blocks` blocks of each plane, plane-major, as `export_blocks` makes it)
        without the first `count` blocks of each plane (landed: a view of the landed tensor,
        ready when it is)."""
        if count == 0:
            return kv
        if isinstance(kv, LandedKV):
            tensor = HandoffKV.drop_leading_blocks(kv.tensor, num_blocks, count)
            return LandedKV(tensor, kv.ready)  # type: ignore[arg-type]
        planes = kv.shape[2] // num_blocks
        split = kv.unflatten(2, (planes, num_blocks))[:, :, :, count:]
        return split.flatten(2, 3)

    def write_blocks(
        self, request_id: str, kv: torch.Tensor | LandedKV, block_ids: list[list[int]]
    ) -> None:
        """Write a streamed hand-off's chunk (`kv`, as `export_blocks` made it) into the blocks
        `block_ids` (one list per plane of the chunk) that this cache reserved for it."""
        self.moves.swap.check_import(kv)
        count = len(block_ids[0])
        moves = tuple(
            (p * count + i, b) for p, ids in enumerate(block_ids) for i, b in enumerate(ids)
        )
        self.moves.swap.import_blocks(kv, KVTransfer(SwapKind.IMPORT, request_id, moves))

    def export_runner_state(self, request_id: str) -> dict | None:
        """What the runner keeps of a request besides K/V and the sampler (drawn initial
        states, the `full` lookup's record: `LoopCalls.export_state`); None when nothing."""
        return self.calls.export_state(request_id)

    def stage_import(
        self,
        request_id: str,
        kv: torch.Tensor | LandedKV,
        generator_state: bytes | None,
        *,
        runner_state: object = None,
    ) -> None:
        """Hold a handed-off request's K/V, generator state and runner state until the
        scheduler admits it (`KVTransfer(IMPORT)` and its `NewRequestData`), or releases it
        (aborted first)."""
        if runner_state is not None and not isinstance(runner_state, dict):
            raise ValueError("a hand-off's runner state is export_runner_state's dict")
        self.moves.stage_import(request_id, kv, generator_state, runner_state)
