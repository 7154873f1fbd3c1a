"""K/V as the step contract names it: swaps, imports and forks of whole blocks
(`KVTransfer`), block-table updates (`TableUpdate`), a request's K/V passed on
(`KVHandle`) and an export still being copied to host memory (`PendingHostKV`). Torch-free."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple


class SwapKind(str, enum.Enum):
    OUT = "out"  # device -> host; the request's in-flight hidden states go to the host too
    IN = "in"  # host -> device; hidden states come back
    # A handed-off request (prefill/decode disaggregation): pairs (index in the K/V the
    # runner staged for it, device block); no hidden states move.
    IMPORT = "import"
    # A prompt group's fork (scheduler/groups.py): pairs (leader's device block, the
    # follower's device block): the leader's partly written last prompt block, every plane,
    # copied before either request writes it again; no hidden states move.
    FORK = "fork"


@dataclass(frozen=True)
class PendingHostKV:
    """A K/V export still being copied to host memory (`SwapSpace.export_blocks` with
    `pending=True`): on CUDA a pinned tensor that a non-blocking copy fills, whole once the
    event `done` has completed; on CPU a finished copy (`done` None). `settled()` is the
    tensor once whole: it waits for `done`, so it is called off the engine thread
    (`OutputStream` does). Torch-free here: `tensor` is a torch.Tensor, `done` a CUDA event."""

    tensor: object
    done: object = None

    def settled(self) -> object:
        if self.done is not None:
            self.done.synchronize()  # type: ignore[attr-defined]
        return self.tensor


@dataclass(frozen=True, slots=True)
class KVTransfer:
    """Swap one request: copy `block_moves` (src, dst) pairs of whole blocks (all planes) and
    move its in-flight hidden states. Transfers run in order, before the step's core calls."""

    kind: SwapKind
    request_id: str
    block_moves: tuple[tuple[int, int], ...]


class TableUpdate(NamedTuple):
    """How one request's block tables changed since the last `SchedulerOutput` (as vLLM's
    `new_block_ids`): keep the first `keep` blocks of every plane the executor holds for it
    (0: a new table, which replaces any it held), then append `new_blocks[p]` to plane p."""

    request_id: str
    keep: int
    new_blocks: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class KVHandle:
    """The K/V a request holds, as the engine passes it on (a hand-off export): opaque above
    the executor, which reads the block ids of each plane and the positions written."""

    request_id: str
    block_tables: tuple[list[int], ...]  # one block-id list per plane
    num_positions: int  # positions [0, num_positions) are written
