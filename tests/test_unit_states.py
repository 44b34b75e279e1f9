"""The unit's state machine (``Unit.enter``, ``_unit._MOVES``): each hook
moves a unit along the table or raises a unit error naming both states.
No processes: the table and the check, on a bare Unit."""
from __future__ import annotations

import pytest

from fsdp_compose._base._common import TrainingState as S
from fsdp_compose._runtime._unit import _MOVES, Unit

pytestmark = pytest.mark.fast  # no process: the one-minute tier (make test-fast)


def _unit(state: S) -> Unit:
    u = Unit.__new__(Unit)  # (only the fields the state machine reads)
    u.fqn, u.state = "blocks.0", state
    return u


def test_a_step_moves_along_the_table():
    u = _unit(S.IDLE)
    for state, hook in ((S.FORWARD, "pre_forward"), (S.IDLE, "post_forward"),
                        (S.PRE_BACKWARD, "pre_backward"), (S.PRE_BACKWARD, "pre_backward"),
                        (S.POST_BACKWARD, "post_backward"), (S.PRE_BACKWARD, "pre_backward"),
                        (S.POST_BACKWARD, "post_backward")):
        u.enter(state, hook)
        assert u.state is state


@pytest.mark.parametrize("start,to,hook", [
    (S.FORWARD, S.PRE_BACKWARD, "pre_backward"),   # a backward inside the unit's forward
    (S.FORWARD, S.POST_BACKWARD, "post_backward"),
    (S.PRE_BACKWARD, S.FORWARD, "pre_forward"),    # a forward before the backward ended
    (S.IDLE, S.IDLE, "post_forward"),              # a post-forward without its pre-forward
])
def test_a_wrong_move_raises_naming_the_unit_and_both_states(start, to, hook):
    u = _unit(start)
    allowed = [s.name for s in _MOVES[to]]
    with pytest.raises(RuntimeError) as e:
        u.enter(to, hook)
    assert f"unit 'blocks.0': {hook} expected state {allowed}, got {start.name}." in str(e.value)
    assert u.state is start  # (unchanged)


def test_every_state_is_entered_from_somewhere():
    assert set(_MOVES) == set(S) and all(_MOVES[s] for s in S)
