"""Per-job state: what fsdp_compose keeps between calls, for one job.

A job is the life of one default process group (``dist.group.WORLD``). A
process that destroys it and initialises another (a test suite, a sweep, a
retry) starts a new job: nothing of the first (its process groups, comm
statistics, stop records, counters) reaches the second. ``job()`` is the
context of the default group; while none is initialised, the last job's (so
``comm_stats()`` reads after ``destroy_process_group``), or before the first
the one the first will take (so a ``reset_comm_stats()`` before
``init_process_group`` counts for it).

What belongs to one root lives on the root (``_divergence.StepChecks``).
What is process-wide by nature (classes made per type, registrations keyed
by class, marks attached to objects, the torch attributes the drop-in
replaced, test seams set for a ``with`` block) stays where it is, with a
comment saying so. A leaf: it imports nothing of the package. Each field is
written by the one module named beside it.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch.distributed as dist


@dataclasses.dataclass(eq=False)
class JobContext:
    # _collectives
    comm: Any = None            # CommStats of the collectives issued (made by the first)
    comm_before_reset: int = 0  # collectives counted before the last reset_comm_stats()
    gloo: dict = dataclasses.field(default_factory=dict)  # group -> (rank, size) if gloo, else None
    # _fully_shard: groups it made and the shard bytes per rank, by (ranks, backend)
    rs_groups: dict = dataclasses.field(default_factory=dict)  # for reduce-scatters
    pf_groups: dict = dataclasses.field(default_factory=dict)  # reshard_after_forward=N blocks
    loads: dict = dataclasses.field(default_factory=dict)      # bytes of shards per rank so far
    # _checkpoint
    shapes_only: bool = False   # inside shapes_only()
    # _divergence ([Note: divergence records are per root])
    optimizer_steps: int = 0    # over sharded parameters; each root counts from its creation
    stopped_pgs: dict = dataclasses.field(default_factory=dict)  # group key ("*") -> first record
    active: "weakref.ref | None" = None     # the StepChecks whose phase began last
    unsettled: "weakref.ref | None" = None  # whose step check is issued, not yet compared
    positions: dict = dataclasses.field(default_factory=dict)  # group name -> collectives issued
    names: dict = dataclasses.field(default_factory=dict)      # group -> its name
    roots: "weakref.WeakSet" = dataclasses.field(default_factory=weakref.WeakSet)  # StepChecks
    roots_made: int = 0         # the highest root id this process took part in


_current = JobContext()
_world: "weakref.ref | None" = None  # the default group _current belongs to (None: not yet)


def job() -> JobContext:
    """The context of the job now running (see the module docstring)."""
    global _current, _world
    pg = dist.group.WORLD
    if pg is None or (_world is not None and _world() is pg):
        return _current
    if _world is not None:  # another default group than the last job's: a new job
        _current = JobContext()
    _world = weakref.ref(pg)
    return _current
