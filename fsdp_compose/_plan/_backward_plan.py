"""What a step's forward recorded, and the backward plan made from it: values.

``StepRecord`` is what the forward of one training step recorded about its
units (which ran, in which order, which will see a backward, which
checkpoint regions they ran in). ``build_plan`` turns a record into a
``BackwardPlan``: the gather order, the reduce order, each reduce-scatter's
slot in the one sequence of both, the prefetch stops and the reduce bucket
boundaries ([Note: collective order] and [Note: one order across
communicators] below). It is a pure function of the record and of what it
is given about the units (no collective, no process group, no unit state).
``PlanWalker`` walks one backward through its plan and returns the steps due
(all-gathers and reduce-scatters, in the one sequence): the runtime performs
them with collectives (``_state.RootContext``), ``tools/_planner.py`` with
sizes, and tests without processes. Units are whatever hashable objects the
caller records.

[Note: collective order]
Collectives on one process group must be issued in the same order on every
rank, but which backward hooks fire, and when, depends on each rank's graph.
So backward collectives follow rank-independent orders derived from the
forward, over the units whose forward ran with a backward to follow:
- gather order: reverse of the units' LAST post-forward (the root first). A
  unit needing its parameters in backward first gathers every unit before it.
- reduce order: reverse of the units' FIRST pre-forward (the root last), then
  the units an earlier backward left unreduced that did not run in this one
  (``pending``). A ready unit waits for every trainable unit before it; the
  final callback issues the rest, zero-filled where this rank has no gradient
  (so every rank gets the rank average). A second process group carries them.
- No-grad islands of the training forward (reentrant checkpoints) are in both
  orders at the place of their forward; never recomputed, the final callback
  gathers them and reduces zeros. At most one unit's reduce-scatters in flight.

[Note: one order across communicators]
NCCL also needs collectives on *different* communicators issued in one order
on every rank (a blocked kernel can hold the SMs or the one hardware queue
another communicator needs), so the two orders are merged into ONE sequence,
a function of the forward alone:
- each reduce-scatter has a *slot* in the gather order: after the all-gathers
  of every unit whose forward ended after its unit's first forward began, and
  of every unit in its checkpoint region (non-reentrant, or the islands of one
  reentrant ``CheckpointFunction``), plus what those prefetch; never before an
  earlier unit's slot. It goes out, in reduce order, once ready and once its
  slot's all-gather is issued;
- a demand for an all-gather first issues the reduce-scatters slotted before
  it, zero-filled where ``_compat.will_execute`` says no gradient comes (the
  engine's decreasing sequence numbers complete them before it, or never).
Outside the sequence (hook timing, equal on ranks with equal graphs): a
second gradient for a unit already reduced, and the user's ``unshard()``.

A gradient part that a nested (reentrant checkpoint) backward brings is not
reduced alone when the outer backward brings another part (asked of the
engine at the unit's pre-backward): one reduce-scatter of the sum.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Hashable, Iterable, Mapping


class StepRecord:
    """The forward of one training step, recorded for its backward.

    ``step_order``: units in first-forward order; ``grad_follows``: those whose
    outputs will see a backward, in last-post-forward order; ``in_orders``:
    those and the no-grad islands of the training forward (the units of the
    two backward orders), in last-post-forward order; ``first_pre`` /
    ``last_post``: the clock at a unit's first pre-forward and last
    post-forward; ``regions``: the checkpoint regions its forwards ran in.
    ``clear`` starts a step; the clock runs on across steps."""

    def __init__(self):
        self.step_order: dict = {}
        self.grad_follows: dict = {}
        self.in_orders: dict = {}
        self.first_pre: dict = {}
        self.last_post: dict = {}
        self.regions: dict = {}
        self.clock = 0

    def clear(self) -> None:
        for d in (self.step_order, self.grad_follows, self.in_orders, self.first_pre,
                  self.last_post, self.regions):
            d.clear()

    def record_pre(self, unit: Hashable) -> None:
        """``unit``'s forward starts (or, caught up, started elsewhere)."""
        self.step_order.setdefault(unit, None)
        self.clock += 1
        self.first_pre.setdefault(unit, self.clock)

    def add_region(self, unit: Hashable, region) -> None:
        self.regions.setdefault(unit, set()).add(region)

    def expect_backward(self, unit: Hashable, island: bool = False) -> None:
        """``unit``'s forward ended with a backward to follow, or (``island``)
        ran without grad inside the training forward."""
        if not island:
            self.grad_follows.pop(unit, None)  # keep the order of LAST post-forward
            self.grad_follows[unit] = None
        self.enter_orders(unit)

    def enter_orders(self, unit: Hashable) -> None:
        self.in_orders.pop(unit, None)
        self.in_orders[unit] = None
        self.clock += 1
        self.last_post[unit] = self.clock

    def expects_backward(self, unit: Hashable) -> bool:
        return unit in self.grad_follows


