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


def _sharded_group(world: int, rank: int) -> FlatGroup:
    """A group cut over ``world`` ranks (this process plays ``rank``): no
    collective is issued here, only the layout and the pieces are made."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 7))
    params = []
    for name, p in m.named_parameters():
        mod, attr = name.rsplit(".", 1)
        params.append((p, [(m.get_submodule(mod), attr)], name))
    return FlatGroup("m", params, device=torch.device("cpu"), world=world, rank=rank,
                     pg=None, rs_pg=None)


def test_mode_flags_are_set_with_the_spec():
    from fsdp_compose._group._flat_group import FlatMode
    g = _group()
    assert (g.direct, g.aliased, g.on_meta) == (False, False, False)  # (a bf16 copy-in)
    for mode in FlatMode:
        g._set_spec(dataclasses.replace(g.spec, mode=mode))
        assert g.direct == (mode is FlatMode.DIRECT)
        assert g.aliased == (mode in (FlatMode.DIRECT, FlatMode.ALIASED))
        assert g._frees_storage() == (not g.aliased)
    with torch.device("meta"):
        lin = nn.Linear(4, 3)
    m = FlatGroup("lin", [(p, [(lin, n)], n) for n, p in lin.named_parameters()],
                  device=torch.device("cpu"), world=1, rank=0, pg=None, rs_pg=None)
    assert m.on_meta and not m._frees_storage() and m.gather_key() is None


@pytest.mark.parametrize("world,rank", [(1, 0), (4, 0), (4, 2), (4, 3)])
def test_piece_is_the_slice_of_the_buffer(world, rank):
    """``ParamEntry.piece`` (one as_strided) is the view ``buf[a:b].view(shape)``
    was: same memory, shape and strides; a buffer it cannot stride over (not
    contiguous, too short) takes the slice itself."""
    g = _sharded_group(world, rank)
    buf = torch.arange(g.shard_numel + 3, dtype=torch.float32)[3:]  # (an offset storage)
    for e in g.entries:
        want = buf[slice(*e.shard_range)].view(e.piece_shape)
        got = e.piece(buf)
        assert (got.shape, got.stride(), got.data_ptr()) == \
            (want.shape, want.stride(), want.data_ptr()), e.fqn
        assert torch.equal(got, want)
    wide = torch.arange(2 * g.shard_numel, dtype=torch.float32)[::2]  # not contiguous
    for e in g.entries:
        assert torch.equal(e.piece(wide), wide[slice(*e.shard_range)].view(e.piece_shape))
    if any(e.shard_range[1] > e.shard_range[0] for e in g.entries):
        with pytest.raises(RuntimeError):  # too short: the slice's view raises, as before
            [e.piece(buf[:0]) for e in g.entries if e.shard_range[1] > e.shard_range[0]]
