"""Host memory of a gloo run: the order backward frees and makes its buffers in, and
what it does to the peak RSS of a deep stack of units below glibc's mmap threshold."""
from __future__ import annotations

import resource

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_compose import _flat_group, _state, fully_shard

from ._dist import run_distributed


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


def _stack(n: int, dim: int, hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(*[Block(dim, hidden) for _ in range(n)], nn.LayerNorm(dim))
    for b in m[:n]:
        fully_shard(b)
    fully_shard(m)
    m.set_all_gather_bucket_bytes(0)
    m.set_reduce_scatter_bucket_bytes(0)
    return m


def _alloc_order(rank, world):
    m = _stack(4, 16, 64)
    log = []
    alloc, free, drain = (_flat_group.FlatGroup._alloc_flat, _flat_group.FlatGroup._free_flat,
                          _state.RootContext._drain)

    def logged_alloc(g):
        log.append(("alloc", g.unit_fqn))
        alloc(g)

    def logged_free(g):
        log.append(("free", g.unit_fqn))
        free(g)

    def logged_drain(ctx):
        if ctx._in_flight:
            log.append(("drain", ctx._in_flight[0].group.unit_fqn))
        drain(ctx)

    x = torch.randn(4, 16)
    m(x).sum().backward()
    _flat_group.FlatGroup._alloc_flat = logged_alloc
    _flat_group.FlatGroup._free_flat = logged_free
    _state.RootContext._drain = logged_drain
    try:
        loss = m(x).sum()
        del log[:]
        loss.backward()
    finally:
        _flat_group.FlatGroup._alloc_flat, _flat_group.FlatGroup._free_flat = alloc, free
        _state.RootContext._drain = drain
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


def _rss_per_step(rank, world, steps):
    m = _stack(16, 256, 2048)  # 1M parameters (4 MiB fp32) per unit
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, y = torch.randn(8, 256), torch.randn(8, 256)
    peaks = []
    for _ in range(steps):
        F.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # MiB
    return peaks


def test_peak_rss_stops_growing_on_a_deep_stack_of_heap_sized_units():
    """16 units of 4 MiB (below glibc's 32 MiB mmap threshold): after the
    first steps the peak barely moves (measured over steps 4 to 8: 16-34 MiB).
    With the wait before the prefetch it grew by about half the model's flat
    gradients (64 MiB) every step (116 MiB over the same steps)."""
    for peaks in run_distributed(_rss_per_step, 2, 8, timeout=240):
        growth = peaks[-1] - peaks[3]
        assert growth < 64, [round(p) for p in peaks]
