"""The group operations: the all-gathers and reduce-scatters the schedule
issues, for a *bucket* of flat groups (one group alone is a bucket of one).

Only the schedule calls these (``_state.RootContext.gather`` and
``_backward_schedule.Reductions.launch``); nothing else imports this module or
the bucket functions below it (``tests/test_architecture.py``). Each list of
units is rank-independent (the schedule's orders), so every rank issues the
same collectives in the same order.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._extension import gather_together
from ._flat_group import FlatGroup, gather_bucket
from ._grad_path import launch_bucket

if TYPE_CHECKING:
    from .._comm._streams import Backend
    from .._runtime._unit import Unit


def all_gather(units: list[Unit], streams: Backend, bucket: bool) -> None:
    """Issue the all-gathers of ``units``' groups (no wait). ``bucket``: the
    groups of one ``gather_key`` share one collective; else (one unit) each
    group is gathered alone, its extension groups together."""
    for groups in _gather_buckets(units, streams, bucket):
        if len(groups) == 1:
            groups[0].unshard(streams)  # (a no-op where nothing is to be gathered)
        elif groups[0].gathers_together(streams):
            gather_together(groups, streams)  # type: ignore[arg-type]
        else:
            gather_bucket(groups, streams)


def _gather_buckets(units: list[Unit], streams: Backend,
                    bucket: bool) -> list[list[FlatGroup]]:
    if bucket:
        by_key: dict[tuple | None, list[FlatGroup]] = {}
        for u in units:
            for g in u.groups:
                by_key.setdefault(g.gather_key(), []).append(g)
        return list(by_key.values())
    (unit,) = units
    together = [g for g in unit.groups if g.gathers_together(streams)]
    if len(together) < 2:
        return [[g] for g in unit.groups]
    return [together] + [[g] for g in unit.groups if g not in together]


def reduce_scatter(units: list[Unit], streams: Backend, bucket: bool) -> list:
    """Launch the reduce-scatters of ``units``' trainable groups; returns the
    launches (``_grad_path._GradLaunch``). ``bucket``: the groups of one
    ``bucket_key`` share one collective; else (one unit) each group alone,
    but for the unit's extension groups (float8 weights) and padded uneven
    groups, which share one per key (never one collective per weight)."""
    assert bucket or len(units) == 1, units  # (not a bucket: a unit alone)
    by_key: dict[tuple, list] = {}
    for u in units:
        for g in u.trainable:
            key = g.grad.bucket_key() if bucket or g.shares_reduce() else (id(g),)
            by_key.setdefault(key, []).append(g.grad)
    paths = list(by_key.values())
    return [launch for bucket_paths in paths for launch in launch_bucket(bucket_paths, streams)]
