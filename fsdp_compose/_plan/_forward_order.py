"""The forward order: one rank-independent sequence of unit forwards.

See [Note: forward order] in _forward_walk.py for how it is agreed on and followed.
This file holds the value type only (no collectives, no unit state): the
events of one root forward, in order, and how a later agreed forward's
events are merged into it.
"""
from __future__ import annotations

import bisect

# What followed a unit's forward (its post event's ``flag``): nothing (an eval
# forward, or no output requires grad), a backward through its outputs, or it
# ran as a no-grad island of a training forward (see [Note: collective order]).
NO_BACKWARD, GRAD, ISLAND = 0, 1, 2


class ForwardOrder:
    """The unit forwards of one root forward as a sequence of events: the
    *pre* event of a unit (its forward starts: it is all-gathered) and its
    *post* event (its forward ends). A unit called twice has two pairs.

    Per event: ``flag`` (post events: NO_BACKWARD / GRAD / ISLAND) and
    ``region`` (pre events: a label shared by the units whose forward ran in
    one non-reentrant activation-checkpoint region, -1: none).
    """

    def __init__(self):
        self.units: list = []
        self.pre: list[bool] = []
        self.flag: list[int] = []
        self.region: list[int] = []
        self._at: dict[tuple, list[int]] = {}  # (pre, unit) -> its indices, ascending

    def __len__(self) -> int:
        return len(self.units)

    def append(self, pre: bool, unit, flag: int = NO_BACKWARD, region: int = -1) -> int:
        i = len(self.units)
        self.units.append(unit)
        self.pre.append(pre)
        self.flag.append(flag)
        self.region.append(region)
        self._at.setdefault((pre, unit), []).append(i)
        return i

    def find(self, pre: bool, unit, start: int) -> int | None:
        """The first index >= ``start`` of ``unit``'s pre (or post) event."""
        at = self._at.get((pre, unit))
        if not at:
            return None
        k = bisect.bisect_left(at, start)
        return at[k] if k < len(at) else None

    def blocked(self, start: int, stop: int, running) -> int | None:
        """The first index in [start, stop) of an event of a unit in ``running``
        (whose forward runs on this rank now: a new pre or its post cannot be
        passed over), else None."""
        for k in range(start, stop):
            if self.units[k] in running:
                return k
        return None

    def covers(self, units) -> bool:
        return set(units) <= set(self.units)

    def describe(self, around: int | None = None, width: int = 6) -> str:
        """The events as text (``+unit`` pre, ``-unit`` post), around an index."""
        lo, hi = 0, len(self)
        if around is not None:
            lo, hi = max(0, around - width), min(len(self), around + width + 1)
        shown = [f"{'+' if self.pre[k] else '-'}{self.units[k].fqn or '<root>'}"
                 for k in range(lo, hi)]
        return (("... " if lo > 0 else "") + " ".join(shown) + (" ..." if hi < len(self) else ""))


def merged(old: ForwardOrder | None, new: ForwardOrder) -> ForwardOrder:
    """``old`` with the events of units it lacks inserted from ``new``, at the
    place ``new`` has them relative to the events both have; ``new`` alone if
    its events of ``old``'s units do not follow ``old`` (an order that
    changed). A function of the two orders only: the same on every rank."""
    if old is None:
        return new
    known = set(old.units)
    inserted: dict[int, list[int]] = {}   # old index -> new events to put before it
    matched: dict[int, int] = {}          # new index -> old index
    running: set = set()
    i = 0
    for n in range(len(new)):
        unit, pre = new.units[n], new.pre[n]
        if unit in known:
            j = old.find(pre, unit, i)
            if j is None or old.blocked(i, j, running - {unit}) is not None:
                return new
            matched[n], i = j, j + 1
        else:
            inserted.setdefault(i, []).append(n)
        if pre:
            running.add(unit)
        else:
            running.discard(unit)
    if not inserted:
        return old
    # checkpoint regions of inserted events: the old label of a matched event
    # in the same region of ``new``, else a fresh label
    old_label: dict[int, int] = {}
    for n, j in matched.items():
        if new.region[n] >= 0 and old.region[j] >= 0:
            old_label.setdefault(new.region[n], old.region[j])
    fresh = max(old.region, default=-1) + 1
    out = ForwardOrder()
    for k in range(len(old) + 1):
        for n in inserted.get(k, ()):
            r = new.region[n]
            if r >= 0 and r not in old_label:
                old_label[r], fresh = fresh, fresh + 1
            out.append(new.pre[n], new.units[n], new.flag[n],
                       old_label.get(r, -1) if r >= 0 else -1)
        if k < len(old):
            out.append(old.pre[k], old.units[k], old.flag[k], old.region[k])
    return out
