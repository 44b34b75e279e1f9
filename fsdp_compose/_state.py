"""Lazy root initialisation and the state every unit below a root shares.

The first forward (or ``unshard()``) of any sharded module makes that module's
unit the *root*: it walks its subtree once, names every unit and parameter by
FQN, checks the parameters, and builds the ``RootContext`` all units then
reference: the recorded forward order, the stream manager, and the backward
bookkeeping (reduce-scatter order, the final callback).

[Note: collective order]
Collectives on one process group must be issued in the same order on every
rank, but which hooks fire in backward, and when, depends on each rank's
autograd graph (a unit may get no gradient on some rank). So backward
collectives follow rank-independent orders derived from the forward, over the
units whose forward ran with a backward to follow:
- All-gathers follow the *gather order*: the reverse of the units' LAST
  post-forward (the order their pre-backward hooks fire: the root, whose
  forward ends last, first). When a unit needs its parameters in backward,
  every unit before it in that order is gathered first (once per backward).
- Reduce-scatters follow the *reduce order*: the reverse of the units' FIRST
  pre-forward (the order their gradients complete: the root, whose first
  parameters are used first, last), then the units whose reduction an
  earlier backward left unfinished (without gradient sync, or HSDP without
  the all-reduce) and that did not run in this one (``_pending``: their
  gradient belongs to this step, as DDP's no_sync keeps it in p.grad). A
  unit whose gradients are ready waits until every trainable unit before it
  was issued; the root's final callback issues the rest, zero-filled where
  this rank produced no gradient. They run on a second process group over
  the same ranks, so the two streams of collectives cannot block each other.
- Both orders include the units that ran as a no-grad island of the training
  forward (a reentrant checkpoint: its recomputation in backward gathers
  them, and their gradients come from a nested backward), at the place of
  their forward: a rank whose graph reaches them at another moment still
  issues the same collectives. If they are never recomputed, the final
  callback gathers them and reduces zeros (their ``p.grad`` stays None).
(One order for both gathered the whole model at the root's pre-backward.)
Ranks never diverge, and a parameter used on only some ranks still gets the
rank-average gradient. At most one unit's reduce-scatters are in flight at a
time, so flat gradients are freed as backward proceeds.

[Note: one order across communicators]
NCCL also needs collectives on *different* communicators issued in the same
order on every rank: a kernel waiting for its peers can hold the SMs or the
only hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``) that another
communicator's kernel needs. So the two orders above are merged into ONE
sequence, a function of the forward alone (the same on every rank):

- every reduce-scatter gets a *slot* in the gather order: the index of the
  last all-gather that must be issued before it. Unit u's gradient can need
  the all-gathers of every unit whose forward ended after u's first forward
  began (consumers of u's output; u itself), and of every unit in the same
  checkpoint region (its recompute gathers them all before any of their
  gradients exists; non-reentrant, or reentrant: no-grad islands whose forward
  ran in one ``CheckpointFunction``). Its slot is the largest gather index among
  those, extended by what any of them prefetches (so a unit's backward
  prefetch is issued before its reduce-scatter, as FSDP2 does), and never
  before the slot of an earlier unit in the reduce order;
- reduce-scatters are issued in the reduce order, each once ready and once
  its slot's all-gather is issued; all-gathers as now, on demand;
- a demand for an all-gather comes from unit w's pre-backward (or the
  recompute of w's region). Every reduce-scatter slotted before that
  all-gather belongs to a unit whose forward began after w's ended: the
  engine runs backward nodes in decreasing sequence number, so such a unit's
  gradient (its split node, made at its pre-forward) is complete before w's
  pre-backward, or it never comes on this rank. The demand therefore issues
  those reduce-scatters first, zero-filled where no gradient came (the engine
  confirms: ``_compat.will_execute``); a rank never waits for a gradient that
  depends on a collective it has not issued. The root's final callback
  issues whatever is left, in the same sequence.

Outside the sequence, as before (hook timing, equal on ranks whose graphs
are equal): a second gradient for a unit already reduced, and the user's own
``unshard()``. The part of a unit's gradient that a nested (reentrant
checkpoint) backward brings is not reduced alone when the outer backward
brings another part (asked of the engine at the unit's pre-backward): one
reduce-scatter of the sum, whatever each rank's graph.

[Note: forward order]
Forward all-gathers are issued at pre-forward hooks, so a unit whose forward
runs on some ranks only (an expert no token was routed to here, an ``if`` on
data) would leave the ranks' all-gathers unpaired: a hang, a size mismatch, or
silently wrong parameters where two units have the same size. So every rank
follows ONE order of unit forwards, a sequence of events ``+u`` (u's forward
starts: it is gathered) and ``-u`` (it ends), per kind of root forward (the
method run, training or eval; an eval forward follows its method's training
order once there is one):

- *Follow* (the steady state; no collective of its own). At each of its own
  events a rank finds the next such event in the order. The events before
  it, which this rank skipped, it *catches up* first: a ``+v`` all-gathers v
  (and its forward prefetch) as v's pre-forward would, a ``-v`` reshards v as
  its post-forward would (a unit skipped here is gathered and freed at once
  unless it keeps its parameters after forward), and both are recorded in the
  step's bookkeeping (``_step_order``, the clocks, ``_in_orders`` when a
  backward follows it elsewhere) at their place in the order. So the sharded
  states, the forward prefetches and gather buckets (which walk the recorded
  order), the backward's gather and reduce orders and slots are the same on
  every rank; a unit skipped here gets no gradient here, and its
  reduce-scatter is zero-filled (every rank gets the rank average, as DDP
  with ``find_unused_parameters=True``). A rank whose event is not in the
  rest of the order (a unit outside it, called more often, run after its
  place passed, or nested otherwise) raises before any collective of its
  own: it cannot go on alone.
- *Agree* (a kind's first forwards, or every forward with
  ``set_forward_order_dynamic(True)``). At each event the ranks all-reduce
  (min) a code of the event each wants next (a ``+u``: u's index in module
  order; a ``-u``: after every ``+``, innermost open unit first, with what
  follows u's forward); every rank then does the winning event, catching it
  up if it was not its own. A unit gathered for another rank's ``+v`` is held
  (it may run here before its ``-v``). The agreed sequence is the same on
  every rank by construction; a training forward then labels its checkpoint
  regions (min all-reduces of each rank's labels until none lowers). Cost:
  one 8-byte all-reduce per event (per group: shard, then replicate), a host
  sync each on NCCL.
- Learning: the agreed orders of a kind are merged (units missing from the
  order are inserted where the newer order has them) until the order holds
  every unit, or LEARNING_FORWARDS forwards agreed; then the kind follows.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _collectives, _compat, _divergence
from ._common import META_FIX, TrainingState, label, root_setting_fix, trace, unit_error
from ._flat_group import gather_bucket
from ._forward_order import GRAD, NO_BACKWARD, ForwardOrder, merged
from ._grad_path import launch_bucket
from ._registry import units_below
from ._streams import StreamManager
from ._unit import Unit


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


class RootContext:
    def __init__(self, root: Unit, units: list[Unit], device: torch.device):
        self.root = root
        self.units = units
        self.last_step_order = LastStepOrder()
        self.settings = root.root_settings  # the model's settings (FSDPModule's root setters)
        self.streams = StreamManager(device)
        # per step (from a root forward after a backward, to the next one)
        self._new_step = True
        self._step_order: dict[Unit, None] = {}  # units in first-forward order this step
        self._grad_follows: dict[Unit, None] = {}  # ... whose outputs will see a backward,
                                                   # in last-post-forward order
        self._clock = 0                             # forward events this step, and when:
        self._first_pre: dict[Unit, int] = {}       # ... a unit's first pre-forward
        self._last_post: dict[Unit, int] = {}       # ... its last post-forward (grad follows)
        self._regions: dict[Unit, set] = {}         # checkpoint regions its forwards ran in
        # ... and those that ran as a no-grad island of the training forward
        # (a reentrant checkpoint recomputes them in backward): the units of
        # the two backward orders, see the Note
        self._in_orders: dict[Unit, None] = {}
        # per backward
        self._callback_queued = False
        self._outer_task = -1                   # graph task of the backward we finish
        self._gather_order: list[Unit] | None = None  # see the Note
        self._gather_pos: dict[Unit, int] = {}
        self._gather_next = 0                   # next index in it to all-gather
        self._order: list[Unit] | None = None   # the reduce order, see the Note
        self._next = 0                          # next index in it to reduce-scatter
        self._slots: list[int] | None = None    # per reduce-order index: its slot (see Note)
        self._gets_grad: dict[Unit, bool] | None = None  # will the engine give it one
        self._ready: set[Unit] = set()
        self._launched: set[Unit] = set()
        self._in_flight: list = []
        self._bucket: list[Unit] = []            # units waiting to be reduced as one bucket
        self._bucket_bytes = 0                   # ... and their flat gradients' size
        self._following: list | None = None      # see _next_reduced_bytes
        self.accumulated = False                # a flat gradient arrived in this backward
        # units in the reduce order of a backward that did not finish their
        # reduction (Unit.completes_reduction), not finished since: every rank
        # alike (see the Note)
        self._pending: dict[Unit, None] = {}
        self.in_training_forward = False        # inside a grad-enabled forward of the root
        self.communicates = True                # some group has world > 1 (set at lazy init)
        # the lazy-init and step checks of [Note: divergence] in _divergence.py
        # (None: nothing communicates, set at lazy init)
        self.checks: _divergence.StepChecks | None = None
        self._settings: tuple = (-1, None)  # (settings_generation, _make_settings())
        # the forward orders (see [Note: forward order]), per kind of root
        # forward: (method, training)
        self._orders: dict[tuple, _Learned] = {}
        self._walk: _Walk | None = None         # the root forward now running
        self._unit_index = {u: i for i, u in enumerate(units)}
        self._order_pgs: tuple | None = None    # the groups the agreement all-reduces in

    # ------------------------------------------------------------------ forward
    def root_pre_forward(self, entry: str = "forward") -> None:
        if self.checks is not None:
            _divergence.raise_if_stopped(self.root.fqn)
        if self._callback_queued or any(u.state is not TrainingState.IDLE for u in self.units):
            if self.checks is not None:
                self._left_half_done()  # raises unless every rank left it alike
            self._abort_step()  # a previous forward or backward raised before finishing
        if self.checks is not None:
            self.checks.before(_divergence.FORWARD if torch.is_grad_enabled()
                               else _divergence.EVAL_FORWARD, *self._schedule_settings())
        self.in_training_forward = torch.is_grad_enabled()
        if self._new_step and torch.is_grad_enabled():  # eval forwards start no step
            self._new_step = False
            self._step_order.clear()
            self._grad_follows.clear()
            self._first_pre.clear()
            self._last_post.clear()
            self._regions.clear()
            self._in_orders.clear()
            for u in self.units:
                u.uses = 0
                # left unsharded by a forward with no backward: may be stale
                # after optimizer.step(), unless the user pinned it. Kept by
                # set_reshard_after_backward(False): only if no shard changed.
                if u.is_unsharded and not u.pinned:
                    if not u.kept_after_backward or u.is_stale():
                        u.reshard()
                u.kept_after_backward = False
        self._walk = None
        if self.communicates:
            learned = self._orders.setdefault((entry, self.in_training_forward), _Learned())
            trained = self._orders.get((entry, True))
            if not self.in_training_forward and trained is not None and not trained.learning():
                follow = trained  # an eval forward follows the training order (see the Note)
            else:
                follow = learned
            agree = self.settings.forward_order_dynamic or follow.learning()
            self._walk = _Walk(ForwardOrder() if agree else follow.order, agree, self._clock,
                               learned)

    def record_forward(self, unit: Unit) -> bool:
        """``unit``'s forward starts. Returns whether to all-gather it now
        (False: it was gathered already, at its place in the forward order)."""
        walk = self._walk
        if walk is None:  # no root forward running (an inner unit called alone), or world 1
            self._record_pre(unit)
            region = self._region_here()
            if region is not None:
                self._regions.setdefault(unit, set()).add(region)
            return True
        if unit in walk.held:  # gathered at its place in the order: it runs here after all
            del walk.held[unit]
            walk.running.add(unit)
            return False
        j = self._agree(walk, True, unit) if walk.agree else self._follow(walk, True, unit)
        walk.running.add(unit)
        self._clock = walk.base + j
        self._record_pre(unit)
        if walk.agree and self.in_training_forward:
            walk.seen[j] = self._region_here()
        return True

    def _region_here(self):
        """The activation-checkpoint region a unit's forward starts in (see
        _slot_of): a non-reentrant one's while grad is on, a reentrant one's
        for a no-grad island of a training forward."""
        if torch.is_grad_enabled():
            return _compat.checkpoint_region()
        return _compat.reentrant_checkpoint_region() if self.in_training_forward else None

    def _record_pre(self, unit: Unit) -> None:
        self._step_order.setdefault(unit, None)
        self._clock += 1
        self._first_pre.setdefault(unit, self._clock)

    def forward_end(self, unit: Unit, flag: int) -> None:
        """``unit``'s forward ends (before its post-forward's reshard and
        bookkeeping); ``flag``: what follows it (_forward_order.GRAD ...)."""
        walk = self._walk
        if walk is None:
            return
        j = self._agree(walk, False, unit, flag) if walk.agree else self._follow(walk, False, unit)
        walk.running.discard(unit)
        self._clock = walk.base + j
        if unit is self.root:
            self._end_walk(walk)

    # ---------------------------------------------------- the forward order
    def _follow(self, walk: "_Walk", pre: bool, unit: Unit) -> int:
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
            self._catch_up(walk, k, order.pre[k], order.units[k], order.flag[k])
        walk.next = j + 1
        return j

    def _agree(self, walk: "_Walk", pre: bool, unit: Unit, flag: int = NO_BACKWARD) -> int:
        """Agree with the other ranks on the next event of the order (see the
        Note); catch up the events agreed before this rank's own. Returns its index."""
        order = walk.order
        if pre and unit is self.root and not len(order):  # every rank's forward starts so
            walk.open(0, unit)
            return order.append(True, unit)
        n = len(self.units)
        want = (self._unit_index[unit] * 4 if pre
                else (n + _OPEN_MAX - walk.opened[unit]) * 4 + 3 - flag)
        while True:
            got = self._min_across([want])[0]
            q, r = divmod(got, 4)
            if q < n:
                e_pre, v, e_flag = True, self.units[q], NO_BACKWARD
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
            self._catch_up(walk, j, e_pre, v, e_flag)

    def _catch_up(self, walk: "_Walk", k: int, pre: bool, unit: Unit, flag: int) -> None:
        """Event ``k`` of the order, which this rank skipped: take part in its
        all-gathers (pre) or reshard as its post-forward would (post), and
        record it where it is in the order."""
        self._clock = walk.base + k
        if pre:
            self._record_pre(unit)
            walk.held[unit] = k
            unit.forward_skipped()
            return
        walk.held.pop(unit, None)
        unit.forward_skipped_end(grad_follows=flag == GRAD and self.in_training_forward)
        if self.in_training_forward and flag != NO_BACKWARD:
            self._enter_orders(unit)  # no gradient here: zero-filled, see [Note: collective order]

    def _end_walk(self, walk: "_Walk") -> None:
        """The root's forward ends: label this forward's checkpoint regions
        from the order, and keep what a training forward agreed on."""
        self._walk = None
        order = walk.order
        if walk.agree:
            if self.in_training_forward:
                self._label_regions(walk)
            walk.learned.add(order, self.units)
        if not self.in_training_forward:
            return
        for k in range(len(order)):
            if order.pre[k] and order.region[k] >= 0:  # rank-independent keys (see the Note)
                self._regions.setdefault(order.units[k], set()).add((walk.base, order.region[k]))

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
            for u in self.units:
                for g in u.groups:
                    if g.world > 1 and g.pg not in shard:
                        shard.append(g.pg)
                    if g.replicate_pg is not None and g.replicate_pg not in replicate:
                        replicate.append(g.replicate_pg)
            self._order_pgs = (shard, replicate)
        return self.streams.min_across(values, *self._order_pgs)

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

    def prefetch_forward(self, unit: Unit) -> None:
        """Issue the all-gathers of the units expected to run after ``unit``.

        Same on every rank: the order is the last training step's, and which
        units are sharded is rank-independent. Only inside a training forward
        of the root: a prefetch an eval forward leaves unconsumed (an inner
        unit called directly) would be resharded by nothing, and go stale at
        the next optimizer step; a training step's leftovers are resharded by
        its final callback or the next step's root forward.
        """
        if not self.in_training_forward:
            return
        targets = unit.forward_prefetch
        if targets is None:
            targets = self.last_step_order.next_units(unit, self.settings.prefetch_depth)
        for v in targets:
            if not v.is_unsharded:
                trace("prefetch", v.fqn, "forward")
                v.unshard()

    def gather_in_bucket(self, unit: Unit) -> bool:
        """All-gather ``unit`` and the units after it in the current order (the
        last step's forward order in a training forward, the gather order in
        backward) as one bucket, if all-gather buckets are on and at least two
        fit. A bucket is a maximal run of consecutive units that are sharded
        and together write at most the bucket size: a function of the order,
        the sizes and the sharded states, which every rank shares, so every
        rank issues the same collectives."""
        limit = self.settings.gather_bucket_bytes
        if limit <= 0 or not self.communicates:
            return False
        if self._callback_queued:  # in backward
            pos, order = self._gather_positions(), self._gather_order
        elif self.in_training_forward:
            pos, order = self.last_step_order.position, self.last_step_order.execution_order
        else:
            return False  # eval: nothing would reshard what a bucket fetched ahead
        i = pos.get(unit)
        if i is None:
            return False
        units, total = [], 0
        backward = self._callback_queued
        for v in order[i:]:
            nbytes = v.gather_bytes()
            if nbytes is None or (units and total + nbytes > limit) \
                    or (backward and not v.unshard_in_backward):
                break
            units.append(v)
            total += nbytes
        if len(units) < 2:
            return False
        by_key: dict[tuple, list] = {}
        for v in units:
            trace("all_gather", v.fqn, "bucketed")
            for g in v.groups:
                by_key.setdefault(g.gather_key(), []).append(g)
        with label("all_gather", units[0].fqn):
            for groups in by_key.values():
                if len(groups) == 1:  # nothing to merge it with: no bucket copies
                    groups[0].unshard(self.streams)
                else:
                    gather_bucket(groups, self.streams)
        return True

    def expect_backward(self, unit: Unit, island: bool = False) -> None:
        """``unit``'s forward ended with a backward to follow, or (``island``)
        ran without grad inside the training forward."""
        if not island:
            self._grad_follows.pop(unit, None)  # keep the order of LAST post-forward
            self._grad_follows[unit] = None
        self._enter_orders(unit)

    def _enter_orders(self, unit: Unit) -> None:
        self._in_orders.pop(unit, None)
        self._in_orders[unit] = None
        self._clock += 1
        self._last_post[unit] = self._clock

    def expects_backward(self, unit: Unit) -> bool:
        return unit in self._grad_follows

    # ----------------------------------------------------------------- backward
    def on_backward_hook(self) -> None:
        if not self._callback_queued:
            if self.checks is not None:
                _divergence.raise_if_stopped(self.root.fqn)
                self.checks.before(_divergence.BACKWARD, *self._schedule_settings())
            self._callback_queued = True
            self._outer_task = _compat.graph_task_id()
            self.last_step_order.set_order(list(self._step_order))
            _compat.queue_final_callback(self._final_callback)

    def in_nested_backward(self) -> bool:
        """Inside a backward that runs within ours (a reentrant checkpoint)."""
        return _compat.graph_task_id() != self._outer_task

    def reduce_order(self) -> list[Unit]:
        if self._order is None:
            order = [u for u in reversed(self._step_order) if u in self._in_orders]
            self._order = order + [u for u in self._pending
                                   if u not in self._in_orders and u.completes_reduction()]
        return self._order

    def unshard_for_backward(self, unit: Unit, need: bool = True) -> None:
        """Issue the all-gather of ``unit`` (unless not ``need``ed: see
        set_unshard_in_backward) and, first, of every unit before it in the
        gather order; then prefetch (no wait). Prefetching is more of the same
        prefix, so it never reorders collectives. Units that do not unshard in
        backward are skipped in that order, on every rank alike."""
        if unit in self._in_orders:
            # On gloo a unit resharded after forward prefetches once its
            # gradients are computed, see [Note: gloo backward] in _unit.py; a
            # unit that kept its parameters (the root), or whose gradients have
            # no hook (frozen), prefetches now.
            late = unit.grads_hooked and unit.reshard_after_forward
            self._gather_up_to(self._prefetch_stop(unit, prefetch=not late))
        if need:
            unit.unshard()

    def _prefetch_stop(self, unit: Unit, prefetch: bool = True) -> int:
        pos = self._gather_positions()
        stop = pos[unit]
        if not prefetch:
            return stop
        stop += self.settings.prefetch_depth
        if unit.backward_prefetch is not None:
            stop = max([pos[unit]] + [pos[v] for v in unit.backward_prefetch if v in pos])
        return min(stop, len(pos) - 1)

    def prefetch_backward_late(self, unit: Unit) -> None:
        """See [Note: gloo backward] in _unit.py (a no-op for what was prefetched)."""
        if unit in self._in_orders:
            self._gather_up_to(self._prefetch_stop(unit))

    def _gather_positions(self) -> dict[Unit, int]:
        if self._gather_order is None:
            self._gather_order = list(reversed(self._in_orders))
            self._gather_pos = {u: i for i, u in enumerate(self._gather_order)}
        return self._gather_pos

    def _gather_up_to(self, stop: int, final: bool = False) -> None:
        """Issue the gather order up to index ``stop``, each all-gather after
        the reduce-scatters slotted before it (see [Note: one order across
        communicators])."""
        while self._gather_next <= stop:
            self._issue_reductions(demand=True, final=final)
            self._gather_next += 1
            unit = self._gather_order[self._gather_next - 1]
            if unit.unshard_in_backward:
                unit.unshard()
        self._issue_reductions(final=final)

    def _reduces(self, unit: Unit) -> bool:
        return bool(unit.trainable) and unit.requires_gradient_sync

    def _slot_of(self) -> list[int]:
        """[i]: the gather index after which the i-th unit of the reduce order
        may reduce-scatter (see the Note); once per backward."""
        if self._slots is None:
            gather, pos = self._gather_order, self._gather_positions()
            region_end: dict = {}
            for u, regions in self._regions.items():
                for r in regions:
                    if u in pos:
                        region_end[r] = max(region_end.get(r, -1), pos[u])
            reach, best = [], -1  # reach[g]: the furthest index gather[:g + 1] prefetch
            for u in gather:
                best = max(best, self._prefetch_stop(u))
                reach.append(best)
            slots, ended, floor = [], 0, 0
            for u in self.reduce_order():  # first pre-forward, latest first
                if u not in self._first_pre:  # pending from an earlier backward: last
                    floor = max(floor, len(gather) - 1)
                    slots.append(floor)
                    continue
                while ended < len(gather) and self._last_post[gather[ended]] > self._first_pre[u]:
                    ended += 1  # gather[:ended]: forwards that ended after u's began
                last = max([ended - 1] + [region_end[r] for r in self._regions.get(u, ())])
                floor = max(floor, reach[last])
                slots.append(floor)
            self._slots = slots
        return self._slots

    def _no_gradient_here(self, unit: Unit) -> bool:
        """At a demand past ``unit``'s slot: no gradient will come for it on this
        rank (see the Note), and this backward reduces gradients at all (not
        ``autograd.grad(loss, inputs)``). Asked of the engine, once per backward."""
        if self.in_nested_backward():
            return False  # the engine would answer for the nested backward
        if self._gets_grad is None:
            self._gets_grad = {u: any(_compat.will_execute(g.split_node.next_functions[0][0])
                                      for g in u.trainable if g.split_node is not None)
                               for u in self.reduce_order() if self._reduces(u)}
        return any(self._gets_grad.values()) and not self._gets_grad.get(unit, False)

    def grads_ready(self, unit: Unit) -> None:
        if not unit.requires_gradient_sync:
            return  # flat.grad stays and accumulates; the next synced backward reduces it
        if unit in self._launched or unit not in self._in_orders:
            # a second gradient for a unit already reduced (see Unit._pre_backward),
            # or a unit outside the backward order (reentrant recomputation): now
            self._launch(unit)
            return
        self._ready.add(unit)
        self._issue_reductions()

    def _issue_reductions(self, demand: bool = False, final: bool = False) -> None:
        """Issue the reduce-scatters whose turn came: in the reduce order, each
        once the all-gather of its slot is issued. Ready ones only, except
        ``demand`` (the next all-gather is wanted: the ones slotted before it go
        first, zero-filled where no gradient comes) and ``final`` (all of them)."""
        if final and not self.accumulated:
            return  # e.g. autograd.grad(loss, inputs): p.grad untouched
        order, slots = self.reduce_order(), self._slot_of()
        while self._next < len(order):
            unit = order[self._next]
            if not self._reduces(unit):
                self._next += 1  # nothing to reduce (frozen, or accumulating)
                continue
            if slots[self._next] >= self._gather_next:
                break  # its slot's all-gather is not issued yet
            if unit not in self._ready and not final:
                if not (demand and self._no_gradient_here(unit)):
                    break  # (a demand that cannot wait for it issues its all-gather anyway)
            self._next += 1
            if self.settings.bucket_bytes <= 0 or not self.communicates:
                self._launch(unit)
                continue
            # A bucket ends before the next unit to reduce would take it past
            # the byte limit (a larger unit goes alone), or at the last unit to
            # reduce: a function of the reduce order and the sizes only (never
            # of timing), so every rank buckets alike.
            self._bucket.append(unit)
            self._bucket_bytes += _grad_bytes(unit)
            following = self._next_reduced_bytes()[self._next]
            if following is None or self._bucket_bytes + following > self.settings.bucket_bytes:
                self._launch_bucket()

    def _next_reduced_bytes(self) -> list:
        """[i]: flat-gradient bytes of the first unit at index >= i of the reduce
        order that has something to reduce (None: no such unit); once per backward."""
        if self._following is None:
            order = self.reduce_order()
            out, following = [None] * (len(order) + 1), None
            for i in range(len(order) - 1, -1, -1):
                u = order[i]
                if u.trainable and u.requires_gradient_sync:
                    following = _grad_bytes(u)
                out[i] = following
            self._following = out
        return self._following

    def _launch_bucket(self) -> None:
        units, self._bucket, self._bucket_bytes = self._bucket, [], 0
        self._drain()
        by_key: dict[tuple, list] = {}
        for u in units:
            self._launched.add(u)
            got = any(g.flat.grad is not None for g in u.trainable)
            trace("reduce_scatter", u.fqn, "bucketed" if got else "bucketed zero-filled")
            for g in u.trainable:
                by_key.setdefault(g.bucket_key(), []).append(g)
        with label("reduce_scatter", units[-1].fqn):
            self._in_flight = [launch for groups in by_key.values()
                               for launch in launch_bucket(groups, self.streams)]
        self._maybe_wait()

    def _launch(self, unit: Unit) -> None:
        self._drain()  # also folds an earlier part of this unit's gradient first
        self._launched.add(unit)
        self._in_flight = unit.launch_reduce_scatters()
        self._maybe_wait()

    def _maybe_wait(self) -> None:
        if not self.settings.overlap_reduce_scatter:
            self._drain()  # memory over speed: no flat gradient outlives its unit's backward

    def finish_in_flight(self) -> None:
        """Wait for the reduce-scatters in flight now: see [Note: gloo backward].
        An HSDP reduction's all-reduce across replicas (issued by its fold, and
        blocking on gloo) is left to the next drain, which the one sequence
        places (see [Note: one order across communicators]): issued here, at a
        moment of this rank's own graph, it could block while a replica waits
        for an all-gather of this rank's shard group (a cycle across the groups
        when units run on some ranks only)."""
        for launch in self._in_flight:
            if launch.group.replicate_pg is None:
                launch.finish()
            else:  # keep the output only: the flat gradient goes now, as it would
                launch.pending = self.streams.ready(launch.pending.wait())
        self._in_flight = [launch for launch in self._in_flight if not launch.done]

    def _drain(self) -> None:
        for launch in self._in_flight:
            launch.finish()
        self._in_flight = []

    @_compat.outside_functorch
    def _final_callback(self) -> None:
        with label("final_callback", self.root.fqn):
            trace("final_callback", self.root.fqn)
            # All-gathers this rank's graph never asked for (a unit whose
            # backward did not reach it here) may be awaited by another rank:
            # finish the one sequence (see the Note), zero-filling what is left.
            self._gather_up_to(len(self._gather_positions()) - 1, final=True)
            self._issue_reductions(final=True)
            if self.accumulated:  # else e.g. autograd.grad(loss, inputs): p.grad untouched
                for u in self.reduce_order():
                    if u.trainable and not u.completes_reduction():
                        self._pending[u] = None
                    else:
                        self._pending.pop(u, None)
            if self.settings.is_last_backward or self.streams.host_work_pending:
                self._drain()
                self.streams.finish_host_work()  # CUDA offload: the one sync
            # else (set_is_last_backward(False)): the last reduce-scatter stays in
            # flight, overlapping the next microbatch's forward; the next
            # backward's first launch (or a last backward) folds it into p.grad
            for u in self.units:
                u.finish_backward()
            self._reset_backward()
            self._new_step = True

    def _reset_backward(self) -> None:
        self._callback_queued = False
        self.accumulated = False
        self._order = None
        self._gather_order = None
        self._gather_next = 0
        self._next = 0
        self._slots = None
        self._gets_grad = None
        self._ready.clear()
        self._launched.clear()
        self._bucket, self._bucket_bytes, self._following = [], 0, None

    # ---------------------------------------------------------------- divergence
    def _schedule_settings(self) -> tuple:
        """(settings, describe): what shapes a phase's collectives besides the
        forward itself, as ints and bools only (hashed alike in every process),
        and a function explaining them in lines (see [Note: divergence]).
        Recomputed only after a setter or a requires_grad change."""
        if self._settings[0] != _divergence.settings_generation:
            self._settings = (_divergence.settings_generation, self._make_settings())
        return self._settings[1]

    def _make_settings(self) -> tuple:
        root, index = self.settings, self.checks.index
        settings = (root.prefetch_depth, root.bucket_bytes, root.gather_bucket_bytes,
                    root.is_last_backward, root.forward_order_dynamic, tuple(
                        (u.requires_gradient_sync, u.reshard_after_forward,
                         u.reshard_after_backward, u.unshard_in_backward,
                         tuple(g.requires_grad for g in u.groups),
                         tuple(g.requires_all_reduce for g in u.groups
                               if g.replicate_pg is not None),
                         _positions(index, u.forward_prefetch),
                         _positions(index, u.backward_prefetch))
                        for u in self.units))
        names = self.checks.names

        def describe() -> list[str]:
            depth, rs_bytes, ag_bytes, last, dynamic, per = settings
            return [_where(names, per, lambda s: not s[0], "set_requires_gradient_sync(False)"),
                    _where(names, per, lambda s: False in s[5], "set_requires_all_reduce(False)"),
                    _where(names, per, lambda s: not s[1], "reshard_after_forward False"),
                    _where(names, per, lambda s: not s[2], "set_reshard_after_backward(False)"),
                    _where(names, per, lambda s: not s[3], "set_unshard_in_backward(False)"),
                    _where(names, per, lambda s: False in s[4], "frozen parameter groups"),
                    _where(names, per, lambda s: s[6] != -1 or s[7] != -1,
                           "explicit prefetch (set_modules_to_*_prefetch)"),
                    f"root: prefetch depth {depth}, reduce-scatter bucket {rs_bytes} B, "
                    f"all-gather bucket {ag_bytes} B, is_last_backward {last}, "
                    f"forward_order_dynamic {dynamic}"]
        return settings, describe

    def _left_half_done(self) -> None:
        """This rank left its last step half-done (an exception inside its
        forward or backward): go on only if every rank left it at the same
        collective, else raise (see [Note: divergence])."""
        busy = [f"'{u.fqn or '<root>'}' ({u.state.name})" for u in self.units
                if u.state is not TrainingState.IDLE]
        where = ", ".join(busy[:4]) + (f" and {len(busy) - 4} more" if len(busy) > 4 else "")
        where = f"units not finished: {where}" if busy else "its backward did not finish"
        self.checks.left(_collectives.issued(), where)

    def _abort_step(self) -> None:
        for launch in self._in_flight:  # never drop what a side stream still writes
            self.streams.abandon(launch.pending)
            launch.used.release()  # (its used-flags' all-reduce likewise)
        self._in_flight = []
        self.streams.abort()
        self._pending.clear()  # (drop_grad below forgets what they accumulated)
        for u in self.units:
            for g in u.groups:
                g.drop_grad()
            u.finish_backward()
        self._reset_backward()
        self._new_step = True


