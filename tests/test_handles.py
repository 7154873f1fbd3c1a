"""HandleTable: keep/resume/done/drop/release and the live `kept()` view."""

from __future__ import annotations

import pytest

from loopserve.runner.handles import HandleTable


def test_kept_view_is_live_and_drop_forgets_state_and_handle() -> None:
    table: HandleTable[str] = HandleTable()
    kept = table.kept()
    table.keep("a", 7, "h7")
    table.keep("a", 8, "h8")
    table.keep("b", 9, "h9")
    assert 7 in kept and 8 in kept and 9 in kept  # the view sees later keeps
    table.drop("a", 7)
    assert 7 not in kept and 7 not in table
    assert table.handles_of("a") == frozenset({8})
    table.drop("b", 10)  # a handle that started and finished in one step: never kept
    assert table.handles_of("b") == frozenset({9})
    assert len(table) == 2
    with pytest.raises(KeyError):
        table.resume(7)


def test_release_drops_every_handle_of_the_request_only() -> None:
    table: HandleTable[int] = HandleTable()
    table.keep("a", 1, 10)
    table.keep("a", 2, 20)
    table.keep("b", 3, 30)
    assert sorted(table.release("a")) == [1, 2]
    assert sorted(table.kept()) == [3]
    assert table.resume(3) == 30
    assert table.release("a") == []
