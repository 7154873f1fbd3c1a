"""Exit policies: when a token stops looping (docs/architecture.md, "Exit policies"). Torch-free."""

from loopserve.exit.policies import (
    ExitMode,
    ExitRule,
    GateState,
    LoopPlan,
    TokenExit,
    choose_exit_from_hazards,
    criterion_exits,
    crosses,
    loop_exits,
    next_gate_state,
)

__all__ = [
    "ExitMode",
    "ExitRule",
    "GateState",
    "LoopPlan",
    "TokenExit",
    "choose_exit_from_hazards",
    "criterion_exits",
    "crosses",
    "loop_exits",
    "next_gate_state",
]