# ---------------------------------------------------------------------------
def _positions(index: dict, units: list | None):
    return -1 if units is None else tuple(index.get(v, -1) for v in units)


def _where(names: list[str], per: tuple, pick, what: str) -> str:
    hit = [n for n, s in zip(names, per) if pick(s)]
    shown = ", ".join(f"'{n}'" for n in hit[:6]) + (f" and {len(hit) - 6} more"
                                                     if len(hit) > 6 else "")
    return f"{what} on: {shown or 'no unit'}"


LEARNING_FORWARDS = 8  # forwards of a kind that agree on the order while a unit is missing
_OPEN_MAX = 1 << 40    # agreement codes of post events (see RootContext._agree)
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

    def __init__(self, order: ForwardOrder, agree: bool, base: int, learned: _Learned):
        self.order = order    # the learned order, or (agree) the one agreed in this forward
        self.agree = agree
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


def _grad_bytes(unit: Unit) -> int:
    return sum(g.padded_numel * g.reduce_dtype.itemsize for g in unit.trainable)


def assign_fqns(module: nn.Module) -> None:
    """Name every unit and parameter below ``module`` relative to it."""
    prefix = {id(m): name for name, m in module.named_modules()}
    for fqn, u in units_below(module):
        u.fqn = fqn
        for g in u.groups:
            g.unit_fqn = u.fqn
            for e in g.entries:
                m, attr = e.slots[0]
                if id(m) in prefix:
                    e.fqn = f"{prefix[id(m)]}.{attr}" if prefix[id(m)] else attr


