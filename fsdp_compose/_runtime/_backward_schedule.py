"""The backward's reduce-scatters in flight, and the units left unreduced.

``Reductions`` is a part of ``RootContext`` (its field ``reductions``): it
launches the reduce-scatters the root's walk through the plan says are due
(``_backward_plan.PlanWalker``), holds them while they are in flight (at most
one unit's, or one bucket's, see [Note: collective order] in
_backward_plan.py), finishes them, and keeps the units a backward left
unreduced (``pending``: every rank alike). It does its own work, through
``_group_ops``; it never calls the root.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .._group import _group_ops
from .._base._common import label, trace

if TYPE_CHECKING:
    from .._comm._streams import Backend
    from ._unit import Unit


class Reductions:
    """The reduce-scatters in flight of one root (see the module docstring)."""

    def __init__(self, streams: Backend):
        self.streams = streams
        # units in the reduce order of a backward that did not finish their
        # reduction (Unit.completes_reduction), not finished since: every rank
        # alike (see [Note: collective order] in _backward_plan.py)
        self.pending: dict[Unit, None] = {}
        self.in_flight: list = []  # the reduce-scatter launches not finished

    def launch(self, units: list[Unit], bucket: bool = False) -> None:
        """Launch the reduce-scatters of ``units``: one unit's groups each
        alone, or (``bucket``) a reduce bucket, one collective per key. What
        is in flight is finished first (it also folds an earlier part of a
        unit's gradient first)."""
        self.drain()
        for u in units:
            got = any(g.flat.grad is not None for g in u.trainable)
            trace("reduce_scatter", u.fqn, ("bucketed" if got else "bucketed zero-filled")
                  if bucket else ("ready" if got else "zero-filled"))
        with label("reduce_scatter", units[-1].fqn):
            self.in_flight = _group_ops.reduce_scatter(units, self.streams, bucket)

    def finish_in_flight(self) -> None:
        """Wait for the reduce-scatters in flight now: see [Note: gloo
        backward] in _state.py. An HSDP reduction's all-reduce across
        replicas (issued by its fold, and blocking on gloo) is left to the
        next drain, which the one sequence places (see [Note: one order
        across communicators] in _backward_plan.py): issued here, at a moment
        of this rank's own graph, it could block while a replica waits for an
        all-gather of this rank's shard group (a cycle across the groups when
        units run on some ranks only)."""
        for launch in self.in_flight:
            if launch.path.group.replicate_pg is None:
                launch.finish()
            else:  # keep the output only: the flat gradient goes now, as it would
                launch.pending = self.streams.ready(launch.pending.wait())
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
        self.streams.abort()  # (and every post-reduce: see StreamManager.abort)
        self.in_flight = []  # (only now: their buffers go back to the allocator)
        self.pending.clear()

    def note_unfinished(self, reduce_order) -> None:
        """The final callback of a backward that accumulated gradients: the
        units of its reduce order whose reduction did not finish stay pending."""
        for u in reduce_order:
            if u.trainable and not u.completes_reduction():
                self.pending[u] = None
            else:
                self.pending.pop(u, None)
