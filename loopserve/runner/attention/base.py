"""The contract every paged attention backend keeps with the model runner.

A backend owns no K/V of its own: the runner allocates one cache tensor
`[num_layers, 2, num_slots, num_kv_heads, head_dim]` (`slot = block_id * block_size +
position % block_size`) and hands it to the backend at construction. Per core call the runner
describes the call's rows as `RowSegment`s, in row order: one segment per item (a decode token
is a one-row segment, a prompt chunk a multi-row one), each with the block table of the plane
its rows read and write (the plane of the item's depth under LAST_EXITED, plane 0 under
SHARED). Rows of one call may belong to different requests, planes and positions.

`prepare(segments)` builds whatever the backend needs once per core call and returns the
object the model calls per layer (`attend(layer_idx, query, key, value)`, see
`loopserve.models.attention`): it writes every row's K/V to its slot first, then each row
attends causally to positions `<= its own` of its plane. `finalize(src_slots, dst_slots)` is
the LAST_EXITED copy after early exits: slot `src_slots[i]`'s K/V of every layer is copied to
`dst_slots[i]`, for every exiting row at once.

Cascade attention (`cascade=True`, backends with `supports_cascade`): one-row items whose
tables start with the same blocks (prefix-cache hits; `prefix_groups.plan_prefix_groups`)
read that shared prefix once per group; the result is the same attention, merged exactly.

Backends are chosen by name through `loopserve.runner.attention.registry`; this module does
no kernel work.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loopserve.models.attention import AttentionBackend
from loopserve.runner.attention.prefix_groups import CascadeStats
from loopserve.runner.transfers import Transfers


@dataclass(frozen=True, slots=True)
class RowSegment:
    """Consecutive rows of one item: positions [start, start+count) in one plane. `hidden`:
    earlier positions a one-row item may not attend although they are in its context (a
    family whose lookup hides positions that never ran this step; only the torch backend
    reads it)."""

    block_table: list[int]
    start: int
    count: int
    hidden: tuple[int, ...] = ()


class PagedAttentionBackend(ABC):
    """Paged attention over per-depth planes of one engine's KV cache tensor."""

    name: str = "abstract"
    # Whether `prepare` runs cascade attention for rows sharing leading blocks when asked
    # (`cascade=True`); a backend without it attends every row over its whole context.
    supports_cascade: bool = False

    def __init__(
        self,
        kv_cache: torch.Tensor,
        *,
        block_size: int,
        scale: float,
        cascade: bool = False,
        transfers: Transfers | None = None,
    ) -> None:
        """`transfers`: the runner's copy counter; a backend sends its per-call metadata
        through it (the Triton backend in one staged copy)."""
        # [num_layers, 2, num_slots, num_kv_heads, head_dim]
        assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2, kv_cache.shape
        assert kv_cache.shape[2] % block_size == 0
        self.transfers = transfers or Transfers(kv_cache.device)
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.scale = scale
        self.cascade = cascade and self.supports_cascade
        self.cascade_stats = CascadeStats()  # groups formed, counted once per core call

    @abstractmethod
    def prepare(
        self, segments: Sequence[RowSegment], *, prefix_groups: list | None = None
    ) -> AttentionBackend:
        """Per-call state for these rows; its `attend` writes the rows' K/V then attends.
        `prefix_groups`: the cascade groups of the call's one-row segments when the caller
        already found them (`plan_prefix_groups`); None: the backend finds them."""

    @abstractmethod
    def finalize(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy K and V of every layer from `src_slots[i]` to `dst_slots[i]` (int64 [n])."""


def write_slots_of(segments: Sequence[RowSegment], block_size: int) -> list[int]:
    """The slot each row of the call writes, in row order."""
    slots: list[int] = []
    for seg in segments:
        table = seg.block_table
        slots.extend(
            table[position // block_size] * block_size + position % block_size
            for position in range(seg.start, seg.start + seg.count)
        )
    return slots


def finalize_slots(
    exits: Sequence[tuple[tuple[list[int], ...], int, int]], block_size: int, num_planes: int
) -> tuple[list[int], list[int]]:
    """Source and destination slots of LAST_EXITED finalize copies: for each exit
    `(block tables of every plane, position, exit depth)`, the slot of the position in the
    exit depth's plane, copied into every deeper plane."""
    src: list[int] = []
    dst: list[int] = []
    for table, position, depth in exits:
        block, offset = divmod(position, block_size)
        source = table[depth][block] * block_size + offset
        for plane in range(depth + 1, num_planes):
            src.append(source)
            dst.append(table[plane][block] * block_size + offset)
    return src, dst
