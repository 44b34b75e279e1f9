"""The suite's pytest hooks."""
from __future__ import annotations

from . import _selection


def pytest_collection_finish(session):
    # the selected tests, for the scenario launches (tests/_support.py, Scenarios)
    _selection.set_items(session.items)
