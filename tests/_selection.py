"""The tests this pytest session runs, once collection and selection (``-k``,
``-m``, node ids) are done: ``tests/conftest.py`` fills it, the scenario
launches of ``_support.Scenarios`` read it (a launch runs only the scenarios
that the selected tests ask for). Empty outside a pytest session. No torch:
test_docs_links runs without it."""
from __future__ import annotations

from typing import Any, Dict, List

SELECTED: List[Any] = []        # the items, in the order they run
BY_NODEID: Dict[str, Any] = {}  # nodeid -> item


def set_items(items: List[Any]) -> None:
    SELECTED[:] = items
    BY_NODEID.clear()
    BY_NODEID.update((item.nodeid, item) for item in items)
