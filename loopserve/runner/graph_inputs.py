"""The static input buffers of the decode graphs: their layout and how a call fills them.

A graphed decode step (`runner/graphs.py`) reads everything it needs from one int64 buffer
per row bucket B, so a call costs one host-to-device copy in: `NUM_COLUMNS` columns of B
entries (slots, positions, table rows, tokens, loop-0 flags, exit codes, then the CDF,
survival and threshold as float64 bits, then the coda candidates and the rows that read their
exit signal), followed by U new table
entries (flat index into the decode tables, block id; U = `update_capacity(B, planes)`).
`BucketInputs` is that buffer on the device with its named views; `HostBuffers` builds its
host image for a call: a copy of the bucket's padding template (padding rows use the padding
slot, whose tables hold only the dummy block; they embed token 0 and never exit; unused
table entries rewrite the padding row's first entry with the dummy block) with the call's
rows written over its leading entries.
"""

from __future__ import annotations

import numpy as np
import torch

from loopserve.contracts import DecodeRows
from loopserve.runner.decode_rows import HostColumns
from loopserve.runner.decode_slots import DecodeSlots

# Columns of a bucket's static input buffer, each B entries long.
(SLOTS, POSITIONS, TABLE_INDEX, TOKENS, STARTS, CODES, CDF, SURVIVAL, THRESHOLD, CANDIDATES,
 NEEDS_GATE) = range(11)  # fmt: skip
NUM_COLUMNS = 11


def update_capacity(bucket: int, num_planes: int) -> int:
    """Table entries a call of `bucket` rows carries in its static buffer: every row entering
    a new block on every plane, twice over, plus 64 (a new slot writes its whole table)."""
    return 2 * bucket * num_planes + 64


class BucketInputs:
    """A bucket's static input buffer on the device and its named views."""

    def __init__(self, bucket: int, capacity: int, device: torch.device) -> None:
        self.bucket, self.capacity = bucket, capacity
        self.buffer = torch.zeros(NUM_COLUMNS * bucket + 2 * capacity, dtype=torch.int64,
                                  device=device)  # fmt: skip
        self.columns = self.buffer[: NUM_COLUMNS * bucket].view(NUM_COLUMNS, bucket)
        self.floats = self.columns.view(torch.float64)  # CDF, SURVIVAL, THRESHOLD rows
        self.updates = self.buffer[NUM_COLUMNS * bucket :].view(2, capacity)


class HostBuffers:
    """Host images of the buckets' buffers: padding templates, and a call's filled copy."""

    def __init__(self, slots: DecodeSlots, dummy_block: int) -> None:
        self.slots = slots
        self.dummy_block = dummy_block
        self._templates: dict[int, np.ndarray] = {}

    def padding(self, bucket: int, capacity: int) -> np.ndarray:
        """A bucket's buffer of padding rows and unused table entries (a fresh copy)."""
        template = self._templates.get(bucket)
        if template is None:
            template = np.zeros(NUM_COLUMNS * bucket + 2 * capacity, np.int64)
            columns = template[: NUM_COLUMNS * bucket].reshape(NUM_COLUMNS, bucket)
            columns[SLOTS] = self.slots.padding_slot
            columns[TABLE_INDEX] = self.slots.padding_row
            columns[STARTS] = 1
            floats = columns.view(np.float64)
            floats[SURVIVAL] = floats[THRESHOLD] = 1.0
            updates = template[NUM_COLUMNS * bucket :].reshape(2, capacity)
            updates[0] = self.slots.padding_row * self.slots.max_blocks
            updates[1] = self.dummy_block
            self._templates[bucket] = template
        return template.copy()

    def fill(
        self, bucket: int, capacity: int, rows: DecodeRows, host: HostColumns
    ) -> tuple[np.ndarray, list[int], list[int]]:
        """The host image of a call's buffer, and the table entries beyond its capacity (the
        caller writes those apart, before the launch)."""
        n = len(rows)
        buffer = self.padding(bucket, capacity)
        columns = buffer[: NUM_COLUMNS * bucket].reshape(NUM_COLUMNS, bucket)
        columns[SLOTS, :n] = host.slots
        columns[POSITIONS, :n] = rows.positions
        columns[TABLE_INDEX, :n] = host.table_index
        columns[TOKENS, :n] = rows.token_ids
        columns[STARTS, :n] = rows.depths == 0
        columns[CODES, :n] = rows.exit_code
        floats = columns.view(np.float64)
        floats[CDF, :n] = rows.cdf_before
        floats[SURVIVAL, :n] = rows.survival_before
        floats[THRESHOLD, :n] = rows.threshold
        columns[CANDIDATES, : len(host.candidates)] = host.candidates
        columns[NEEDS_GATE, :n] = rows.needs_gate
        index, values = host.update_index, host.update_value
        updates = buffer[NUM_COLUMNS * bucket :].reshape(2, capacity)
        updates[0, : min(len(index), capacity)] = index[:capacity]
        updates[1, : min(len(values), capacity)] = values[:capacity]
        return buffer, index[capacity:], values[capacity:]
