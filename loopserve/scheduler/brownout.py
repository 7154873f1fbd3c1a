"""Overload brownout: loops given up while the engine is overloaded (opt-in).

A looped model can trade depth for latency while it runs: a decode token that runs fewer
loops costs less. `Brownout` watches the waiting queue at every `schedule()`: when at least
`brownout_waiting_high` requests wait it goes one level deeper, when at most
`brownout_waiting_low` wait it comes one level back, never more than one change per
`brownout_dwell_steps` steps (hysteresis in queue length and in time), between level 0 (off)
and `brownout_max_level`. At level L a request that allows it (`SamplingParams.
brownout_floor` set) starts each new decode token with `max_loops` lowered by
L x `brownout_step_loops`, never below its floor (nor its `min_loops`), never above its own
`max_loops`. Tokens already running or emitted keep their budget; a request's first token
(its prompt's) is not lowered. Each token's budget is recorded on the request
(`Request.loop_budgets`), so a run replays exactly against the dense reference given those
budgets. Level changes are counted and logged. Torch-free.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass
class Brownout:
    waiting_high: int  # 0: brownout off
    waiting_low: int = 0
    step_loops: int = 1
    max_level: int = 3
    dwell_steps: int = 16
    level: int = 0
    num_changes: int = 0
    _since_change: int = 0

    @property
    def enabled(self) -> bool:
        return self.waiting_high > 0

    @property
    def cut(self) -> int:
        """Loops taken from an eligible request's `max_loops` at the current level."""
        return self.level * self.step_loops

    def observe(self, num_waiting: int) -> bool:
        """One scheduler step with `num_waiting` requests waiting; True if the level moved."""
        if not self.enabled:
            return False
        self._since_change += 1
        if self._since_change < self.dwell_steps:
            return False
        if num_waiting >= self.waiting_high and self.level < self.max_level:
            self.level += 1
        elif num_waiting <= self.waiting_low and self.level > 0:
            self.level -= 1
        else:
            return False
        self._since_change = 0
        self.num_changes += 1
        logger.info(
            "brownout level %d (%d requests waiting): eligible requests' decode tokens run "
            "up to %d fewer loops",
            self.level, num_waiting, self.cut,
        )  # fmt: skip
        return True


def token_max_loops(max_loops: int, min_loops: int, floor: int | None, cut: int) -> int:
    """An eligible request's `max_loops` for its next token at a level taking `cut` loops."""
    if floor is None or cut == 0:
        return max_loops
    return min(max_loops, max(floor, min_loops, max_loops - cut))
