"""FlatGroup reads its GroupSpec's fields as its own, read-only; no processes."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from fsdp_compose._flat_group import FlatGroup, GroupSpec


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
