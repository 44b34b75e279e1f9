"""The forward order of a root's units: every rank follows, or agrees on, one
order of unit forward events, so forward all-gathers pair up across ranks even
where a unit runs on some ranks only; the forward's all-gathers ahead of use
(prefetch, gather buckets) along the last training step's order; and the
step's record of the forward that the backward orders derive from.

``ForwardTracker`` is a part of ``RootContext`` (its field ``forward_order``):
it owns the learned orders (one ``_Learned`` per kind of root forward), the
walk of the root forward running now (``_Walk``), and the groups the
agreement all-reduces in; it writes what it follows into the root's
``StepRecord``. It decides, and the root acts: each unit event returns the
events of the order this rank skipped, one at a time (a generator: the
agreement's all-reduces and the catch-ups' all-gathers interleave, as every
rank issues them), and the root all-gathers or frees each skipped unit
(``RootContext._catch_up``) before the next is decided. Forward prefetch and
gather buckets are the root's (``RootContext.prefetch_forward``).

[Note: forward order]
A unit whose forward runs on some ranks only (an expert no token was routed
to, an ``if`` on data) would leave forward all-gathers unpaired, so every rank
follows ONE order of events ``+u`` (u's forward starts: gathered) and ``-u``
(it ends) per kind of root forward (method; training, or eval, which follows
its method's training order once there is one). Protocol: docs/design.md,
"Units skipped on some ranks".
- *Follow* (steady state, no collective of its own): at each of its events a
  rank first *catches up* the skipped events before it (``+v`` all-gathers v
  and its prefetch, ``-v`` reshards v; both recorded at their place), so the
  sharded states, prefetches, buckets and backward orders match on every
  rank; a skipped unit's reduce-scatter is zero-filled. An event not in the
  rest of the order raises before any collective of its own.
- *Agree* (a kind's first forwards, or ``set_forward_order_dynamic(True)``):
  per event the ranks all-reduce (min) a code of the event each wants next
  and all do the winner; the agreed orders merge until one holds every unit.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Generator, Iterator

import torch

from .._base import _compat
from .._plan._backward_plan import StepRecord
from .._base._common import unit_error
from .._plan._forward_order import NO_BACKWARD, ForwardOrder, merged

if TYPE_CHECKING:
    from .._comm._streams import Backend
    from ._unit import Unit

# a skipped event of the order, for the root to act on: (index, pre, unit, flag)
CatchUp = tuple


class LastStepOrder:
    """The units in the order of their first forward in the last training
    step (re-recorded every step, so a changed order is followed from the
    next step on). Forward prefetching walks it: ``next_units(u, n)`` are
    the n units after ``u``; all-gather buckets read ``position``.
    """

    def __init__(self):
        self.execution_order: list[Unit] = []
        self._next: dict[Unit, list[Unit]] = {}
        self.position: dict[Unit, int] = {}

    def set_order(self, order: list[Unit]) -> None:
        if order != self.execution_order:
            self.execution_order = order
            self._next = {u: order[i + 1:] for i, u in enumerate(order)}
            self.position = {u: i for i, u in enumerate(order)}

    def next_units(self, unit: Unit, n: int) -> list[Unit]:
        return self._next.get(unit, [])[:n]

    def __repr__(self) -> str:
        order = [u.fqn or "<root>" for u in self.execution_order]
        return f"LastStepOrder({order})"


class ForwardTracker:
    """The forward orders of one root, followed or agreed on (see the Note)."""

    def __init__(self, root: Unit, units: list[Unit], record: StepRecord,
                 streams: Backend):
        self._root, self._units, self._record, self._streams = root, units, record, streams
        self._orders: dict[tuple, _Learned] = {}  # per kind of root forward: (method, training)
        self.walk: _Walk | None = None              # the root forward now running
        self._unit_index = {u: i for i, u in enumerate(units)}
        self._order_pgs: tuple | None = None        # the groups the agreement all-reduces in
        self.gather_now = True  # the last forward_start's answer: all-gather the unit now

    def start(self, entry: str, training: bool, dynamic: bool) -> None:
        """A root forward starts (``entry``: the method run; ``training``: a
        training forward; ``dynamic``: set_forward_order_dynamic): follow its
        kind's learned order, or agree on one. Only where some group
        communicates (the caller's test)."""
        learned = self._orders.setdefault((entry, training), _Learned())
        trained = self._orders.get((entry, True))
        if not training and trained is not None and not trained.learning():
            follow = trained  # eval follows the training order: [Note: forward order]
        else:
            follow = learned
        agree = dynamic or follow.learning()
        self.walk = _Walk(ForwardOrder() if agree else follow.order,  # type: ignore[arg-type]
                          agree, self._record.clock, learned, training)

    def forward_start(self, unit: Unit, training: bool) -> Iterator[CatchUp]:
        """``unit``'s forward starts (``training``: inside a training forward
        of the root): yields the skipped events before it, for the caller to
        act on; then sets ``gather_now`` (False: it was gathered already, at
        its place in the forward order)."""
        walk, record = self.walk, self._record
        self.gather_now = True
        if walk is None:  # no root forward running (an inner unit called alone), or world 1
            record.record_pre(unit)
            region = _region_here(training)
            if region is not None:
                record.add_region(unit, region)
            return
        if unit in walk.held:  # gathered at its place in the order: it runs here after all
            del walk.held[unit]
            walk.running.add(unit)
            self.gather_now = False
            return
        j = yield from (self._agree(walk, True, unit) if walk.agree
                        else self._follow(walk, True, unit))
        walk.running.add(unit)
        record.clock = walk.base + j
        record.record_pre(unit)
        if walk.agree and walk.training:
            walk.seen[j] = _region_here(True)

    def forward_end(self, unit: Unit, flag: int) -> Iterator[CatchUp]:
        """``unit``'s forward ends: the order's -u; yields the skipped events
        before it, for the caller to act on."""
        walk = self.walk
        if walk is None:
            return
        j = yield from (self._agree(walk, False, unit, flag) if walk.agree
                        else self._follow(walk, False, unit))
        walk.running.discard(unit)
        self._record.clock = walk.base + j
        if unit is self._root:
            self._end_walk(walk)

    # ---------------------------------------------------- the forward order
    def _follow(self, walk: "_Walk", pre: bool,
                unit: Unit) -> Generator[CatchUp, None, int]:
        """The index of this rank's event in the learned order, after catching
        up the events before it that this rank skipped (see the Note)."""
        order, i = walk.order, walk.next
        if i < len(order) and order.units[i] is unit and order.pre[i] is pre:
            walk.next = i + 1  # the common case: nothing skipped
            return i
        j = order.find(pre, unit, i)
        blocked = None if j is None else order.blocked(i, j, walk.running)
        if j is None or blocked is not None:  # (before any collective of the catch-up)
            raise self._departure(walk, pre, unit, blocked)
        for k in range(i, j):
            yield self._catch_up(walk, k, order.pre[k], order.units[k], order.flag[k])
        walk.next = j + 1
        return j

    def _agree(self, walk: "_Walk", pre: bool, unit: Unit,
               flag: int = NO_BACKWARD) -> Generator[CatchUp, None, int]:
        """Agree with the other ranks on the next event of the order (see the
        Note); catch up the events agreed before this rank's own. Returns its index."""
        order = walk.order
        if pre and unit is self._root and not len(order):  # every rank's forward starts so
            walk.open(0, unit)
            return order.append(True, unit)
        n = len(self._units)
        want = (self._unit_index[unit] * 4 if pre
                else (n + _OPEN_MAX - walk.opened[unit]) * 4 + 3 - flag)
        while True:
            got = self._min_across([want])[0]
            q, r = divmod(got, 4)
            if q < n:
                e_pre, v, e_flag = True, self._units[q], NO_BACKWARD
            else:
                e_pre, v, e_flag = False, walk.open_at[_OPEN_MAX - (q - n)], 3 - r
            j = order.append(e_pre, v, e_flag)
            if e_pre:
                walk.open(j, v)
            else:
                walk.close(v)
            if v is unit and e_pre is pre:
                return j
            if not e_pre and v in walk.running:
                raise unit_error(v.fqn, f"another rank ended this unit's forward while it still "
                                 f"runs here, inside the forward of '{unit.fqn or '<root>'}': the "
                                 "ranks nest their units' forwards differently. Agreed so far: "
                                 f"{order.describe(len(order) - 1)}.", _ORDER_FIX)
            yield self._catch_up(walk, j, e_pre, v, e_flag)

    def _catch_up(self, walk: "_Walk", k: int, pre: bool, unit: Unit, flag: int) -> CatchUp:
        """Event ``k`` of the order, which this rank skipped: recorded where
        it is in the order; the caller then takes part in its all-gathers
        (pre) or reshards as its post-forward would (post)."""
        record = self._record
        record.clock = walk.base + k
        if pre:
            record.record_pre(unit)
            walk.held[unit] = k
        else:
            walk.held.pop(unit, None)
        return (k, pre, unit, flag)

    def _end_walk(self, walk: "_Walk") -> None:
        """The root's forward ends: label this forward's checkpoint regions
        from the order, and keep what a training forward agreed on."""
        self.walk = None
        order, training = walk.order, walk.training
        if walk.agree:
            if training:
                self._label_regions(walk)
            walk.learned.add(order, self._units)
        if not training:
            return
        for k in range(len(order)):
            if order.pre[k] and order.region[k] >= 0:  # rank-independent keys (see the Note)
                self._record.add_region(order.units[k], (walk.base, order.region[k]))

    def _label_regions(self, walk: "_Walk") -> None:
        """Label each agreed pre event with its checkpoint region: the same
        label on every rank for units whose forwards ran in one region on any
        rank (the lowest index among them), -1 for none. Min all-reduces until
        no rank lowers a label (one when no rank saw a region)."""
        n = len(walk.order)
        groups: dict = {}
        for j, region in walk.seen.items():
            if region is not None:
                groups.setdefault(region, []).append(j)
        labels, lowered = [_NO_REGION] * n, bool(groups)
        for js in groups.values():
            for j in js:
                labels[j] = min(js)
        while True:
            got = self._min_across(labels + [-int(lowered)])
            labels, lowered = got[:n], False
            if got[n] == 0:
                break
            for js in groups.values():
                low = min(labels[j] for j in js)
                for j in js:
                    lowered |= labels[j] != low
                    labels[j] = low
        walk.order.region = [-1 if x == _NO_REGION else x for x in labels]

    def _min_across(self, values: list[int]) -> list[int]:
        """Element-wise minimum over every rank this root's units gather
        with (the shard groups, then the replicate groups: HSDP)."""
        if self._order_pgs is None:
            shard, replicate = [], []
            for u in self._units:
                for g in u.groups:
                    if g.world > 1 and g.pg not in shard:
                        shard.append(g.pg)
                    if g.replicate_pg is not None and g.replicate_pg not in replicate:
                        replicate.append(g.replicate_pg)
            self._order_pgs = (shard, replicate)
        return self._streams.min_across(values, *self._order_pgs)

    def _departure(self, walk: "_Walk", pre: bool, unit: Unit, blocked: int | None):
        order = walk.order
        what = "starts" if pre else "ends"
        if blocked is None:
            why = (f"its forward {what} here, but the forward order has no such event left "
                   "(a unit outside the order, one called more often than in it, or one "
                   "that runs after its place in the order has passed)")
        else:
            why = (f"its forward {what} here, but to reach that point of the forward order "
                   f"this rank would pass over an event of '{order.units[blocked].fqn}', whose "
                   "forward runs here now")
        return unit_error(unit.fqn, f"{why}. Every rank follows one order of unit forwards "
                          "(learned in the first forwards; a rank that skips a unit takes "
                          "part in its all-gathers where the order has it): "
                          f"{order.describe(walk.next)} (next: event {walk.next}; +unit: its "
                          "forward starts, -unit: it ends). Going on would issue all-gathers "
                          "in an order the other ranks do not.", _ORDER_FIX)

def _region_here(training: bool):
    """The activation-checkpoint region a unit's forward starts in (see
    _backward_plan._slots): a non-reentrant one's while grad is on, a
    reentrant one's for a no-grad island of a training forward."""
    if torch.is_grad_enabled():
        return _compat.checkpoint_region()
    return _compat.reentrant_checkpoint_region() if training else None


LEARNING_FORWARDS = 8  # forwards of a kind that agree on the order while a unit is missing
_OPEN_MAX = 1 << 40    # agreement codes of post events (see ForwardTracker._agree)
_NO_REGION = 1 << 62
_ORDER_FIX = ("If the order of the units' forwards changes by design (not only units "
              "skipped on some ranks), call set_forward_order_dynamic(True) on the root: the "
              "ranks then agree on the order in every forward (one small all-reduce per unit "
              "forward start and end).")


class _Learned:
    """The forward order learned for one kind of root forward (see [Note:
    forward order]): the orders agreed on, merged, until it holds every unit
    or LEARNING_FORWARDS forwards agreed."""

    def __init__(self):
        self.order: ForwardOrder | None = None
        self.complete = False
        self.forwards = 0

    def learning(self) -> bool:
        return self.order is None or (not self.complete and self.forwards < LEARNING_FORWARDS)

    def add(self, order: ForwardOrder, units: list) -> None:
        self.order = merged(self.order, order)
        self.complete = self.order.covers(units)
        self.forwards += 1


class _Walk:
    """One root forward, followed event by event (see [Note: forward order])."""

    def __init__(self, order: ForwardOrder, agree: bool, base: int, learned: _Learned,
                 training: bool):
        self.order = order    # the learned order, or (agree) the one agreed in this forward
        self.agree = agree
        self.training = training  # a training forward of the root
        self.learned = learned
        self.next = 0         # (follow) the index of the next event expected
        self.base = base      # the clock at the root's pre-forward: event k is at base + k + 1
        self.running: set = set()   # units whose forward runs on this rank now
        self.held: dict = {}        # units gathered for the order whose forward is not
                                    # running here, their end not reached -> index of start
        self.opened: dict = {}      # (agree) open units -> index of their start
        self.open_at: dict = {}     # ... and back
        self.seen: dict = {}        # (agree) start index -> this rank's checkpoint region

    def open(self, j: int, unit) -> None:
        self.opened[unit] = j
        self.open_at[j] = unit

    def close(self, unit) -> None:
        del self.open_at[self.opened.pop(unit)]