@dataclass(frozen=True)
class BackwardPlan:
    """One backward's schedule, fixed when it starts (see the module docstring).

    ``gather_order`` / ``gather_pos``: the units in gather order and their
    index there; ``reduce_order``: the units in reduce order; per reduce-order
    index ``i``: ``slots[i]`` (the gather index after which it may
    reduce-scatter), ``reduces[i]`` (it has something to reduce) and
    ``bucket_ends[i]`` (a reduce bucket closes after it, where buckets are
    on); ``stops[u]``: the last gather index ``u``'s backward prefetches."""

    gather_order: tuple
    gather_pos: Mapping
    reduce_order: tuple
    slots: tuple
    reduces: tuple
    bucket_ends: tuple
    stops: Mapping

    def stop(self, unit, prefetch: bool = True) -> int:
        return self.stops[unit] if prefetch else self.gather_pos[unit]


def build_plan(record: StepRecord, pending: Iterable = (), *, prefetch_depth: int,
               backward_prefetch: Callable = lambda u: None,
               completes: Callable = lambda u: True,
               reduces: Callable = lambda u: True,
               grad_bytes: Callable = lambda u: 0,
               bucket_bytes: int = 0) -> BackwardPlan:
    """The plan of the backward that follows ``record``'s forward.

    ``pending``: units an earlier backward left unreduced, in order
    (``completes(u)``: this backward finishes them); ``backward_prefetch(u)``:
    ``u``'s explicit backward prefetch (None: ``prefetch_depth`` units);
    ``reduces(u)``: ``u`` has gradients to reduce now; ``grad_bytes(u)``: its
    flat gradients' bytes (reduce buckets of at most ``bucket_bytes``)."""
    gather = tuple(reversed(record.in_orders))
    pos = {u: i for i, u in enumerate(gather)}
    last = len(gather) - 1
    stops = {}
    for u in gather:
        explicit = backward_prefetch(u)
        if explicit is None:
            stops[u] = min(pos[u] + prefetch_depth, last)
        else:
            stops[u] = min(max([pos[u]] + [pos[v] for v in explicit if v in pos]), last)
    order = [u for u in reversed(record.step_order) if u in record.in_orders]
    order += [u for u in pending if u not in record.in_orders and completes(u)]
    slots = _slots(record, gather, pos, stops, order)
    does = tuple(bool(reduces(u)) for u in order)
    return BackwardPlan(gather, MappingProxyType(pos), tuple(order), slots, does,
                        _bucket_ends(order, does, grad_bytes, bucket_bytes),
                        MappingProxyType(stops))


def _slots(record: StepRecord, gather: tuple, pos: dict, stops: dict, order: list) -> tuple:
    """Per unit of the reduce order, the gather index after which it may
    reduce-scatter ([Note: one order across communicators])."""
    region_end: dict = {}
    for u, regions in record.regions.items():
        for r in regions:
            if u in pos:
                region_end[r] = max(region_end.get(r, -1), pos[u])
    reach, best = [], -1  # reach[g]: the furthest index gather[:g + 1] prefetch
    for u in gather:
        best = max(best, stops[u])
        reach.append(best)
    slots, ended, floor = [], 0, 0
    for u in order:  # first pre-forward, latest first
        if u not in record.first_pre:  # pending from an earlier backward: last
            floor = max(floor, len(gather) - 1)
            slots.append(floor)
            continue
        while ended < len(gather) and record.last_post[gather[ended]] > record.first_pre[u]:
            ended += 1  # gather[:ended]: forwards that ended after u's began
        last = max([ended - 1] + [region_end[r] for r in record.regions.get(u, ())])
        floor = max(floor, reach[last])
        slots.append(floor)
    return tuple(slots)


def _bucket_ends(order: list, does: tuple, grad_bytes: Callable, limit: int) -> tuple:
    """A bucket ends before the next unit to reduce would take it past the
    byte limit (a larger unit goes alone), or at the last unit to reduce: a
    function of the reduce order and the sizes only (never of timing), so
    every rank buckets alike."""
    ends = [False] * len(order)
    total, following = 0, None
    nxt = [None] * (len(order) + 1)  # [i]: bytes of the first reducing unit at index >= i
    for i in range(len(order) - 1, -1, -1):
        if does[i]:
            following = grad_bytes(order[i])
        nxt[i] = following
    for i, u in enumerate(order):
        if not does[i]:
            continue
        total += grad_bytes(u)
        after = nxt[i + 1]
        if after is None or total + after > limit:
            ends[i], total = True, 0
    return tuple(ends)


