"""The scenario launches of tests/_support.py run what the selected tests ask
for: ``-k`` one scenario launches that one (Scenarios), a fixture of one
launch per world size launches the world sizes used (OnFirstUse). No process:
the launches are recorded, not made."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from . import _selection, _support
from ._support import OnFirstUse, Scenarios

pytestmark = pytest.mark.fast  # the one-minute tier (make test-fast)

NAMES = ["a", "b", "c"]


def _item(ws: int, name: str, module=None):
    """A test item of this module parametrized as ``[ws-name]``."""
    return SimpleNamespace(nodeid=f"t::test[{ws}-{name}]", module=module or sys.modules[__name__],
                           callspec=SimpleNamespace(params={"world": ws, "scenario": name}))


@pytest.fixture
def launches(monkeypatch):
    """The (world size, names) of each launch; the session's selection is
    restored after the test."""
    made: list = []

    def run_scenarios(ws, names, run_one, timeout):
        made.append((ws, list(names)))
        return {n: ("ok", [n] * ws) for n in names}

    monkeypatch.setattr(_support, "run_scenarios", run_scenarios)
    saved = list(_selection.SELECTED)
    yield made
    _selection.set_items(saved)


def _select(items, monkeypatch, current=None):
    _selection.set_items(items)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", f"{(current or items[0]).nodeid} (call)")


def test_one_selected_scenario_is_launched_alone(launches, monkeypatch):
    _select([_item(2, "b")], monkeypatch)
    assert Scenarios(None).results(2, "b", NAMES) == ["b", "b"]
    assert launches == [(2, ["b"])]


def test_the_selected_scenarios_of_a_world_size_share_one_launch(launches, monkeypatch):
    items = [_item(2, "c"), _item(2, "a"), _item(4, "b"),
             _item(2, "b", module=SimpleNamespace(__name__="tests.another_file"))]
    _select(items, monkeypatch)
    s = Scenarios(None)
    for item in items[:3]:
        monkeypatch.setenv("PYTEST_CURRENT_TEST", f"{item.nodeid} (call)")
        p = item.callspec.params
        s.results(p["world"], p["scenario"], NAMES)
    # in the order of names; "b" at 2 is another file's test
    assert launches == [(2, ["a", "c"]), (4, ["b"])]


def test_every_scenario_when_every_test_is_selected(launches, monkeypatch):
    items = [_item(2, n) for n in NAMES]
    _select(items, monkeypatch)
    s = Scenarios(None)
    for item in items:
        monkeypatch.setenv("PYTEST_CURRENT_TEST", f"{item.nodeid} (call)")
        s.results(2, item.callspec.params["scenario"], NAMES)
    assert launches == [(2, NAMES)]


def test_outside_a_pytest_session_every_scenario(launches, monkeypatch):
    _selection.set_items([])
    Scenarios(None).results(2, "b", NAMES)
    assert launches == [(2, NAMES)]


def test_asking_for_a_scenario_wants_does_not_list_fails(launches, monkeypatch):
    _select([_item(2, "a")], monkeypatch)
    with pytest.raises(AssertionError, match="asks for scenario 'c' at world size 2"):
        Scenarios(None).results(2, "c", NAMES)
    assert launches == []


def test_wants_lists_what_else_a_test_asks_for(launches, monkeypatch):
    _select([_item(2, "a")], monkeypatch)
    s = Scenarios(None, wants=lambda item: [(2, "a"), (2, "c")])
    s.results(2, "a", NAMES)
    s.results(2, "c", NAMES)
    assert launches == [(2, ["a", "c"])]


def test_on_first_use_makes_each_value_once():
    made = []
    runs = OnFirstUse(lambda ws: made.append(ws) or [ws] * ws)
    assert runs[4] == [4] * 4 and runs[4] == [4] * 4
    assert made == [4]
