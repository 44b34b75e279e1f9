"""FlatGroup reads its GroupSpec's fields as its own, read-only; no processes
(a world of one on torch's fake process group, in this process)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_compose._group._flat_group import FlatGroup, GroupSpec

pytestmark = pytest.mark.fast  # no process: the one-minute tier (make test-fast)


@pytest.fixture(autouse=True)
def _default_group():
    """FlatGroup asks the backend (of the default group: ``pg=None``) whether
    uneven pieces are padded."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _group() -> FlatGroup:
    lin = nn.Linear(4, 3)
    params = [(p, [(lin, name)], name) for name, p in lin.named_parameters()]
    return FlatGroup("lin", params, device=torch.device("cpu"), world=1, rank=0,
                     pg=None, rs_pg=None, param_dtype=torch.bfloat16)


def test_every_spec_field_reads_through_the_group():
    g = _group()
    for f in dataclasses.fields(GroupSpec):
        assert getattr(g, f.name) is getattr(g.spec, f.name), f.name
    assert (g.world, g.dtype, g.compute_dtype) == (1, torch.float32, torch.bfloat16)


def test_spec_fields_are_read_only():
    g = _group()
    for f in dataclasses.fields(GroupSpec):
        with pytest.raises(AttributeError):
            setattr(g, f.name, None)
    assert g.world == 1
