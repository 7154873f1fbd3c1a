"""A request's state leaving or entering this runner for prefill/decode disaggregation: the
K/V a hand-off or a streamed chunk carries, and what the runner keeps of a request besides.

`HandoffKV` copies only; what moves is decided above it (`engine/handoff.py`,
`engine/kv_stream.py`): a whole hand-off's blocks of every plane (`export_request`), a
streamed chunk's blocks of some planes (`export_blocks`), a chunk written into blocks a
reservation holds (`write_blocks`), and a handed-off request's state staged until the
scheduler admits it (`stage_import`). K/V tensors are plane-major: `[layers, K/V,
planes * blocks, block_size, kv_heads, head_dim]`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from loopserve.contracts import KVHandle, KVTransfer, SwapKind
from loopserve.runner.handles import HandleTable
from loopserve.runner.loop_calls import LoopCalls
from loopserve.runner.sampler import generator_state
from loopserve.runner.swap import InFlight, KVMoves


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

    def export_request(
        self, handle: KVHandle, *, to_host: bool = True, first_block: int = 0
    ) -> tuple[torch.Tensor, bytes | None]:
        """A copy of the K/V `handle` names (every plane, see `KVMoves.export`; from block
        `first_block` of each plane on) and the request's generator state (None when greedy);
        nothing of it may be in flight."""
        request_id = handle.request_id
        assert not self.inflight.handles_of(request_id), f"{request_id} has work in flight"
        kv = self.export_blocks(handle, first_block, to_host=to_host)
        return kv, generator_state(self.samplers[request_id][1])

    def export_blocks(
        self,
        handle: KVHandle,
        first_block: int,
        *,
        to_host: bool = True,
        planes: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """A copy of blocks `[first_block, ...)` of every plane (or of `planes`, in that order)
        that cover the positions `handle` names as written (a streamed hand-off's chunk: a
        prompt's blocks are final in a plane once the depth that writes it ran,
        `StepRules.plane_final_depth`, also while later chunks still run)."""
        tables = handle.block_tables
        chosen = tables if planes is None else tuple(tables[p] for p in planes)
        table = tuple(plane[first_block:] for plane in chosen)
        positions = handle.num_positions - first_block * self.moves.block_size
        return self.moves.export(table, positions, to_host=to_host)

    @staticmethod
    def drop_leading_blocks(kv: torch.Tensor, num_blocks: int, count: int) -> torch.Tensor:
        """`kv` (`num_blocks` blocks of each plane, plane-major, as `export_blocks` makes it)
        without the first `count` blocks of each plane."""
        if count == 0:
            return kv
        planes = kv.shape[2] // num_blocks
        split = kv.unflatten(2, (planes, num_blocks))[:, :, :, count:]
        return split.flatten(2, 3)

    def write_blocks(self, request_id: str, kv: torch.Tensor, block_ids: list[list[int]]) -> None:
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
        kv: torch.Tensor,
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
