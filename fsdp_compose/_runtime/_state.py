"""The root: lazy initialisation, the hooks, and the state every unit below a root shares.

The first forward (or ``unshard()``) of any sharded module makes that module's
unit the *root*: it walks its subtree once, names every unit and parameter by
FQN, checks the parameters, and builds the ``RootContext`` all units then
reference: the recorded forward order, the stream manager, and the backward
bookkeeping (the plan's walk, the reduce-scatters in flight, the final callback).

[Note: one-way control] Every hook of the package enters here (the module
forward hooks through ``pre_forward`` / ``post_forward``, registered by
``fully_shard``; the autograd hooks, registered here: ``_hook``), and control
only goes down from here. ``RootContext`` *acts*; its parts decide or do their
own work and never call it back:

- ``record`` (``_backward_plan.StepRecord``): what this step's forward
  recorded for the backward orders;
- ``forward_order`` (``_forward_walk.ForwardTracker``): the forward orders,
  followed or agreed on ([Note: forward order]); it returns the events this
  rank skipped, and the root gathers or frees each (``_catch_up``);
- ``walker`` (``_backward_plan.PlanWalker``, one per backward): where the
  backward stands in its plan; it returns the all-gathers and reduce-scatters
  due, and the root performs them (``_perform``);
- ``reductions`` (``_backward_schedule.Reductions``): the reduce-scatters in
  flight and the units left unreduced;
- ``checks`` / ``fingerprint`` (``_divergence.StepChecks``,
  ``_step_checks.SettingsFingerprint``): [Note: divergence];
- ``streams`` (the backend, ``_streams.Backend``), ``last_step_order`` (``LastStepOrder``).

``RootContext`` is the step lifecycle (a training root forward starts a
step, the first pre-backward queues the final callback, which ends it; a step
an exception left half-done is aborted at the next root forward; ``reset``
ends both), the unit events (see [Note: who decides] in _unit.py) and the two
decisions every event leads to (``gather``: whether and how a unit is
all-gathered, forward prefetch and gather buckets included; ``reshard``:
whether it frees its parameters after an event).

[Note: recomputation] A forward that runs *inside* backward is activation-
checkpoint recomputation: pre_forward only makes sure the unit is unsharded;
post_forward neither reshards nor registers hooks. The unit then stays
unsharded until its post-backward (or the root's final callback).
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook

from .._base import _compat

from .._comm import _divergence

from .._group import _group_ops
from .._plan._backward_plan import GATHER, PlanWalker, StepRecord, build_plan
from ._backward_schedule import Reductions
from .._base._common import (META_FIX, Gather, Kept, Reshard, RootSettings, ShardedState,
                      TrainingState, label, root_setting_fix, trace, unit_error)
from .._plan._forward_order import GRAD, ISLAND, NO_BACKWARD
from ._forward_walk import ForwardTracker, LastStepOrder
from .._base._registry import units_below
from ._step_checks import SettingsFingerprint, left_half_done
from .._comm._streams import make_streams, runtime_for
from ._unit import IN_BACKWARD, Unit


class RootContext:
    def __init__(self, root: Unit, units: list[Unit], device: torch.device,
                 communicates: bool):
        self.root = root
        self.units = units
        self.communicates = communicates        # some group has world > 1
        self.streams = make_streams(device)  # (the backend: side streams, or blocking waits)
        self.last_step_order = LastStepOrder()
        self.record = StepRecord()
        self.forward_order = ForwardTracker(root, units, self.record, self.streams)
        self.reductions = Reductions(self.streams)
        # the lazy-init and step checks of [Note: divergence] in _divergence.py
        # (None: nothing communicates; see start_checks)
        self.checks: _divergence.StepChecks | None = None
        self.fingerprint: SettingsFingerprint | None = None
        self._new_step = True                   # the next training forward starts a step
        self.in_training_forward = False        # inside a grad-enabled forward of the root
        self._callback_queued = False           # a backward runs: its final callback queued
        self._outer_task = -1                   # graph task of the backward we finish
        # each unit's pre-backward hook (registered on its outputs every forward)
        # and each group's gradients-computed hook (on its new split node every
        # forward, where the backend runs the gloo backward): made once here
        self._pre_backward_hooks = {u: _pre_backward_hook(self, u) for u in units}
        self._grads_computed_hooks = {g: _hook("grads_computed", u, g)
                                      for u in units for g in u.groups}
        self._end_backward()

    def _end_backward(self) -> None:
        """No backward runs: its walk through the plan and what it learnt go."""
        self.walker: PlanWalker | None = None  # made from the step's record at its first need
        self.accumulated = False  # a flat gradient arrived in this backward
        self._gets_grad: dict | None = None  # will the engine give it one (see _gets_grad_now)
        # units whose flat gradient the outer backward accumulates into too
        # (asked of the engine at their pre-backward outside a nested backward)
        self._grad_in_outer: dict = {}

    @property
    def settings(self) -> RootSettings:
        """The model's settings (FSDPModule's root setters), a frozen value on
        the root unit: a lazy init again after a cast keeps them."""
        return self.root.root_settings  # type: ignore[return-value]

    def start_checks(self, checks: "_divergence.StepChecks") -> None:
        """Lazy init, where some group communicates: [Note: divergence]."""
        self.checks = checks
        self.fingerprint = SettingsFingerprint(self.root, self.units, checks)

    # ------------------------------------------------------------------ forward
    def pre_forward(self, unit: Unit, args, kwargs, entry: str = "forward"):
        """The forward pre-hook of ``unit``'s modules (``entry``: the method
        run, ``forward`` or one registered with register_fsdp_forward_method);
        returns the cast inputs (None: no cast)."""
        if _compat.in_backward():  # see [Note: recomputation]
            trace("pre_forward_recompute", unit.fqn, unit.state.name)
            if not self.record.expects_backward(unit):  # reentrant: its gradient comes next
                unit.note_use_seen()
            with _compat.functorch_disabled():
                self.gather(unit, Gather.RECOMPUTE)
                self._refresh_views(unit)
                unit.wait_for_unshard()
            return unit.cast_inputs(args, kwargs)
        if not unit.in_forward():
            unit.check_params(direct=False)
            if unit is self.root:
                self.root_pre_forward(entry)
            unit.assert_state(TrainingState.IDLE, where="pre_forward")
            with label("pre_forward", unit.fqn), _compat.functorch_disabled():
                gather = self._forward_start(unit)  # (first: units skipped here)
                trace("pre_forward", unit.fqn, unit.state.name)
                unit.sync_requires_grad()
                unit.enter(TrainingState.FORWARD, "pre_forward")
                if gather:
                    self.gather(unit, Gather.FORWARD)
                self._refresh_views(unit)
                unit.wait_for_unshard()
        unit.enter_module()
        return unit.cast_inputs(args, kwargs)

    def root_pre_forward(self, entry: str = "forward") -> None:
        if self.checks is not None:
            _divergence.raise_if_stopped(self.root.fqn, self.checks)
        if self._callback_queued or any(u.state is not TrainingState.IDLE for u in self.units):
            if self.checks is not None:
                left_half_done(self.units, self.checks)  # raises unless every rank left it alike
            self.reset(abort=True)  # a previous forward or backward raised before finishing
        if self.checks is not None:
            self.checks.before(_divergence.FORWARD if torch.is_grad_enabled()
                               else _divergence.EVAL_FORWARD,
                               *self.fingerprint.current())  # type: ignore[union-attr]
        self.in_training_forward = torch.is_grad_enabled()
        if self._new_step and torch.is_grad_enabled():  # eval forwards start no step
            self._new_step = False
            self.record.clear()
            for u in self.units:
                self.reshard(u, Reshard.NEW_STEP)
                u.start_step()
        if self.communicates:
            self.forward_order.start(entry, self.in_training_forward,
                                     self.settings.forward_order_dynamic)

    def _forward_start(self, unit: Unit) -> bool:
        """``unit``'s forward starts: its place in the forward order, the
        units this rank skipped before it caught up first ([Note: forward
        order] in _forward_walk.py). Returns whether to all-gather it now."""
        tracker = self.forward_order
        for event in tracker.forward_start(unit, self.in_training_forward):
            self._catch_up(*event)
        return tracker.gather_now

    def _catch_up(self, k: int, pre: bool, unit: Unit, flag: int) -> None:
        """Event ``k`` of the forward order, which this rank skipped (the
        tracker recorded it): take part in its all-gathers (pre) or reshard
        as its post-forward would (post)."""
        if pre:  # its all-gathers and forward prefetch, as its pre-forward would
            trace("skipped", unit.fqn, "all-gather")
            unit.sync_requires_grad()  # (whether it reduces must match where it runs)
            with label("skipped", unit.fqn):
                self.gather(unit, Gather.SKIPPED)
            return
        trace("skipped", unit.fqn, "end")  # ... and the reshard of its post-forward
        self.reshard(unit, Reshard.AFTER_FORWARD,
                     grad_follows=flag == GRAD and self.in_training_forward)
        if self.in_training_forward and flag != NO_BACKWARD:
            self.record.enter_orders(unit)  # no gradient here: zero-filled, see [Note:
            # collective order] in _backward_plan.py

    def _refresh_views(self, unit: Unit) -> None:
        """After ``unshard()`` (views need the storage), under grad: new views
        for each trainable group, and for any whose ``requires_grad`` changed.
        An aliased group (world size 1, no cast) reuses its views: its
        post-backward, late with an old split node ([Note: tensor vocabulary]
        in _flat_group.py), frees and reduce-scatters nothing. On gloo each new
        split node reports to ``grads_computed`` ([Note: gloo backward])."""
        if torch.is_grad_enabled():
            for g in unit.groups:
                trains = g.requires_grad and not g.direct
                # (any group whose requires_grad changed: its views must follow)
                if not (g._views_stale or (trains and not g.aliased)):
                    continue
                g.refresh_views()
                if g.world > 1 and g.split_node is not None and self.streams.hook_split_node(
                        g.split_node, self._grads_computed_hooks[g]):  # a new node each time
                    unit.note_grads_hooked()

    def post_forward(self, unit: Unit, output):
        """The forward hook of ``unit``'s modules: the pre-backward hook on
        its outputs, then (its last module) the end of its forward."""
        with label("post_forward", unit.fqn):  # (hook time: benchmarks/gpu_check.py)
            output = unit.cast_outputs(output)  # (recomputation too: same saved tensors)
            if _compat.in_backward():  # see [Note: recomputation]
                return output
            still_running = unit.leave_module()
            if isinstance(output, torch.Tensor):  # fast path: skip the pytree walk
                outs = [output] if output.requires_grad else []
            else:
                outs = [t for t in _compat.tree_leaves(output)
                        if isinstance(t, torch.Tensor) and t.requires_grad]
            if len(outs) == 1:  # the common case: a plain tensor hook is cheaper
                outs[0].register_hook(self._pre_backward_hooks[unit])
            elif outs:
                register_multi_grad_hook(outs, self._pre_backward_hooks[unit], mode="any")
            if outs and torch.is_grad_enabled():
                unit.note_use()
            elif not torch.is_grad_enabled() and self.in_training_forward:
                unit.note_use()  # a no-grad island in a training step: maybe a reentrant region
            if still_running:  # another module of this unit is still running
                return output
            unit.assert_state(TrainingState.FORWARD, where="post_forward")
            grad_follows = torch.is_grad_enabled() and bool(outs)
            island = not torch.is_grad_enabled() and self.in_training_forward
            with _compat.functorch_disabled():  # (first: units skipped here, _forward_walk.py)
                self.forward_end(unit, GRAD if grad_follows else ISLAND if island
                                 else NO_BACKWARD)
            unit.enter(TrainingState.IDLE, "post_forward")
            return output

    def forward_end(self, unit: Unit, flag: int) -> None:
        """``unit``'s forward ends (its post-forward, not a recomputation);
        ``flag``: what follows it (_forward_order.GRAD ...). The order's -u
        (units skipped here first), the step's record for the backward
        orders, then the AFTER_FORWARD reshard decision."""
        for event in self.forward_order.forward_end(unit, flag):
            self._catch_up(*event)
        trace("post_forward", unit.fqn, unit.state.name)
        if flag != NO_BACKWARD:  # (ISLAND: see [Note: collective order])
            self.record.expect_backward(unit, island=flag != GRAD)
        self.reshard(unit, Reshard.AFTER_FORWARD, grad_follows=flag == GRAD)
        if unit is self.root:
            self.in_training_forward = False
            if flag == NO_BACKWARD:  # CUDA offload: no end of backward will sync the copies
                self.streams.end_eval_forward()

    # ------------------------------------------------------- the two decisions
    def gather(self, unit: Unit, why: Gather) -> None:
        """Whether and how ``unit`` is all-gathered now, asked by a unit's event
        (``why``); the one place that decides it (issuing only: the unit waits).

        - FORWARD, SKIPPED: gathered (the forward order said so), then the
          forward prefetch; PREFETCH: only if still sharded;
        - BACKWARD, RECOMPUTE: first every unit before it in the gather order
          (see [Note: collective order] in _backward_plan.py), then it,
          except in BACKWARD a unit with ``unshard_in_backward`` False;
          IN_ORDER, AGAIN: it, with the same exception;
        - USER: it.
        Gathered with the units after it as one bucket where gather buckets
        are on (``_bucket``), else alone (a bucket of one)."""
        if why is Gather.BACKWARD or why is Gather.RECOMPUTE:
            if unit in self.record.in_orders:
                # On gloo a unit resharded after forward prefetches once its
                # gradients are computed, see [Note: gloo backward]; a unit
                # that kept its parameters (the root), or whose gradients have
                # no hook (frozen), prefetches now.
                late = unit.grads_hooked and unit.reshard_after_forward
                self.gather_up_to(self._walk().plan.stop(unit, prefetch=not late))
        if not unit.settings.unshard_in_backward and why in _NOT_IN_BACKWARD:
            return
        if why is Gather.PREFETCH:
            if unit.is_unsharded:
                return
            trace("prefetch", unit.fqn, "forward")
        units = self._bucket(unit)
        if len(units) > 1:
            for v in units:
                trace("all_gather", v.fqn, "bucketed")
            with label("all_gather", unit.fqn):
                _group_ops.all_gather(units, self.streams, bucket=True)
        else:  # (a bucket of one; it may install a copy, or nothing, without a collective)
            issues = unit.would_gather()
            _group_ops.all_gather(units, self.streams, bucket=False)
            if issues:
                trace("all_gather", unit.fqn, unit.state.name)
        if why is Gather.FORWARD or why is Gather.SKIPPED:
            self.prefetch_forward(unit)

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
        targets: tuple | list | None = unit.settings.forward_prefetch
        if targets is None:
            targets = self.last_step_order.next_units(unit, self.settings.prefetch_depth)
        for v in targets:
            self.gather(v, Gather.PREFETCH)

    def _bucket(self, unit: Unit) -> list[Unit]:
        """``unit`` and the units after it in the current order (the last
        step's forward order in a training forward, the gather order in
        backward), where all-gather buckets are on and at least two fit; else
        ``[unit]``. A bucket is a maximal run of consecutive units that are
        sharded and together write at most the bucket size: a function of the
        order, the sizes and the sharded states, which every rank shares, so
        every rank issues the same collectives."""
        limit = self.settings.gather_bucket_bytes
        if limit <= 0 or not self.communicates:
            return [unit]
        if self._callback_queued:  # in backward
            plan = self._walk().plan
            pos, order = plan.gather_pos, plan.gather_order
        elif self.in_training_forward:
            pos, order = (self.last_step_order.position,
                          self.last_step_order.execution_order)  # type: ignore[assignment]
        else:
            return [unit]  # eval: nothing would reshard what a bucket fetched ahead
        i = pos.get(unit)
        if i is None:
            return [unit]
        units: list[Unit] = []
        total = 0
        backward = self._callback_queued
        for v in order[i:]:
            nbytes = v.gather_bytes()
            if nbytes is None or (units and total + nbytes > limit) \
                    or (backward and not v.settings.unshard_in_backward):
                break
            units.append(v)
            total += nbytes
        return units if len(units) > 1 else [unit]

    def reshard(self, unit: Unit, event: Reshard, grad_follows: bool = False,
                group=None) -> bool:
        """Whether ``unit`` frees its unsharded parameters after ``event``
        (and frees them): the one policy table. Returns whether it did.

        - AFTER_FORWARD (``grad_follows``: a backward follows): if
          reshard_after_forward, else kept for backward; an eval forward (no
          backward follows, and not inside a training forward of the root,
          where a no-grad island is e.g. a reentrant checkpoint whose
          recomputation wants the parameters) frees them whatever the
          setting: the optimizer never steps under a stale copy. With a
          backward to follow, reshard_after_forward=N keeps 1/N (PARTIAL);
        - GRADS_COMPUTED (``group``, gloo): that group, once its parameters'
          gradients exist, for a unit used once outside a nested backward
          (see [Note: gloo backward]);
        - AFTER_BACKWARD, BACKWARD_END: if reshard_after_backward;
        - NEW_STEP: a unit left unsharded by a forward with no backward (may
          be stale after optimizer.step()), unless the user unsharded it
          (Kept.USER); kept by set_reshard_after_backward(False) only if no
          shard changed since."""
        if event is Reshard.AFTER_FORWARD:
            in_training_step = self.in_training_forward and unit is not self.root
            if not (unit.reshard_after_forward or not (grad_follows or in_training_step)):
                return False
            with _compat.functorch_disabled():
                unit.reshard(to_post_forward=grad_follows)
            return True
        if event is Reshard.GRADS_COMPUTED:
            if not (unit.settings.reshard_after_backward and unit.uses == 1
                    and not self.in_nested_backward() and group.state is not ShardedState.SHARDED):
                return False
            trace("reshard", unit.fqn, "grads computed")
            group.reshard()
            return True
        if event is Reshard.NEW_STEP:
            if not unit.is_unsharded or unit.kept is Kept.USER \
                    or (unit.kept is Kept.BACKWARD and not unit.is_stale()):
                return False
        elif not unit.settings.reshard_after_backward:  # AFTER_BACKWARD, BACKWARD_END
            return False
        unit.reshard()
        return True

    # ----------------------------------------------------------------- backward
    def on_backward_hook(self, grad_arrived: bool = False) -> None:
        """A unit's pre-backward (or, ``grad_arrived``, a flat gradient
        accumulated): the first of a backward queues the final callback."""
        if grad_arrived:
            self.accumulated = True
        if not self._callback_queued:
            if self.checks is not None:
                _divergence.raise_if_stopped(self.root.fqn, self.checks)
                self.checks.before(_divergence.BACKWARD,
                                   *self.fingerprint.current())  # type: ignore[union-attr]
            self._callback_queued = True
            self._outer_task = _compat.graph_task_id()
            self.last_step_order.set_order(list(self.record.step_order))
            _compat.queue_final_callback(self._final_callback)

    def in_nested_backward(self) -> bool:
        """Inside a backward that runs within ours (a reentrant checkpoint)."""
        return _compat.graph_task_id() != self._outer_task

    def _walk(self) -> PlanWalker:
        """This backward's walk through its plan, the plan made from the
        step's record at its first need (what it needs of the units read
        here, once: the plan is a function of values)."""
        if self.walker is None:
            units = list(dict.fromkeys([*self.record.in_orders, *self.reductions.pending]))
            prefetch = {u: u.settings.backward_prefetch for u in units}
            completes = {u: u.completes_reduction() for u in units}
            reduces = {u: bool(u.trainable) and u.settings.requires_gradient_sync
                       for u in units}
            grad_bytes = {u: sum(g.padded_numel * g.reduce_dtype.itemsize for g in u.trainable)
                          for u in units}
            plan = build_plan(self.record, self.reductions.pending,
                              prefetch_depth=self.settings.prefetch_depth,
                              backward_prefetch=prefetch.__getitem__,
                              completes=completes.__getitem__, reduces=reduces.__getitem__,
                              grad_bytes=grad_bytes.__getitem__,
                              bucket_bytes=self.settings.bucket_bytes)
            self.walker = PlanWalker(plan, bucketed=self.settings.bucket_bytes > 0
                                     and self.communicates)
        return self.walker

    def _gets_grad_now(self) -> dict | None:
        """{unit: the engine will give it a gradient} for the units this
        backward reduces, asked once per backward; None inside a nested
        backward (the engine would answer for that one). See [Note: one order
        across communicators] in _backward_plan.py."""
        if self.in_nested_backward():
            return None
        if self._gets_grad is None:
            self._gets_grad = {u: any(_compat.will_execute(g.split_node.next_functions[0][0])
                                      for g in u.trainable if g.split_node is not None)
                               for u in self._walk().reducing_units()}
        return self._gets_grad

    def gather_up_to(self, stop: int, final: bool = False) -> None:
        """Issue the gather order up to index ``stop``, each all-gather after
        the reduce-scatters slotted before it (see [Note: one order across
        communicators] in _backward_plan.py). ``final``: the end of backward;
        where no flat gradient arrived at all (``autograd.grad(loss,
        inputs)``), no reduce-scatter: p.grad stays untouched."""
        walker = self._walk()
        if final:
            self._perform(walker.up_to(stop, final=True, reduce=self.accumulated))
        else:
            self._perform(walker.up_to(stop, gets_grad=self._gets_grad_now()))

    def _perform(self, steps: list[tuple]) -> None:
        """Do the steps of the walk, in their order."""
        for step in steps:
            if step[0] is GATHER:
                self.gather(step[1], Gather.IN_ORDER)
            else:
                self._launch(step[1], step[2])

    def _launch(self, units: list[Unit], bucket: bool = False) -> None:
        self.reductions.launch(units, bucket)
        if not self.settings.overlap_reduce_scatter:
            # memory over speed: no flat gradient outlives its unit's backward
            self.reductions.drain()

    def pre_backward(self, unit: Unit) -> None:
        """A gradient reached ``unit``'s outputs (its pre-backward hook): the
        first of a backward queues the final callback; gather it (and what
        comes before it in the gather order). After its gradients were already
        reduced in this backward (a reentrant checkpoint inside a unit called
        twice: each call's gradient comes in its own nested backward) it is
        gathered again, and its next post-backward reduces the rest
        (reduce-scatter is linear: the parts add up in the gradient shard)."""
        self.on_backward_hook()
        unit.note_use_seen()
        if unit.state is TrainingState.POST_BACKWARD:
            trace("pre_backward_again", unit.fqn, unit.state.name)
            unit.start_backward()
            self.gather(unit, Gather.AGAIN)
            unit.wait_for_unshard()
            return
        trace("pre_backward", unit.fqn, unit.state.name)
        unit.start_backward()
        if not self.in_nested_backward():  # will the outer backward accumulate into it
            self._grad_in_outer[unit] = any(
                _compat.will_execute(g.split_node.next_functions[0][0])
                for g in unit.trainable if g.split_node is not None)
        with label("pre_backward", unit.fqn):
            self.gather(unit, Gather.BACKWARD)
            unit.wait_for_unshard()

    def grad_accumulated(self, unit: Unit, group, _flat: torch.Tensor) -> None:
        """The hook of ``group``'s flat gradient: it accumulated."""
        with label("post_backward", unit.fqn):
            unit.assert_state(*IN_BACKWARD, where="post_backward")
            self.on_backward_hook(grad_arrived=True)
            if unit.group_ready(group):  # all in: the schedule decides
                self.grads_ready(unit)

    def grads_computed(self, unit: Unit, group, _grad_outputs) -> None:
        """[Note: gloo backward] ``group``'s split node is about to ``cat`` its
        views' gradients into the flat gradient (the node's pre-hook): all are
        computed, and that cat is the peak of a unit's backward. Where waiting
        blocks the CPU (gloo), first, in order:

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
        unit.assert_state(*IN_BACKWARD, where="grads_computed")
        self.reshard(unit, Reshard.GRADS_COMPUTED, group=group)
        if unit in self.record.in_orders:
            self.gather_up_to(self._walk().plan.stop(unit))
        self.reductions.finish_in_flight()

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
        (``set_requires_gradient_sync(False)``), and its reduction: when its
        turn comes in the one sequence, or at once outside the order (a second
        gradient for a unit already reduced, or a unit outside the backward
        order: reentrant recomputation)."""
        if self.in_nested_backward() and (unit.more_uses_to_come()
                                          or self._grad_in_outer.get(unit, False)):
            trace("partial_grad", unit.fqn, unit.state.name)
            unit.keep_accumulating()
            return
        trace("post_backward", unit.fqn, unit.state.name)
        unit.end_backward()
        self.reshard(unit, Reshard.AFTER_BACKWARD)
        if not unit.settings.requires_gradient_sync:
            for g in unit.trainable:
                g.grad.stash_unsynced_grad()
            return  # flat.grad stays and accumulates; the next synced backward reduces it
        walker = self._walk()
        if unit in walker.launched or unit not in self.record.in_orders:
            walker.launched.add(unit)
            self._launch([unit])
            return
        self._perform(walker.mark_ready(unit))

    def _final_callback(self) -> None:
        walker = self._walk()
        with _compat.functorch_disabled(), label("final_callback", self.root.fqn):
            trace("final_callback", self.root.fqn)
            # All-gathers this rank's graph never asked for (a unit whose
            # backward did not reach it here) may be awaited by another rank:
            # finish the one sequence (see [Note: one order across communicators]),
            # zero-filling what is left.
            self.gather_up_to(len(walker.plan.gather_order) - 1, final=True)
            if self.accumulated:  # else e.g. autograd.grad(loss, inputs): p.grad untouched
                self.reductions.note_unfinished(walker.plan.reduce_order)
            if self.settings.is_last_backward or self.streams.host_work_pending:
                self.reductions.drain()
            # CUDA: the compute stream waits every post-reduce; offload or
            # used-flags to read: the one sync
            self.streams.finish_backward()
            # else (set_is_last_backward(False)): the last reduce-scatter stays in
            # flight, overlapping the next microbatch's forward; the next
            # backward's first launch (or a last backward) folds it into p.grad
            self.reset()

    def reset(self, abort: bool = False) -> None:
        """End the backward, and the step: every unit's BACKWARD_END reshard
        decision and ``finish_backward``, then the backward's walk. ``abort``:
        a step an exception left half-done (see root_pre_forward): first drop
        what it had in flight and every gradient it accumulated (its
        reduce-scatters are abandoned, never dropped while a side stream still
        writes them)."""
        if abort:
            self.reductions.abandon()
        for u in self.units:
            if abort:
                for g in u.groups:
                    g.grad.drop_grad()
            u.finish_backward(resharded=self.reshard(u, Reshard.BACKWARD_END))
        self._end_backward()
        self._callback_queued = False
        self._new_step = True


# ------------------------------------------------------------------ the hooks
def pre_forward(unit: Unit, args, kwargs, entry: str = "forward"):
    """The forward pre-hook of ``unit``'s modules (registered by fully_shard):
    the root's ``pre_forward``, lazy init first."""
    return root_of(unit).pre_forward(unit, args, kwargs, entry)


def post_forward(unit: Unit, output):
    """The forward hook of ``unit``'s modules (registered by fully_shard)."""
    return unit.ctx.post_forward(unit, output)  # type: ignore[union-attr]


def root_of(unit: Unit) -> RootContext:
    """``unit``'s root context, made by lazy init at the first use."""
    if unit.ctx is None:
        lazy_init_root(unit)
    return unit.ctx  # type: ignore[return-value]


def hook_grads(unit: Unit) -> None:
    """Hook the flat gradients of ``unit``'s groups (fully_shard; again after
    a cast or move re-made them, FSDPModule._apply). A direct group's
    Parameters get their gradients from autograd ([Note: world size 1] in
    _flat_group.py): no hook."""
    for g in unit.groups:
        if not g.direct:  # (registered on the flat whenever it requires grad)
            g.set_grad_hook(_hook("grad_accumulated", unit, g))


def _hook(method: str, unit: Unit, group):
    """An autograd hook entering ``RootContext.<method>(unit, group, *hook_args)``
    of ``unit``'s root (made by lazy init if there is none: a cast re-made
    the groups after the forward). It keeps neither ``unit`` nor ``group``
    alive: autograd nodes and tensors hold their hooks in C++, where the
    garbage collector cannot see a cycle through them, and a strong hook
    would keep the whole sharded model alive for the life of the process.
    Run outside any functorch transform (``torch.func.grad`` runs backward
    hooks inside its own)."""
    unit_ref, group_ref = weakref.ref(unit), weakref.ref(group)

    def hook(*hook_args):
        u, g = unit_ref(), group_ref()
        if u is None or g is None:
            return None
        with _compat.functorch_disabled():
            return getattr(root_of(u), method)(u, g, *hook_args)
    return hook


def _pre_backward_hook(ctx: RootContext, unit: Unit):
    """``unit``'s pre-backward hook, registered on its outputs at each forward
    (the tensors die with the step: a strong reference is fine)."""
    def hook(_grad):
        with _compat.functorch_disabled():
            ctx.pre_backward(unit)
    return hook


# in backward, a unit with set_unshard_in_backward(False) is not gathered for these
_NOT_IN_BACKWARD = (Gather.BACKWARD, Gather.IN_ORDER, Gather.AGAIN)


def assign_fqns(module: nn.Module) -> None:
    """Name every unit and parameter below ``module`` relative to it."""
    prefix = {id(m): name for name, m in module.named_modules()}
    for fqn, u in units_below(module):
        u.set_fqn(fqn, prefix)


def lazy_init_root(unit: Unit) -> None:
    """Make ``unit`` the root of every unit in its subtree."""
    root_module = unit.modules[0]
    if len(unit.modules) == 1:
        assign_fqns(root_module)
    units = list(dict.fromkeys(u for m in unit.modules for _, u in units_below(m)))
    _check_not_meta(unit, units)
    _check_root_settings(unit, units)
    for u in units:
        u.check_params()
    # a root without parameters of its own (a Sequential of sharded blocks)
    # communicates where its mesh lives, like the units it holds
    device = unit.groups[0].device if unit.groups else unit.device
    pgs = _check_groups(units)
    unit.make_root()
    ctx = RootContext(unit, units, device, communicates=any(g.world > 1 for u in units
                                                            for g in u.groups))
    for u in units:
        u.set_root(ctx)
    if pgs:  # see [Note: divergence] in _divergence.py
        for m in unit.modules:  # (removed with the unit's other hooks)
            unit.hook_handles.append(m.register_forward_hook(_forward_ended(unit),
                                                             always_call=True))
        # (CUDA: the check runs on the stream runtime of its groups' device)
        cuda = [d for _, d in pgs if d.type == "cuda"]
        runtime = ctx.streams.runtime or (runtime_for(cuda[0]) if cuda else None)
        checks = _divergence.StepChecks(unit.fqn, pgs, units, runtime)
        ctx.start_checks(checks)
        checks.lazy_init(_layout_lines(units) + [
            f"step check (FSDP_COMPOSE_STEP_CHECK) {'on' if checks.enabled else 'off'}"])
    # world size 1: plain PyTorch's forward and backward for the passive units
    passive = [u for u in units if u is not unit and u.passive and not ctx.communicates]
    for u in passive:
        u.remove_forward_hooks()
    trace("lazy_init", unit.fqn, f"units={len(units)}"
          + (f", {len(passive)} without hooks" if passive else ""))


def _forward_ended(unit: Unit):
    def hook(module, args, output):
        unit.forward_ended()
        # a step check not waited for yet (a forward without collectives): now,
        # not at some later collective (see StepChecks.settle)
        _divergence.settle()
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
        if u is not root and u.root_settings is not None and u.root_settings.called:
            where = sorted(u.root_settings.called)[0]
            raise unit_error(u.fqn, f"{where}() was called on this unit, but it is not the "
                             f"root ('{root.fqn or '<root>'}' is): the setting would be ignored.",
                             root_setting_fix(where), exc=ValueError)