def lazy_init_root(unit: Unit) -> None:
    """Make ``unit`` the root of every unit in its subtree."""
    root_module = unit.modules[0]
    if len(unit.modules) == 1:
        assign_fqns(root_module)
    units = list(dict.fromkeys(u for m in unit.modules for _, u in units_below(m)))
    _check_not_meta(unit, units)
    _check_root_settings(unit, units)
    for u in units:
        _check_params(u)
    # a root without parameters of its own (a Sequential of sharded blocks)
    # communicates where its mesh lives, like the units it holds
    device = unit.groups[0].device if unit.groups else unit.device
    ctx = RootContext(unit, units, device)
    ctx.communicates = any(g.world > 1 for u in units for g in u.groups)
    for u in units:
        u.ctx = ctx
        raf = u.user_reshard_after_forward
        u.reshard_after_forward = (u is not unit) if raf is None else bool(raf)
        if u.groups and all(g.aliased for g in u.groups):
            # world size 1, no cast/offload: the "unsharded" flat IS the shard,
            # resharding frees nothing; skip the swap-out/swap-in per step
            u.reshard_after_forward = False
    pgs = _check_groups(units)
    if pgs:  # see [Note: divergence] in _divergence.py
        for m in unit.modules:  # (removed with the unit's other hooks)
            unit.hook_handles.append(m.register_forward_hook(_forward_ended(unit),
                                                             always_call=True))
        ctx.checks = _divergence.StepChecks(unit.fqn, pgs, units)
        ctx.checks.lazy_init(_layout_lines(units))
    # world size 1: plain PyTorch's forward and backward for the passive units
    passive = [u for u in units if u is not unit and u.passive and not ctx.communicates]
    for u in passive:
        u.remove_forward_hooks()
    trace("lazy_init", unit.fqn, f"units={len(units)}"
          + (f", {len(passive)} without hooks" if passive else ""))


