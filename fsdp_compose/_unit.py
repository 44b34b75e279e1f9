"""One fully_shard unit: its modules, flat groups, hooks and training state.

A step, as the unit sees it:

    pre_forward   unshard (all-gather), install full-shape views     IDLE -> FORWARD
    post_forward  register pre-backward on the outputs; reshard if
                  reshard_after_forward (always in eval)             FORWARD -> IDLE
    pre_backward  unshard again if it was resharded                  -> PRE_BACKWARD
    post_backward every trainable group's flat gradient is
                  accumulated: reshard, hand the unit to the root's
                  reduce-scatter scheduler                           -> POST_BACKWARD
    final         (root callback) reduce-scatter what is left,
                  reshard, reset                                     -> IDLE

[Note: recomputation] A forward that runs *inside* backward is activation-
checkpoint recomputation: pre_forward only makes sure the unit is unsharded;
post_forward neither reshards nor registers hooks. The unit then stays
unsharded until its post-backward (or the root's final callback).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook

from . import _compat, _divergence
from ._common import (RootSettings, ShardedState, TrainingState, label, trace, unit_error,
                      weak_hook)
from ._flat_group import FlatGroup
from ._forward_order import GRAD, ISLAND, NO_BACKWARD

if TYPE_CHECKING:
    from ._state import RootContext


class Unit:
    def __init__(self, modules: list[nn.Module], groups: list[FlatGroup], *,
                 reshard_after_forward: bool | None, label: str, mp_policy=None,
                 device: torch.device = torch.device("cpu"),
                 lazy_init_root: Callable[["Unit"], None]):
        self.modules = modules
        # _state.lazy_init_root, passed in by fully_shard: _state imports this
        # module, so this one never imports _state (docs/architecture.md)
        self._lazy_init_root = lazy_init_root
        self.groups = groups
        self.device = device  # its mesh's device (a root without parameters takes it)
        # groups whose flat gradient we reduce (a direct group's Parameters get
        # their gradients from autograd, see [Note: world size 1]); follows
        # requires_grad_() on the Parameters (see _sync_requires_grad); see hook_groups
        self.trainable: list[FlatGroup] = []
        self.fqn = label
        self.user_reshard_after_forward = reshard_after_forward
        self.reshard_after_forward = bool(reshard_after_forward)  # resolved at lazy init
        # False: stay gathered after backward (the next forward all-gathers
        # nothing, unless an optimizer step changed a shard meanwhile)
        self.reshard_after_backward = True
        # False (set_unshard_in_backward): backward does not need the parameters
        # (e.g. an embedding): no all-gather for this unit in backward
        self.unshard_in_backward = True
        self.kept_after_backward = False  # left gathered by the last backward (see above)
        mp = mp_policy
        self._cast_inputs = mp.param_dtype if mp is not None and mp.cast_forward_inputs else None
        self._cast_outputs = mp.output_dtype if mp is not None else None
        self.state = TrainingState.IDLE
        self.ctx: RootContext | None = None
        self.hook_handles: list = []  # its forward pre/post hooks (see passive)
        self._forward_depth = 0   # >0 while inside any module of this unit
        self._posted = False      # post_forward ran for the call ending now (see forward_ended)
        self.pinned = False       # unsharded by the user (FSDPModule.unshard)
        self.root_settings = RootSettings()  # read on the root only (RootContext.settings)
        self.forward_prefetch: list[Unit] | None = None   # explicit; None: by order
        self.grads_hooked = False  # _grads_computed will run this backward (gloo)
        self.backward_prefetch: list[Unit] | None = None
        # False: keep accumulating the unsharded flat gradient, no reduce-scatter
        self.requires_gradient_sync = True
        self.uses = 0             # forward calls this step that will see a backward
        self._uses_seen = 0       # ... whose output gradient arrived in this backward
        self._grad_in_outer = False  # ... the outer backward accumulates into its flat
                                     # gradient (asked at its pre-backward)
        self._ready: set[FlatGroup] = set()  # trainable groups whose grad arrived this backward
        self.hook_groups()

    def hook_groups(self) -> None:
        """Find the trainable groups and hook their flat gradients. Again after
        a cast or move re-made every group's flat (FSDPModule._apply): which
        groups are direct may have changed."""
        self.trainable = [g for g in self.groups if g.requires_grad and not g.direct]
        self._ready.clear()
        _divergence.settings_changed()
        for g in self.groups:
            if not g.direct:  # (registered on the flat whenever it requires grad)
                g.set_grad_hook(weak_hook(self, "_on_grad_accumulated", g))

    def __repr__(self) -> str:
        return f"Unit({self.fqn or '<root>'!r}, groups={len(self.groups)}, {self.state.name})"

    @property
    def passive(self) -> bool:
        """Its hooks would do nothing: every group is direct (see [Note: world
        size 1] in _flat_group.py) and nothing is cast. In a model where no unit
        communicates, the root removes a passive unit's forward hooks at lazy
        init (its own stay: they run the step's bookkeeping)."""
        return (all(g.direct for g in self.groups) and self._cast_inputs is None
                and self._cast_outputs is None)

    def remove_forward_hooks(self) -> None:
        for h in self.hook_handles:
            h.remove()
        self.hook_handles = []

    @property
    def is_root(self) -> bool:
        return self.ctx is not None and self.ctx.root is self

    def _assert_state(self, *states: TrainingState, where: str) -> None:
        if self.state not in states:
            raise unit_error(self.fqn, f"{where} expected state {[s.name for s in states]}, "
                             f"got {self.state.name}.")

    # ----------------------------------------------------------- unshard/reshard
    def _ensure_ctx(self) -> "RootContext":
        if self.ctx is None:
            self._lazy_init_root(self)
        return self.ctx

    def unshard(self) -> None:
        """Issue the all-gathers of every group (no wait); with all-gather
        buckets on, also of the units that follow in the current order."""
        ctx = self._ensure_ctx()
        if ctx.gather_in_bucket(self):
            return
        streams = ctx.streams
        issued = False
        for g in self.groups:
            issued |= g.world > 1 and (g.state is ShardedState.SHARDED
                                       or g.state is ShardedState.PARTIAL)
            g.unshard(streams)
        if issued:
            trace("all_gather", self.fqn, self.state.name)

    def gather_bytes(self) -> int | None:
        """Bytes its all-gathers write, if every group would be gathered by a
        plain all-gather now (sharded, world > 1); else None."""
        keys = [g.gather_key() for g in self.groups]
        if not keys or None in keys:
            return None
        return sum(g.padded_numel * g.compute_dtype.itemsize for g in self.groups)

    def wait_for_unshard(self) -> None:
        for g in self.groups:
            g.wait_for_unshard()

    def reshard(self, to_post_forward: bool = False) -> None:
        if any(g.state is not ShardedState.SHARDED for g in self.groups):
            trace("reshard", self.fqn, self.state.name)
        for g in self.groups:
            g.reshard(to_post_forward)

    @property
    def is_unsharded(self) -> bool:
        return any(g.state is not ShardedState.SHARDED for g in self.groups)

    def is_stale(self) -> bool:
        """An optimizer step (any in-place write) changed a shard since it was gathered."""
        return any(g.state is not ShardedState.SHARDED and g.shard._version != g.unsharded_version
                   for g in self.groups)

    # ------------------------------------------------------------------ forward
    def pre_forward(self, module: nn.Module, args, kwargs, entry: str = "forward"):
        """``entry``: the method run (``forward``, or one registered with
        register_fsdp_forward_method)."""
        ctx = self._ensure_ctx()
        if _compat.in_backward():  # see [Note: recomputation]
            trace("pre_forward_recompute", self.fqn, self.state.name)
            if not ctx.expects_backward(self):  # reentrant: this use's gradient comes next
                self._uses_seen += 1
            with _compat.functorch_disabled():
                ctx.unshard_for_backward(self)
                self._refresh_views()
                self.wait_for_unshard()
            return self._cast(self._cast_inputs, (args, kwargs))
        if self._forward_depth == 0:
            if self.is_root:
                ctx.root_pre_forward(entry)
            self._assert_state(TrainingState.IDLE, where="pre_forward")
            with label("pre_forward", self.fqn), _compat.functorch_disabled():
                gather = ctx.record_forward(self)  # (first: units skipped here, _forward_walk.py)
                trace("pre_forward", self.fqn, self.state.name)
                self._sync_requires_grad()
                self.state = TrainingState.FORWARD
                if gather:
                    self.unshard()
                    ctx.prefetch_forward(self)
                self._refresh_views()
                self.wait_for_unshard()
        self._forward_depth += 1
        return self._cast(self._cast_inputs, (args, kwargs))

    def _sync_requires_grad(self) -> None:
        """Follow ``requires_grad_()`` called on the sharded Parameters since the
        last forward (see FlatGroup.sync_requires_grad)."""
        changed = False
        for g in self.groups:
            changed |= g.sync_requires_grad()
        if changed:
            self.trainable = [g for g in self.groups if g.requires_grad and not g.direct]
            _divergence.settings_changed()

    @staticmethod
    def _cast(dtype, tree):
        """``tree`` with its floating-point tensors cast to ``dtype``; None if no cast."""
        if dtype is None:
            return None

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

        return _compat.tree_map_tensors(cast, tree)

    def _refresh_views(self) -> None:
        """After ``unshard()``: views need the storage allocated.

        Not for a group whose flat aliases its shard (world size 1, no cast):
        there, nothing is freed or reduced when its post-backward runs, so a
        post-backward delayed to the end of backward (see [Note: tensor
        vocabulary] in _flat_group.py) costs nothing, and the views made once
        are reused: no split and no views per step.
        """
        if torch.is_grad_enabled():
            hook = self.ctx.streams.waits_block_cpu
            for g in self.groups:
                trains = g.requires_grad and not g.direct
                # (any group whose requires_grad changed: its views must follow)
                if not (g._views_stale or (trains and not g.aliased)):
                    continue
                g.refresh_views()
                if hook and g.world > 1 and g.split_node is not None:  # a new node each time
                    if g.on_grads_computed is None:  # (called by the split node's pre-hook)
                        g.on_grads_computed = weak_hook(self, "_grads_computed", g)
                    self.grads_hooked = True

    @_compat.outside_functorch
    def _grads_computed(self, group: FlatGroup, _grad_outputs) -> None:
        """[Note: gloo backward] ``group``'s split node is about to ``cat`` the
        gradients of its views into the flat gradient: all of them are computed,
        and that cat, with the views' gradients still alive, is the peak of a
        unit's backward. Where waiting blocks the CPU (gloo), first:

        1. free the group's unsharded flat, instead of at the post-backward:
           every backward node that reads its views has run (each produces a
           gradient for them) and the cat reads none. Only for a unit used once
           this step, outside a nested (reentrant) backward: with several uses
           each use's views have their own split node, and an earlier use still
           reads the parameters. Per group: another group's views may still be
           read;
        2. only then prefetch the next unit(s) of the gather order (see
           RootContext.unshard_for_backward: such a unit did not prefetch at its
           pre-backward), so at most one unsharded unit is alive with the
           gradients and the reduce-scatter in flight;
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
        ctx = self.ctx
        if self.reshard_after_backward and self.uses == 1 and not ctx.in_nested_backward() \
                and group.state is not ShardedState.SHARDED:
            trace("reshard", self.fqn, "grads computed")
            group.reshard()
        ctx.prefetch_backward_late(self)
        ctx.finish_in_flight()

    def post_forward(self, module: nn.Module, args, output):
        if self._cast_outputs is not None:  # (recomputation too: same saved tensors)
            output = self._cast(self._cast_outputs, output)
        if _compat.in_backward():  # see [Note: recomputation]
            return output
        self._forward_depth -= 1
        self._posted = True
        if isinstance(output, torch.Tensor):  # fast path: skip the pytree walk
            outs = [output] if output.requires_grad else []
        else:
            outs = [t for t in _compat.tree_leaves(output)
                    if isinstance(t, torch.Tensor) and t.requires_grad]
        if len(outs) == 1:  # the common case: a plain tensor hook is cheaper
            outs[0].register_hook(self._pre_backward)
        elif outs:
            register_multi_grad_hook(outs, self._pre_backward, mode="any")
        if outs and torch.is_grad_enabled():
            self.uses += 1
        elif not torch.is_grad_enabled() and self.ctx.in_training_forward:
            self.uses += 1  # a no-grad island in a training step: maybe a reentrant region
        if self._forward_depth > 0:  # another module of this unit is still running
            return output
        grad_follows = torch.is_grad_enabled() and bool(outs)
        island = not torch.is_grad_enabled() and self.ctx.in_training_forward
        with _compat.functorch_disabled():  # (first: units skipped here, _forward_walk.py)
            self.ctx.forward_end(self, GRAD if grad_follows else ISLAND if island else NO_BACKWARD)
        trace("post_forward", self.fqn, self.state.name)
        if grad_follows:
            self.ctx.expect_backward(self)
        elif island:
            self.ctx.expect_backward(self, island=True)  # see [Note: collective order]
        self._reshard_after_forward(grad_follows)
        if self.is_root:
            self.ctx.in_training_forward = False
        self.state = TrainingState.IDLE
        return output

    def _reshard_after_forward(self, grad_follows: bool) -> None:
        # An eval forward (no backward follows, and not inside a training
        # forward of the root, where a no-grad island is e.g. a reentrant
        # checkpoint whose recomputation wants the parameters) frees them
        # whatever the setting: the optimizer never steps under a stale copy.
        in_training_step = self.ctx.in_training_forward and not self.is_root
        if self.reshard_after_forward or not (grad_follows or in_training_step):
            with _compat.functorch_disabled():
                self.reshard(to_post_forward=grad_follows)  # (reshard_after_forward=N)

    def forward_skipped(self) -> None:
        """The forward order reaches this unit's forward, which runs on other
        ranks but not (or not yet) here: take part in its all-gathers, and its
        forward prefetch, as its pre-forward would (see [Note: forward order]
        in _forward_walk.py)."""
        trace("skipped", self.fqn, "all-gather")
        self._sync_requires_grad()  # (whether it reduces must match the ranks it runs on)
        with label("skipped", self.fqn):
            self.unshard()
            self.ctx.prefetch_forward(self)

    def forward_skipped_end(self, grad_follows: bool) -> None:
        """... and the order reaches its end: reshard as its post-forward would."""
        trace("skipped", self.fqn, "end")
        self._reshard_after_forward(grad_follows)

    def forward_ended(self) -> None:
        """After each forward of the root's modules, also one that raised (an
        ``always_call`` hook, registered at lazy init after post_forward). A
        forward that raised ran no post_forward: it is no longer running, but
        its units stay in FORWARD, so the root's next forward runs its
        pre-forward and finds the step left half-done (see
        RootContext.root_pre_forward)."""
        if not self._posted and not _compat.in_backward():
            self._forward_depth = max(0, self._forward_depth - 1)
        self._posted = False

    # ----------------------------------------------------------------- backward
    @_compat.outside_functorch
    def _pre_backward(self, _grad) -> None:
        self.ctx.on_backward_hook()
        self._uses_seen += 1
        if self.state is TrainingState.POST_BACKWARD:
            # Another use after this unit's gradients were already reduced in
            # this backward: a reentrant checkpoint inside a unit called twice
            # (each call's gradient comes in its own nested backward). Gather
            # again; the next post-backward reduces the rest (reduce-scatter is
            # linear, so the two parts add up in the gradient shard).
            trace("pre_backward_again", self.fqn, self.state.name)
            self._ready.clear()
            self.state = TrainingState.PRE_BACKWARD
            if self.unshard_in_backward:
                self.unshard()
                self.wait_for_unshard()
            return
        trace("pre_backward", self.fqn, self.state.name)
        self.state = TrainingState.PRE_BACKWARD
        if not self.ctx.in_nested_backward():  # will the outer backward accumulate into it
            self._grad_in_outer = any(_compat.will_execute(g.split_node.next_functions[0][0])
                                      for g in self.trainable if g.split_node is not None)
        with label("pre_backward", self.fqn):
            self.ctx.unshard_for_backward(self, need=self.unshard_in_backward)
            self.wait_for_unshard()

    @_compat.outside_functorch
    def _on_grad_accumulated(self, group: FlatGroup, _flat: torch.Tensor) -> None:
        ctx = self._ensure_ctx()
        ctx.on_backward_hook()
        ctx.accumulated = True
        self._ready.add(group)
        if len(self._ready) < len(self.trainable):
            return
        if ctx.in_nested_backward() and (self._uses_seen < self.uses or self._grad_in_outer):
            # A reentrant checkpoint inside this unit: each use's gradient
            # comes in its own nested backward. Uses are still to come, or
            # the outer backward brings a part too (parameters used outside
            # the checkpoint), so this is a part: stay gathered, let
            # flat.grad accumulate. (Reducing the part at once, and the rest
            # again, would depend on each rank's graph: when a unit is
            # skipped on another rank, the ranks issued different
            # reduce-scatters.)
            trace("partial_grad", self.fqn, self.state.name)
            self._ready.clear()
            return
        trace("post_backward", self.fqn, self.state.name)
        self.state = TrainingState.POST_BACKWARD
        if self.reshard_after_backward:
            self.reshard()
        if not self.requires_gradient_sync:
            for g in self.trainable:
                g.stash_unsynced_grad()
        ctx.grads_ready(self)

    def completes_reduction(self) -> bool:
        """Reducing now ends in p.grad: gradient sync on and, with HSDP, the
        all-reduce across replicas on (else the reduction stays pending)."""
        return self.requires_gradient_sync and all(
            g.requires_all_reduce or g.replicate_pg is None for g in self.trainable)

    def launch_reduce_scatters(self) -> list:
        got = any(g.flat.grad is not None for g in self.trainable)
        trace("reduce_scatter", self.fqn, "ready" if got else "zero-filled")
        with label("reduce_scatter", self.fqn):
            return [g.launch_reduce_scatter(self.ctx.streams) for g in self.trainable]

    def finish_backward(self) -> None:
        """Called by the root's final callback, for every unit."""
        self.pinned = False
        self.grads_hooked = False
        self._uses_seen = 0
        self._grad_in_outer = False
        if self.reshard_after_backward:
            self.reshard()
        else:
            for g in self.groups:
                g.keep_unsharded()
            self.kept_after_backward = True
        self._ready.clear()
        self._forward_depth = 0
        self.state = TrainingState.IDLE
