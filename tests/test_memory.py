"""Host memory of a gloo run: the order backward frees and makes its buffers in
(what keeps the peak RSS of a deep stack of units below glibc's mmap threshold
from growing), when a bucket's flats are made, the bucket buffers kept per
root, and the reduce-scatter group's name (docs/design.md, "Peak RSS of small
units")."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch.distributed as dist

from fsdp_compose import fully_shard

from fsdp_compose._runtime import _backward_schedule

from fsdp_compose._group import _flat_group

from fsdp_compose._base import _registry
from fsdp_compose._base._job import job

from ._dist import run_distributed
from ._support import rows


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


def _stack(n: int, dim: int, hidden: int, bucket_bytes: int = 0) -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(*[Block(dim, hidden) for _ in range(n)], nn.LayerNorm(dim))
    for b in m[:n]:
        fully_shard(b)
    fully_shard(m)
    m.set_all_gather_bucket_bytes(bucket_bytes)
    m.set_reduce_scatter_bucket_bytes(bucket_bytes)
    return m


def _alloc_order(rank, world):
    m = _stack(4, 16, 64)
    log = []
    alloc, free, drain = (_flat_group.FlatGroup._alloc_flat, _flat_group.FlatGroup._free_flat,
                          _backward_schedule.Reductions.finish_in_flight)

    def logged_alloc(g):
        log.append(("alloc", g.unit_fqn))
        alloc(g)

    def logged_free(g):
        log.append(("free", g.unit_fqn))
        free(g)

    def logged_drain(schedule):
        if schedule.in_flight:
            log.append(("drain", schedule.in_flight[0].path.group.unit_fqn))
        drain(schedule)

    x = torch.randn(4, 16)
    m(x).sum().backward()
    _flat_group.FlatGroup._alloc_flat = logged_alloc
    _flat_group.FlatGroup._free_flat = logged_free
    _backward_schedule.Reductions.finish_in_flight = logged_drain
    try:
        loss = m(x).sum()
        del log[:]
        loss.backward()
    finally:
        _flat_group.FlatGroup._alloc_flat, _flat_group.FlatGroup._free_flat = alloc, free
        _backward_schedule.Reductions.finish_in_flight = drain
    return log


def test_gloo_backward_frees_each_buffer_right_before_its_replacement():
    """Once unit k's gradients are computed: free k's flat, make k-1's (the
    prefetch), and only then finish k+1's reduce-scatter, whose flat gradient
    is freed right before k's cat makes one of the same size (see [Note: gloo
    backward]). Waiting first freed both before either was remade."""
    log = run_distributed(_alloc_order, 2)[0]
    for k in (2, 1):  # blocks whose previous block's reduce-scatter is in flight
        i = log.index(("free", str(k)))
        assert log[i:i + 3] == [("free", str(k)), ("alloc", str(k - 1)), ("drain", str(k + 1))], log


def _allocated(m: nn.Sequential, n: int) -> list[int]:
    return [i for i in range(n)
            if _registry.unit_of(m[i]).groups[0].flat.untyped_storage().nbytes() > 0]


def _flats_in_forward(rank, world):
    m = _stack(8, 16, 64, bucket_bytes=1 << 20)  # the whole model in one bucket
    x = torch.randn(4, 16)
    seen: list = []
    for b in m[:8]:  # (after fully_shard's own pre-hook: the block's flat is in use)
        b.register_forward_pre_hook(lambda mod, args: seen.append(_allocated(m, 8)))
    for _ in range(3):  # the first forward records the order; buckets from the second
        seen.clear()
        m(x).sum().backward()
    return seen


def test_a_bucket_makes_each_flat_when_its_unit_uses_it():
    """The 8 blocks are all-gathered as one bucket, but a block's flat is
    allocated at its own pre-forward (and freed after its forward): one
    block's parameters at a time, as without buckets. Before, every flat of
    the bucket was allocated when the bucket was issued (at block 0's
    forward all 8 were)."""
    for seen in run_distributed(_flats_in_forward, 2):
        assert seen == [[i] for i in range(8)], seen


def _kept_buckets(rank, world, steps, bucket_bytes=30_000):
    """``steps`` AdamW steps of an 8-block stack, with buckets of 3 blocks of
    8.5 KB (``bucket_bytes=0``: one collective per unit, the reference): the
    bucket buffers kept after each step, the losses and the parameters."""
    m = _stack(8, 16, 64, bucket_bytes=bucket_bytes)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    kept, losses = [], []
    for _ in range(steps):
        loss = F.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        streams = _registry.unit_of(m).ctx.streams
        kept.append({k[0]: (v[0].data_ptr(), v[1] is None) for k, v in streams._buckets.items()})
    return kept, losses, [rows(p).detach().clone() for p in m.parameters()]  # this rank's rows


def test_gloo_keeps_one_buffer_per_bucket_kind():
    """Several buckets a step (all-gather buckets of 3 blocks: each is issued
    before the previous one's last block has used it, and flushes it), every
    step with the same two buffers (see [Note: bucket buffers]), none held
    between steps; the training is the per-unit one, bit for bit."""
    for (kept, losses, params), (_, ref_losses, ref_params) in zip(
            run_distributed(_kept_buckets, 2, 4), run_distributed(_kept_buckets, 2, 4, 0)):
        assert set(kept[0]) == {"all_gather", "reduce_scatter"}, kept
        assert all(k == kept[1] for k in kept[1:]), kept  # (the first step gathers per unit)
        assert all(free for k in kept for _, free in k.values()), kept
        assert losses == ref_losses
        assert all(torch.equal(p, q) for p, q in zip(params, ref_params))


def _rs_group_names(rank, world):
    m = _stack(2, 8, 8)
    m(torch.randn(2, 8)).sum().backward()
    return {ranks: dist.distributed_c10d._get_process_group_name(g)
            for (ranks, _), g in job().rs_groups.items()}


def test_reduce_scatter_group_over_the_world_is_not_named_by_a_hash():
    """Over every rank it is made by all ranks (no local synchronisation), so
    torch names it by a counter: no SHA-1, which would initialise OpenSSL in
    every rank (~1 MiB of RSS)."""
    for names in run_distributed(_rs_group_names, 2):
        assert list(names) == [(0, 1)] and names[(0, 1)].isdigit(), names


def _launches_alive(rank, world, side_streams: bool, bucket_bytes: int):
    """Per step: the reduce-scatter launches (each holds its flat gradient
    through its Pending) still alive after backward, with the garbage
    collector off: only reference counting frees them."""
    import contextlib
    import gc

    from fsdp_compose._group import _grad_path

    from fsdp_compose._comm import _streams

    from ._support import StreamDouble, recording
    gc.collect()
    gc.disable()
    try:
        ctx = recording(StreamDouble()) if side_streams else contextlib.nullcontext()
        alive = []
        with ctx:
            m = _stack(4, 16, 64, bucket_bytes)
            x = torch.randn(4, 16)
            for _ in range(3):
                m(x).sum().backward()
                alive.append(sum(isinstance(o, (_grad_path._GradLaunch, _streams.Pending))
                                 for o in gc.get_objects()))
        return alive
    finally:
        gc.enable()


@pytest.mark.parametrize("side_streams", [False, True], ids=["gloo", "side-streams"])
@pytest.mark.parametrize("bucket_bytes", [0, 1 << 20], ids=["per-unit", "bucketed"])
def test_no_flat_gradient_waits_for_the_garbage_collector(side_streams, bucket_bytes):
    """A finished reduce-scatter's launch (and the flat gradient its Pending
    holds) goes when its last reference does. A launch -> fold -> launches
    reference cycle kept every flat gradient of a backward alive until the
    collector ran: on one H200 (fake world size 2, ~1B parameters, bf16 with
    fp32 reduce) peak allocated was 19.1 GiB against FSDP2's 13.6."""
    for alive in run_distributed(_launches_alive, 2, side_streams, bucket_bytes):
        assert alive == [0, 0, 0], alive