def _forward_ended(unit: Unit):
    def hook(module, args, output):
        unit.forward_ended()
    return torch.compiler.disable(hook, reason="fsdp_compose's forward hooks run eagerly")


def _check_groups(units: list[Unit]) -> list:
    """[(process group, device)]: the groups the units communicate on (HSDP:
    the replicas' too), each with the device its collectives run on."""
    pgs: dict = {}
    for u in units:
        for g in u.groups:
            for pg in (g.pg, g.replicate_pg):
                if pg is not None and dist.get_world_size(pg) > 1:
                    pgs.setdefault(pg, g.device)
    return list(pgs.items())


def _layout_lines(units: list[Unit]) -> list[str]:
    """One line per unit: what every rank must have alike (the lazy-init check)."""
    lines = []
    for u in units:
        parts = []
        for g in u.groups:
            params = ", ".join(f"{e.fqn} {tuple(e.shape)}" for e in g.entries)
            pf = f", kept over {g.post_forward.size} after forward" if g.post_forward else ""
            parts.append(f"{str(g.dtype).replace('torch.', '')}"
                         f"{'' if g.requires_grad else ' frozen'} over {g.world} ranks{pf}: "
                         f"{params}")
        lines.append(f"unit '{u.fqn or '<root>'}': " + ("; ".join(parts) or "no parameters"))
    return lines


