"""Per-job state (fsdp_compose/_base/_job.py): a new default process group in the
same process starts from nothing of the last one.

In this process, on torch's fake process group (collectives do nothing), so
no worker processes are needed.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_compose import comm_stats, fully_shard

from fsdp_compose._comm import _divergence
from fsdp_compose._base._registry import unit_of

pytestmark = pytest.mark.fast  # no process: the one-minute tier (make test-fast)


def _one_job() -> dict:
    """Train a step of a two-unit model, then stop (as a DivergenceError
    does); what the job saw at its start and made, and its stats after the
    default group is destroyed."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        seen = {"stats_at_start": comm_stats(), "stopped_at_start": _divergence.stopped_here(None)}
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        fully_shard(model[0])
        fully_shard(model)
        seen["rs_pg"] = unit_of(model).groups[0].rs_pg
        model(torch.randn(2, 4)).sum().backward()  # raises if an earlier stop is seen
        _divergence.stop("rank 0 stopped: a fault in this job")
        seen["stats"] = comm_stats()
    finally:
        dist.destroy_process_group()
    seen["stats_after"] = comm_stats()
    return seen


def test_a_new_default_group_starts_a_new_job():
    """Before, the second job saw the first one's stop record (its root's
    process-group key is the same: a DivergenceError at its first forward),
    its comm statistics, and its reduce-scatter group, a group of the
    destroyed world."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    first = _one_job()
    second = _one_job()
    assert second["stopped_at_start"] is None
    assert second["stats_at_start"] == type(second["stats"])()
    assert second["stats"] == first["stats"] and first["stats"].all_gather_calls > 0
    assert second["rs_pg"] is not first["rs_pg"]
    # the job's statistics stay readable once its default group is destroyed
    assert first["stats_after"] == first["stats"]
