"""`DecodeSlots`: the runner's persistent decode state, one slot per request decoding.

A slot holds, between loops, the in-flight token's carried state (a row of `hidden
[slots + 1, W]`, W the family's `state_width`), its criterion's fields when the family's exit
signal is a convergence criterion (`loop_calls.CriterionSlots`), and the request's device
block tables per plane (`tables [(slots + 1) * planes, max_blocks]`, loop planes then once
planes). The extra slot is the padding slot of the decode graphs: its tables hold only the
padding block. Tables are written incrementally (`table_updates`: only the entries a row's
tables gained, a new block every `block_size` positions). A request gets a slot at its first
decode row (loop 0) and keeps it until it is released (finished, preempted) or swapped out
(`take_state` / `put_state`: its state moves with its K/V). `runner/decode_rows.py` turns a
call's rows into device work over these slots.
"""

from __future__ import annotations

import numpy as np
import torch

from loopserve.contracts import DecodeRows
from loopserve.runner.loop_calls import CriterionSlots


class DecodeSlots:
    """Slots of the persistent decode batch (see the module docstring)."""

    def __init__(
        self,
        capacity: int,
        *,
        hidden_size: int,
        num_planes: int,
        block_size: int,
        max_blocks: int,
        padding_block: int,
        dtype: torch.dtype,
        device: torch.device,
        once_planes: int = 0,
    ) -> None:
        """`num_planes`: the loop planes; `once_planes`: the planes after them that keep a
        family's once-per-position K/V (its prelude's and coda's)."""
        self.capacity = capacity
        self.num_planes = num_planes
        self.stride = num_planes + once_planes  # table rows per slot
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.padding_slot = capacity
        self.padding_row = capacity * self.stride  # plane 0 of the padding slot
        self.hidden = torch.zeros(capacity + 1, hidden_size, dtype=dtype, device=device)
        # [(slots + 1) * stride, max_blocks]; row slot * stride + plane
        self.tables = torch.full(
            ((capacity + 1) * self.stride, max_blocks),
            padding_block,
            dtype=torch.int64,
            device=device,
        )
        self.written = np.zeros(capacity, np.int64)  # table entries written, every plane
        self.slot_of: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self.criterion: CriterionSlots | None = None  # set by a criterion family's runner

    def __len__(self) -> int:
        return len(self.slot_of)

    def _take(self, request_id: str) -> int:
        if not self._free:
            raise RuntimeError(f"no free decode slot ({self.capacity} requests decoding)")
        slot = self._free.pop()
        self.slot_of[request_id] = slot
        return slot

    def assign(self, rows: DecodeRows) -> np.ndarray:
        """Each row's slot; a request's first row (loop 0) takes a free one."""
        slot_of = self.slot_of
        slots = [slot_of.get(request_id, -1) for request_id in rows.request_ids]
        if -1 in slots:
            for i, slot in enumerate(slots):
                if slot != -1:
                    continue
                request_id = rows.request_ids[i]
                if rows.depths[i] != 0:
                    raise RuntimeError(
                        f"{request_id}: resumes loop {rows.depths[i]} of a decode token the "
                        "runner never kept"
                    )
                slots[i] = self._take(request_id)
        return np.array(slots, np.int64)

    def release(self, request_id: str) -> int | None:
        """Free the request's slot (its state and tables are forgotten)."""
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.written[slot] = 0
            self._free.append(slot)
        return slot

    def take_state(self, request_id: str) -> dict[str, torch.Tensor] | None:
        """Swap-out: the request's in-flight token (its carried state [W] under "hidden",
        its criterion's fields), copies, its slot released."""
        slot = self.slot_of.get(request_id)
        if slot is None:
            return None
        state = {"hidden": self.hidden[slot].clone()}
        if self.criterion is not None:
            state.update(self.criterion.take(slot))
        self.release(request_id)
        return state

    def put_state(self, request_id: str, state: dict[str, torch.Tensor]) -> None:
        """Swap-in: a new slot holding the request's in-flight token."""
        slot = self._take(request_id)
        saved = dict(state)
        self.hidden[slot].copy_(saved.pop("hidden"))
        if self.criterion is not None:
            self.criterion.put(slot, saved)

    def table_updates(
        self, slots: np.ndarray, positions: np.ndarray, request_ids, block_tables
    ) -> tuple[list[int], list[int]]:
        """(flat indices into `tables`, block ids) of the entries the rows' tables gained
        since they were last written: blocks up to each row's position, every plane."""
        needed = positions // self.block_size + 1
        stale = (self.written[slots] < needed).nonzero()[0]
        index: list[int] = []
        values: list[int] = []
        width, stride = self.max_blocks, self.stride
        for i in stale.tolist():  # host array
            slot = int(slots[i])
            start, end = int(self.written[slot]), int(needed[i])
            # Every plane the slot has rows for: loop planes, then once planes.
            for plane, blocks in enumerate(block_tables[request_ids[i]][:stride]):
                base = (slot * stride + plane) * width
                index.extend(range(base + start, base + end))
                values.extend(blocks[start:end])
            self.written[slot] = end
        return index, values