GATHER = "gather"   # a step of the walk: all-gather this unit
REDUCE = "reduce"   # a step of the walk: reduce-scatter these units (a bucket, or one)


class PlanWalker:
    """Where one backward stands in its ``BackwardPlan``: the gather cursor,
    the reduce cursor, the units ready and launched, the open reduce bucket.

    A pure object: it issues nothing. Its methods return the *steps* due now,
    in the one sequence of [Note: one order across communicators]
    (``(GATHER, unit)`` and ``(REDUCE, units, bucket)``), and the caller
    performs them in that order: the runtime (``_state.RootContext``) with
    real collectives, ``tools/_planner.py`` with sizes. ``bucketed``: reduce
    buckets are on (else each unit is reduced alone)."""

    def __init__(self, plan: BackwardPlan, bucketed: bool):
        self.plan = plan
        self.bucketed = bucketed
        self.gather_next = 0        # next index of the gather order to all-gather
        self.reduce_next = 0        # next index of the reduce order to reduce-scatter
        self.ready: set = set()     # units whose gradients are all accumulated
        self.launched: set = set()  # units whose reduce-scatter was issued
        self.bucket: list = []      # units waiting to be reduced as one bucket

    def up_to(self, stop: int, final: bool = False, gets_grad: Mapping | None = None,
              reduce: bool = True) -> list[tuple]:
        """The steps that issue the gather order up to index ``stop``, each
        all-gather after the reduce-scatters slotted before it. ``final``: the
        end of backward, every reduce-scatter goes (zero-filled where no
        gradient came). ``gets_grad``: {unit: the engine will give it a
        gradient} for the reducing units of this backward (None: not known,
        inside a nested backward): at a demand, a unit past its slot that no
        gradient will reach on this rank is reduced zero-filled rather than
        waited for. ``reduce`` False: all-gathers only (a backward that
        accumulated no gradient: ``autograd.grad(loss, inputs)``)."""
        steps: list[tuple] = []
        order = self.plan.gather_order
        while self.gather_next <= stop:
            if reduce:
                self._reductions(steps, demand=True, final=final, gets_grad=gets_grad)
            self.gather_next += 1
            steps.append((GATHER, order[self.gather_next - 1]))
        if reduce:
            self._reductions(steps, final=final)
        return steps

    def mark_ready(self, unit) -> list[tuple]:
        """``unit``'s gradients are all accumulated: the reduce-scatters due now."""
        self.ready.add(unit)
        steps: list[tuple] = []
        self._reductions(steps)
        return steps

    def _reductions(self, steps: list, demand: bool = False, final: bool = False,
                    gets_grad: Mapping | None = None) -> None:
        """Append the reduce-scatters whose turn came: in the reduce order, each
        once the all-gather of its slot is issued. Ready ones only, except
        ``demand`` (the next all-gather is wanted: the ones slotted before it
        go first, zero-filled where no gradient comes) and ``final`` (all)."""
        plan = self.plan
        order = plan.reduce_order
        while self.reduce_next < len(order):
            i, unit = self.reduce_next, order[self.reduce_next]
            if not plan.reduces[i]:
                self.reduce_next += 1  # nothing to reduce (frozen, or accumulating)
                continue
            if plan.slots[i] >= self.gather_next:
                break  # its slot's all-gather is not issued yet
            if unit not in self.ready and not final:
                if not (demand and _no_gradient_here(unit, gets_grad)):
                    break  # (a demand that cannot wait for it issues its all-gather anyway)
            self.reduce_next += 1
            if not self.bucketed:
                self.launched.add(unit)
                steps.append((REDUCE, [unit], False))
                continue
            self.bucket.append(unit)
            if plan.bucket_ends[i]:
                units, self.bucket = self.bucket, []
                self.launched.update(units)
                steps.append((REDUCE, units, True))

    def reducing_units(self) -> list:
        """The units this backward reduces (the plan's ``reduces``)."""
        return [u for u, does in zip(self.plan.reduce_order, self.plan.reduces) if does]


def _no_gradient_here(unit, gets_grad: Mapping | None) -> bool:
    """No gradient will come for ``unit`` on this rank, and this backward
    reduces gradients at all (not ``autograd.grad(loss, inputs)``)."""
    return (gets_grad is not None and any(gets_grad.values())
            and not gets_grad.get(unit, False))
