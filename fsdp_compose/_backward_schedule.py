"""The backward's collectives of a root: the reduce-scatters issued in the one
sequence of the backward's plan (``_backward_plan.BackwardPlan``), reduce
buckets, and the reduce-scatters in flight.

``BackwardSchedule`` is a part of ``RootContext`` (its field ``backward``):
it owns where the running backward stands in its plan (the next all-gather
and reduce-scatter to issue, the units ready, launched, in flight, the open
bucket) and the units an earlier backward left unreduced (``pending``). It
builds the plan from the root's ``StepRecord`` at the backward's first need
and drops it at ``reset``. Every all-gather and free is still the root's
decision (``RootContext.gather`` / ``reshard``).

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

from typing import TYPE_CHECKING

from . import _compat, _group_ops
from ._backward_plan import BackwardPlan, build_plan
from ._common import Gather, Reshard, TrainingState, label, trace

if TYPE_CHECKING:
    from ._state import RootContext
    from ._unit import Unit


class BackwardSchedule:
    """The backward running now, against its plan (see the module docstring)."""

    def __init__(self, ctx: "RootContext"):
        self.ctx = ctx
        # units in the reduce order of a backward that did not finish their
        # reduction (Unit.completes_reduction), not finished since: every rank
        # alike (see [Note: collective order])
        self.pending: dict[Unit, None] = {}
        self.accumulated = False  # a flat gradient arrived in this backward
        self.in_flight: list = []  # the reduce-scatter launches not finished
        self._clear()

    def _clear(self) -> None:
        self._plan: BackwardPlan | None = None
        self._gather_next = 0      # next index of the gather order to all-gather
        self._next = 0             # next index of the reduce order to reduce-scatter
        self._gets_grad: dict | None = None  # will the engine give it one
        self._ready: set = set()
        self._launched: set = set()
        self._bucket: list = []    # units waiting to be reduced as one bucket
        self._bucket_bytes = 0     # ... and their flat gradients' size
        # units whose flat gradient the outer backward accumulates into too
        # (asked of the engine at their pre-backward outside a nested backward)
        self._grad_in_outer: dict = {}

    @property
    def plan(self) -> BackwardPlan:
        """This backward's plan, made from the step's record at its first need."""
        if self._plan is None:
            ctx = self.ctx
            self._plan = build_plan(
                ctx.record, self.pending, prefetch_depth=ctx.settings.prefetch_depth,
                backward_prefetch=lambda u: u.settings.backward_prefetch,
                completes=lambda u: u.completes_reduction(), reduces=_reduces,
                grad_bytes=_grad_bytes, bucket_bytes=ctx.settings.bucket_bytes)
        return self._plan

    def grads_computed(self, unit: Unit, group) -> None:
        """[Note: gloo backward] ``group``'s split node is about to ``cat`` its
        views' gradients into the flat gradient (``unit`` reports it from the
        node's pre-hook): all are computed, and that cat is the peak of a
        unit's backward. Where waiting blocks the CPU (gloo), first, in order:

        1. free the group's unsharded flat (``Reshard.GRADS_COMPUTED``): no
           node left reads its views. Only for a unit used once this step,
           outside a nested backward (each use has its own split node);
        2. then prefetch the next unit(s) of the gather order (such a unit did
           not prefetch at its pre-backward): one unsharded unit at the peak;
        3. finish the reduce-scatter in flight (the previous unit's).
        Each buffer is freed right before the one of its size that replaces
        it is made, so glibc's heap hands the same block back (docs/design.md,
        "Backward on gloo"). On NCCL a wait only orders streams (waiting here
        would stall compute): the schedule is FSDP2's.
        """
        ctx = self.ctx
        ctx.reshard(unit, Reshard.GRADS_COMPUTED, group=group)
        if unit in ctx.record.in_orders:
            self.gather_up_to(self.plan.stop(unit))
        self.finish_in_flight()

    def pre_backward(self, unit: Unit) -> None:
        """A gradient reached ``unit``'s outputs: gather it (and what comes
        before it in the gather order). After its gradients were already
        reduced in this backward (a reentrant checkpoint inside a unit called
        twice: each call's gradient comes in its own nested backward) it is
        gathered again, and its next post-backward reduces the rest
        (reduce-scatter is linear: the parts add up in the gradient shard)."""
        ctx = self.ctx
        if unit.state is TrainingState.POST_BACKWARD:
            trace("pre_backward_again", unit.fqn, unit.state.name)
            unit.start_backward()
            ctx.gather(unit, Gather.AGAIN)
            unit.wait_for_unshard()
            return
        trace("pre_backward", unit.fqn, unit.state.name)
        unit.start_backward()
        if not ctx.in_nested_backward():  # will the outer backward accumulate into it
            self._grad_in_outer[unit] = any(
                _compat.will_execute(g.split_node.next_functions[0][0])
                for g in unit.trainable if g.split_node is not None)
        with label("pre_backward", unit.fqn):
            ctx.gather(unit, Gather.BACKWARD)
            unit.wait_for_unshard()

    def grads_ready(self, unit: Unit) -> None:
        """Every trainable group of ``unit`` accumulated its flat gradient.

        Inside a nested backward (a reentrant checkpoint inside the unit, each
        use's gradient in its own nested backward), while uses are still to
        come or the outer backward brings a part too (parameters used outside
        the checkpoint), this is a part: the unit stays gathered and flat.grad
        accumulates. (Reducing the part at once, and the rest again, would
        depend on each rank's graph: when a unit is skipped on another rank,
        the ranks would issue different reduce-scatters.) Else: the unit's
        AFTER_BACKWARD reshard decision, the unsynced stash
        (``set_requires_gradient_sync(False)``), and its reduction."""
        ctx = self.ctx
        if ctx.in_nested_backward() and (unit.more_uses_to_come()
                                         or self._grad_in_outer.get(unit, False)):
            trace("partial_grad", unit.fqn, unit.state.name)
            unit.keep_accumulating()
            return
        trace("post_backward", unit.fqn, unit.state.name)
        unit.end_backward()
        ctx.reshard(unit, Reshard.AFTER_BACKWARD)
        if not unit.settings.requires_gradient_sync:
            for g in unit.trainable:
                g.grad.stash_unsynced_grad()
        self.reduce(unit)

    def gather_up_to(self, stop: int, final: bool = False) -> None:
        """Issue the gather order up to index ``stop``, each all-gather after
        the reduce-scatters slotted before it (see [Note: one order across
        communicators])."""
        order = self.plan.gather_order
        while self._gather_next <= stop:
            self._issue_reductions(demand=True, final=final)
            self._gather_next += 1
            self.ctx.gather(order[self._gather_next - 1], Gather.IN_ORDER)
        self._issue_reductions(final=final)

    def _no_gradient_here(self, unit: Unit) -> bool:
        """At a demand past ``unit``'s slot: no gradient will come for it on this
        rank (see the Note), and this backward reduces gradients at all (not
        ``autograd.grad(loss, inputs)``). Asked of the engine, once per backward."""
        if self.ctx.in_nested_backward():
            return False  # the engine would answer for the nested backward
        if self._gets_grad is None:
            plan = self.plan
            self._gets_grad = {u: any(_compat.will_execute(g.split_node.next_functions[0][0])
                                      for g in u.trainable if g.split_node is not None)
                               for u, does in zip(plan.reduce_order, plan.reduces) if does}
        return any(self._gets_grad.values()) and not self._gets_grad.get(unit, False)

    def reduce(self, unit: Unit) -> None:
        """``unit``'s gradients are all accumulated in this backward (its
        post-backward): reduce-scatter them when their turn comes (see the
        Note), or at once outside the order."""
        if not unit.settings.requires_gradient_sync:
            return  # flat.grad stays and accumulates; the next synced backward reduces it
        if unit in self._launched or unit not in self.ctx.record.in_orders:
            # a second gradient for a unit already reduced (see Unit._pre_backward),
            # or a unit outside the backward order (reentrant recomputation): now
            self._launch([unit])
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
        plan = self.plan
        order = plan.reduce_order
        bucketed = self.ctx.settings.bucket_bytes > 0 and self.ctx.communicates
        while self._next < len(order):
            i, unit = self._next, order[self._next]
            if not plan.reduces[i]:
                self._next += 1  # nothing to reduce (frozen, or accumulating)
                continue
            if plan.slots[i] >= self._gather_next:
                break  # its slot's all-gather is not issued yet
            if unit not in self._ready and not final:
                if not (demand and self._no_gradient_here(unit)):
                    break  # (a demand that cannot wait for it issues its all-gather anyway)
            self._next += 1
            if not bucketed:
                self._launch([unit])
                continue
            self._bucket.append(unit)  # (the plan's bucket_ends: see _backward_plan.py)
            if plan.bucket_ends[i]:
                units, self._bucket = self._bucket, []
                self._launch(units, bucket=True)

    def _launch(self, units: list[Unit], bucket: bool = False) -> None:
        """Launch the reduce-scatters of ``units``: one unit's groups each
        alone, or (``bucket``) a reduce bucket, one collective per key."""
        self.drain()  # also folds an earlier part of a unit's gradient first
        for u in units:
            self._launched.add(u)
            got = any(g.flat.grad is not None for g in u.trainable)
            trace("reduce_scatter", u.fqn, ("bucketed" if got else "bucketed zero-filled")
                  if bucket else ("ready" if got else "zero-filled"))
        with label("reduce_scatter", units[-1].fqn):
            self.in_flight = _group_ops.reduce_scatter(units, self.ctx.streams, bucket)
        self._maybe_wait()

    def _maybe_wait(self) -> None:
        if not self.ctx.settings.overlap_reduce_scatter:
            self.drain()  # memory over speed: no flat gradient outlives its unit's backward

    def finish_in_flight(self) -> None:
        """Wait for the reduce-scatters in flight now: see [Note: gloo backward].
        An HSDP reduction's all-reduce across replicas (issued by its fold, and
        blocking on gloo) is left to the next drain, which the one sequence
        places (see [Note: one order across communicators]): issued here, at a
        moment of this rank's own graph, it could block while a replica waits
        for an all-gather of this rank's shard group (a cycle across the groups
        when units run on some ranks only)."""
        for launch in self.in_flight:
            if launch.path.group.replicate_pg is None:
                launch.finish()
            else:  # keep the output only: the flat gradient goes now, as it would
                launch.pending = self.ctx.streams.ready(launch.pending.wait())
        self.in_flight = [launch for launch in self.in_flight if not launch.done]

    def drain(self) -> None:
        for launch in self.in_flight:
            launch.finish()
        self.in_flight = []


    def abandon(self) -> None:
        """The backward is abandoned (an exception left it half-done): what
        it had in flight is dropped unread, and the pending units' gradients
        with it (``RootContext.reset`` drops them)."""
        for launch in self.in_flight:
            launch.used.release()  # (the compute stream waits its used-flags' all-reduce)
        self.ctx.streams.abort()  # (and every post-reduce: see StreamManager.abort)
        self.in_flight = []  # (only now: their buffers go back to the allocator)
        self.pending.clear()

    def end(self) -> None:
        """The backward ended: its plan and where it stood go."""
        self.accumulated = False
        self._clear()

    def note_unfinished(self) -> None:
        """The final callback of a backward that accumulated gradients: the
        units of its reduce order whose reduction did not finish stay pending."""
        for u in self.plan.reduce_order:
            if u.trainable and not u.completes_reduction():
                self.pending[u] = None
            else:
                self.pending.pop(u, None)


def _reduces(unit: Unit) -> bool:
    return bool(unit.trainable) and unit.settings.requires_gradient_sync


def _grad_bytes(unit: Unit) -> int:
    return sum(g.padded_numel * g.reduce_dtype.itemsize for g in unit.trainable)
