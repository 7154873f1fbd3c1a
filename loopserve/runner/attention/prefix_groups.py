"""Which one-row items of a core call share leading KV blocks: the plan of cascade attention.

Prefix caching makes requests whose prompts start with the same full pages hold the very same
physical blocks, one per plane (LAST_EXITED: loop d reads plane d, so rows at different depths
read different blocks even over the same positions). When several one-row items of one core
call (decode tokens, replay rows) read a table that starts with the same block ids, the K/V of
those positions is identical for all of them, and cascade attention reads it once for the
group instead of once per row.

Rule (the torch backend runs it, the simulator prices it; both call `plan_prefix_groups`):
rows are grouped by the first block id of the table they read; a group's shared prefix is the
longest run of leading block ids common to all its rows, cut so that every row's own position
lies after it (`num_blocks * block_size <= position`: each row sees the whole prefix and
writes only its suffix). A group needs at least `MIN_GROUP_ROWS` rows and
`MIN_PREFIX_BLOCKS` shared blocks; rows at positions before the first full block never
group. Block ids are physical, so a group never mixes planes.

Torch-free; no kernel work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

MIN_GROUP_ROWS = 2  # below this a group saves no KV read
MIN_PREFIX_BLOCKS = 1  # one full block of shared positions


class PrefixGroup(NamedTuple):
    """Rows (indices into the planner's input) that share their first `num_blocks` blocks."""

    rows: tuple[int, ...]
    num_blocks: int


def _common_blocks(first: Sequence[int], other: Sequence[int], limit: int) -> int:
    """Length of the common leading run of two tables, at most `limit`."""
    if list(first[:limit]) == list(other[:limit]):
        return limit
    count = 0
    while first[count] == other[count]:
        count += 1
    return count


def plan_prefix_groups(
    tables: Sequence[Sequence[int]], positions: Sequence[int], block_size: int
) -> list[PrefixGroup]:
    """Groups among one-row items: `tables[i]` is the block table row i reads, `positions[i]`
    its position. Rows in no group attend as usual."""
    by_first: dict[int, list[int]] = {}
    min_position = MIN_PREFIX_BLOCKS * block_size
    for index, (table, position) in enumerate(zip(tables, positions)):
        if position >= min_position:
            by_first.setdefault(table[0], []).append(index)
    groups = []
    for members in by_first.values():
        if len(members) < MIN_GROUP_ROWS:
            continue
        first = tables[members[0]]
        num_blocks = min(positions[i] for i in members) // block_size
        for index in members[1:]:
            num_blocks = _common_blocks(first, tables[index], num_blocks)
        if num_blocks >= MIN_PREFIX_BLOCKS:
            groups.append(PrefixGroup(tuple(members), num_blocks))
    return groups


@dataclass
class CascadeStats:
    """Totals since the backend was built (per core call, not per layer)."""

    num_calls: int = 0  # core calls with at least one group
    num_groups: int = 0
    num_grouped_rows: int = 0
    num_shared_positions: int = 0  # Σ over groups of (rows - 1) · prefix positions: reads saved

    def count(self, groups: list[PrefixGroup], block_size: int) -> None:
        self.num_calls += 1
        self.num_groups += len(groups)
        self.num_grouped_rows += sum(len(group.rows) for group in groups)
        self.num_shared_positions += sum(
            (len(group.rows) - 1) * group.num_blocks * block_size for group in groups
        )