def _check_not_meta(root: Unit, units: list[Unit]) -> None:
    meta = [e.fqn for u in units for g in u.groups if g.device.type == "meta" for e in g.entries]
    if meta:
        shown = ", ".join(meta[:8]) + (f" and {len(meta) - 8} more" if len(meta) > 8 else "")
        raise unit_error(root.fqn, f"{len(meta)} parameters are still on the meta device at "
                         f"the first forward: {shown}.", META_FIX)


def _check_root_settings(root: Unit, units: list[Unit]) -> None:
    """A root-only setting (FSDPModule._root_setting) called on a unit that did
    not become the root would be silently ignored: say so instead."""
    for u in units:
        if u is not root and u.root_settings.called:
            where = sorted(u.root_settings.called)[0]
            raise unit_error(u.fqn, f"{where}() was called on this unit, but it is not the "
                             f"root ('{root.fqn or '<root>'}' is): the setting would be ignored.",
                             root_setting_fix(where), exc=ValueError)


def _check_params(u: Unit) -> None:
    for g in u.groups:
        for e in g.entries:
            for m, attr in e.slots:
                held = m._parameters.get(attr)
                if held is not e.sharded and held is not e.unsharded:
                    raise unit_error(
                        u.fqn, f"parameter '{e.fqn}' was replaced after fully_shard.",
                        "Assign or re-initialise parameters before calling fully_shard, not "
                        "after (in place, under torch.no_grad(), is fine); cast or move the "
                        "module fully_shard was applied to (or the whole model), not a module "
                        "inside it.")
            if e.sharded.untyped_storage().data_ptr() != g.shard.untyped_storage().data_ptr():
                raise unit_error(
                    u.fqn, f"parameter '{e.fqn}' no longer aliases its shard (its .data was "
                    "replaced: p.data = ..., or .to() / to_empty() on a module inside the unit).",
                    "Cast or move the module fully_shard was applied to (or the whole model), "
                    "which casts the shards; or do it before fully_shard.")
