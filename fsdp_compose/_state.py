"""Lazy root initialisation and the state every unit below a root shares.

The first forward (or ``unshard()``) of any sharded module makes that module's
unit the *root*: it walks its subtree once, names every unit and parameter by
FQN, checks the parameters, and builds the ``RootContext`` all units then
reference: the recorded forward order, the stream manager, and the backward
bookkeeping (reduce-scatter order, the final callback).

``RootContext`` is the step lifecycle (a training root forward starts a
step, the first pre-backward queues the final callback, which ends it; a step
an exception left half-done is aborted at the next root forward; ``reset``
ends both) and the two decisions every unit event leads to (``gather``:
whether and how a unit is all-gathered, forward prefetch and gather buckets
included; ``reshard``: whether it frees its parameters after an event; see
[Note: who decides] in _unit.py). Its parts are fields, each owning its state:

- ``record`` (``_backward_plan.StepRecord``): what this step's forward
  recorded for the backward orders;
- ``forward_order`` (``_forward_walk.ForwardTracker``): the forward orders,
  followed or agreed on ([Note: forward order]);
- ``backward`` (``_backward_schedule.BackwardSchedule``): the running
  backward against its ``BackwardPlan`` ([Note: collective order], [Note:
  one order across communicators]);
- ``checks`` / ``fingerprint`` (``_divergence.StepChecks``,
  ``_step_checks.SettingsFingerprint``): [Note: divergence];
- ``streams`` (``StreamManager``), ``last_step_order`` (``LastStepOrder``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _compat, _divergence, _group_ops
from ._backward_plan import StepRecord
from ._backward_schedule import BackwardSchedule
from ._common import (META_FIX, Gather, Kept, Reshard, RootSettings, ShardedState,
                      TrainingState, label, root_setting_fix, trace, unit_error)
from ._forward_order import GRAD, NO_BACKWARD
from ._forward_walk import ForwardTracker, LastStepOrder
from ._registry import units_below
from ._step_checks import SettingsFingerprint, left_half_done
from ._streams import make_streams, runtime_for
from ._unit import Unit


class RootContext:
    def __init__(self, root: Unit, units: list[Unit], device: torch.device,
                 communicates: bool):
        self.root = root
        self.units = units
        self.communicates = communicates        # some group has world > 1
        self.streams = make_streams(device)  # (the backend: side streams, or blocking waits)
        self.last_step_order = LastStepOrder()
        self.record = StepRecord()
        self.forward_order = ForwardTracker(self)
        self.backward = BackwardSchedule(self)
        # the lazy-init and step checks of [Note: divergence] in _divergence.py
        # (None: nothing communicates; see start_checks)
        self.checks: _divergence.StepChecks | None = None
        self.fingerprint: SettingsFingerprint | None = None
        self._new_step = True                   # the next training forward starts a step
        self.in_training_forward = False        # inside a grad-enabled forward of the root
        self._callback_queued = False           # a backward runs: its final callback queued
        self._outer_task = -1                   # graph task of the backward we finish

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
        self.forward_order.start(entry, self.in_training_forward)

    def record_forward(self, unit: Unit) -> bool:
        """``unit``'s forward starts: its place in the forward order (see
        ForwardTracker.record_forward). Returns whether to all-gather it now."""
        return self.forward_order.record_forward(unit)

    def forward_end(self, unit: Unit, flag: int) -> None:
        """``unit``'s forward ends (its post-forward, not a recomputation);
        ``flag``: what follows it (_forward_order.GRAD ...). The order's -u
        (units skipped here first), the step's record for the backward
        orders, then the AFTER_FORWARD reshard decision."""
        self.forward_order.forward_end(unit, flag)
        trace("post_forward", unit.fqn, unit.state.name)
        if flag != NO_BACKWARD:  # (ISLAND: see [Note: collective order])
            self.record.expect_backward(unit, island=flag != GRAD)
        self.reshard(unit, Reshard.AFTER_FORWARD, grad_follows=flag == GRAD)
        if unit is self.root:
            self.in_training_forward = False
            if flag == NO_BACKWARD:  # CUDA offload: no end of backward will sync the copies
                self.streams.end_eval_forward()

    def expects_backward(self, unit: Unit) -> bool:
        return self.record.expects_backward(unit)

    # ------------------------------------------------------- the two decisions
    def gather(self, unit: Unit, why: Gather) -> None:
        """Whether and how ``unit`` is all-gathered now, asked by a unit's event
        (``why``); the one place that decides it (issuing only: the unit waits).

        - FORWARD, SKIPPED: gathered (the forward order said so), then the
          forward prefetch; PREFETCH: only if still sharded;
        - BACKWARD, RECOMPUTE: first every unit before it in the gather order
          (see [Note: collective order] in _backward_schedule.py), then it,
          except in BACKWARD a unit with ``unshard_in_backward`` False;
          IN_ORDER, AGAIN: it, with the same exception;
        - USER: it.
        Gathered with the units after it as one bucket where gather buckets
        are on (``_bucket``), else alone (a bucket of one)."""
        if why is Gather.BACKWARD or why is Gather.RECOMPUTE:
            if unit in self.record.in_orders:
                # On gloo a unit resharded after forward prefetches once its
                # gradients are computed, see [Note: gloo backward] in
                # _backward_schedule.py; a unit that kept its parameters (the
                # root), or whose gradients have no hook (frozen), prefetches now.
                late = unit.grads_hooked and unit.reshard_after_forward
                self.backward.gather_up_to(self.backward.plan.stop(unit, prefetch=not late))
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
            plan = self.backward.plan
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
          (see [Note: gloo backward] in _backward_schedule.py);
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
            self.backward.accumulated = True
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

    def grads_computed(self, unit: Unit, group) -> None:
        """``group``'s gradients are computed (gloo): [Note: gloo backward]."""
        self.backward.grads_computed(unit, group)

    def pre_backward(self, unit: Unit) -> None:
        """A gradient reached ``unit``'s outputs (its pre-backward)."""
        self.backward.pre_backward(unit)

    def grads_ready(self, unit: Unit) -> None:
        """Every trainable group of ``unit`` accumulated its flat gradient."""
        self.backward.grads_ready(unit)

    def finish_in_flight(self) -> None:
        self.backward.finish_in_flight()

    @_compat.outside_functorch
    def _final_callback(self) -> None:
        backward = self.backward
        with label("final_callback", self.root.fqn):
            trace("final_callback", self.root.fqn)
            # All-gathers this rank's graph never asked for (a unit whose
            # backward did not reach it here) may be awaited by another rank:
            # finish the one sequence (see [Note: one order across communicators]),
            # zero-filling what is left.
            backward.gather_up_to(len(backward.plan.gather_order) - 1, final=True)
            if backward.accumulated:  # else e.g. autograd.grad(loss, inputs): p.grad untouched
                backward.note_unfinished()
            if self.settings.is_last_backward or self.streams.host_work_pending:
                backward.drain()
            # CUDA: the compute stream waits every post-reduce; offload or
            # used-flags to read: the one sync
            self.streams.finish_backward()
            # else (set_is_last_backward(False)): the last reduce-scatter stays in
            # flight, overlapping the next microbatch's forward; the next
            # backward's first launch (or a last backward) folds it into p.grad
            self.reset()

    def reset(self, abort: bool = False) -> None:
        """End the backward, and the step: every unit's BACKWARD_END reshard
        decision and ``finish_backward``, then the backward's plan and
        positions (``BackwardSchedule.end``). ``abort``: a step an exception
        left half-done (see root_pre_forward): first drop what it had in
        flight and every gradient it accumulated (its reduce-scatters are
        abandoned, never dropped while a side stream still writes them)."""
        if abort:
            self.backward.abandon()
        for u in self.units:
            if abort:
                for g in u.groups:
                    g.grad.drop_grad()
            u.finish_backward(resharded=self.reshard(u, Reshard.BACKWARD_END))
        self.backward.end()
        self._callback_queued = False
        self._new_step = True


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
