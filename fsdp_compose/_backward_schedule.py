"""The backward's collectives of a root: the gather order, the reduce order,
each reduce-scatter's slot in the one sequence of both, reduce buckets, and
the reduce-scatters in flight.

``BackwardSchedule`` is the backward part of ``RootContext`` (_state.py
holds the step lifecycle and sets every attribute: its ``_final_callback``
finishes the sequence, ``reset`` clears it; _forward_walk.py
records the forward the orders derive from). It is a mixin: it writes
``_gather_order``, ``_gather_pos``, ``_gather_next``, ``_order``, ``_next``,
``_slots``, ``_gets_grad``, ``_ready``, ``_launched``, ``_in_flight``,
``_bucket``, ``_bucket_bytes`` and ``_following``; it reads the forward's
record (``_step_order``, ``_in_orders``, ``_first_pre``, ``_last_post``,
``_regions``), ``_pending``, ``accumulated``, ``units``, ``settings``,
``streams``, ``communicates`` and ``in_nested_backward()``.

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
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import _compat
from ._common import Gather, Reshard, label, trace
from ._grad_path import launch_bucket

if TYPE_CHECKING:
    from ._unit import Unit


class BackwardSchedule:
    """The backward gather order and reduce-scatter schedule of ``RootContext``."""

    def reduce_order(self) -> list[Unit]:
        if self._order is None:
            order = [u for u in reversed(self._step_order) if u in self._in_orders]
            self._order = order + [u for u in self._pending
                                   if u not in self._in_orders and u.completes_reduction()]
        return self._order

    def _prefetch_stop(self, unit: Unit, prefetch: bool = True) -> int:
        pos = self._gather_positions()
        stop = pos[unit]
        if not prefetch:
            return stop
        stop += self.settings.prefetch_depth
        if unit.backward_prefetch is not None:
            stop = max([pos[unit]] + [pos[v] for v in unit.backward_prefetch if v in pos])
        return min(stop, len(pos) - 1)

    def grads_computed(self, unit: Unit, group) -> None:
        """[Note: gloo backward] ``group``'s split node is about to ``cat`` the
        gradients of its views into the flat gradient (``unit`` reports it,
        from the node's pre-hook): all of them are computed, and that cat,
        with the views' gradients still alive, is the peak of a unit's
        backward. Where waiting blocks the CPU (gloo), first:

        1. free the group's unsharded flat, instead of at the post-backward
           (``RootContext.reshard``, GRADS_COMPUTED): every backward node that
           reads its views has run (each produces a gradient for them) and the
           cat reads none. Only for a unit used once this step, outside a
           nested (reentrant) backward: with several uses each use's views
           have their own split node, and an earlier use still reads the
           parameters. Per group: another group's views may still be read;
        2. only then prefetch the next unit(s) of the gather order (see
           ``RootContext.gather``: such a unit did not prefetch at its
           pre-backward), so at most one unsharded unit is alive with the
           gradients and the reduce-scatter in flight (a no-op for what was
           prefetched);
        3. finish the reduce-scatter in flight (the previous unit's: its
           gradient shard is made, its flat gradient freed), instead of at this
           unit's post-backward right after the cat.

        The order is for the allocator: each buffer is freed right before the
        one of its size that replaces it is made (this unit's flat, then the
        next unit's; the previous unit's flat gradient, once its shard is
        copied out, then this unit's cat), so the same block is handed back.
        Waiting first freed two same-size buffers before either replacement
        was made, and glibc's heap grew instead: peak RSS rose by about a
        model's worth of flat gradients every step on a deep stack of 8 MB
        units (below glibc's mmap threshold); see docs/design.md, "Backward
        on gloo".

        On NCCL a wait only orders streams (waiting here would stall compute)
        and the schedule is FSDP2's. Measured in docs/design.md ("Backward on
        gloo").
        """
        self.reshard(unit, Reshard.GRADS_COMPUTED, group=group)
        if unit in self._in_orders:
            self._gather_up_to(self._prefetch_stop(unit))
        self.finish_in_flight()

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
            self.gather(self._gather_order[self._gather_next - 1], Gather.IN_ORDER)
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

    def reduce(self, unit: Unit) -> None:
        """``unit``'s gradients are all accumulated in this backward (its
        post-backward): reduce-scatter them when their turn comes (see the
        Note), or at once outside the order."""
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
        self._in_flight = unit.launch_reduce_scatters(self.streams)
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


def _grad_bytes(unit: Unit) -> int:
    return sum(g.padded_numel * g.reduce_dtype.itemsize for g in unit.trainable)
