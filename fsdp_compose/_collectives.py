"""Collectives as free functions, with byte counters.

All-gathers and reduce-scatters return a work handle; the caller decides
where to ``wait()``. On gloo they are issued with ``async_op=True`` and
``wait()`` blocks the CPU until the data is there. On CUDA the stream manager
issues them with ``async_op=False`` inside its side-stream context: c10d then
launches the NCCL kernel on that (current) stream, and the returned handle is
already complete (see [Note: side streams] in _streams.py).

[Note: gloo collectives]
gloo's tensor all-gather and reduce-scatter are not in place: the all-gather
copies the input into a temporary and the gathered temporary into the output,
and the reduce-scatter clones its whole (world·S) input, all-reduces the clone
and copies one slice out. Each fresh temporary is also page-faulted in (large
CPU allocations are mmap'd). So for CPU tensors on gloo we issue what those
are made of, in place on our own buffers:

* all-gather = one ``broadcast`` per rank of that rank's chunk of the output
  (every chunk is a contiguous view; ours already holds our shard);
* reduce-scatter = ``all_reduce`` of the flat gradient in place, then our
  chunk copied out when the caller waits (the rest of the flat gradient is
  garbage the caller drops anyway);
* over 2 ranks, a small reduce-scatter (input at most ``P2P_MAX_BYTES``) =
  a point-to-point exchange instead: the peer's chunk is sent to it
  (``isend``), ours is received from it (``irecv``) into the result, and
  our own chunk is added when the caller waits (one addition: the same bits
  as the all-reduce). gloo's all-reduce makes a scratch buffer of half the
  input on its worker thread, each time; below glibc's mmap threshold that
  comes from the worker thread's own heap (arena), which keeps its
  high-water mark: about 1 MiB of resident memory per worker thread with
  1 MiB buckets (an allocation shim logged the 504 KiB scratch on both
  worker threads every step). The exchange allocates nothing but the
  result, on the caller's thread, and sends half the bytes of the ring
  all-reduce; on 2 gloo ranks it took 0.30 vs 0.45 ms at 32 KiB and
  0.39-0.47 vs 0.70-0.76 ms at 512 KiB (median of 60, two runs, busy
  machine). Larger inputs keep the all-reduce (the result would exist while
  the exchange is in flight: peak RSS +26 MiB on the benchmarks' memory
  shape), and so do more ranks (a sum of 3 or more chunks in another order
  than gloo's ring would change the bits with the path). Point-to-point
  messages are matched by (peer, tag) in issue order, so the group must
  carry no one else's: the reduce-scatter group is fully_shard's own
  (_fully_shard._reduce_scatter_group).

Measured on 2 gloo ranks (``python -m benchmarks.collectives``, median of
11): at 64 MiB all-gather 119 -> 70 ms wall, 101 -> 45 ms CPU; reduce-scatter
129 -> 95 ms wall, 114 -> 78 ms CPU; no extra world·S temporary. The same at
4-16 MiB and at 4 ranks. From 64 KiB to 2 MiB wall times are within noise of
each other (one run had the all-gather up to 1.3-1.8x slower, the next at
0.88-1.07x) while CPU time stays lower (0.74-0.89x), so the in-place path is
used at every size: on these machines compute shares the cores with gloo.
NCCL keeps its reduce-scatter and all-gather.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from . import _divergence
from ._common import group_backends
from .api import CommStats

_stats = CommStats()

# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn).
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def comm_stats() -> CommStats:
    """A snapshot of the collectives this process issued."""
    return dataclasses.replace(_stats)


def reset_comm_stats() -> None:
    global _stats, _before_reset
    _before_reset += _calls(_stats)
    _stats = CommStats()


_before_reset = 0  # collectives counted before the last reset_comm_stats()


def _calls(s: CommStats) -> int:
    return s.all_gather_calls + s.reduce_scatter_calls + s.all_reduce_calls + s.all_to_all_calls


def issued() -> int:
    """Collectives this process issued so far (reset_comm_stats() aside): where
    a rank is in the sequence every rank issues alike."""
    return _before_reset + _calls(_stats)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


P2P_MAX_BYTES = 1 << 20  # 2-rank gloo reduce-scatters up to this input: an exchange (the Note)

_GLOO: dict = {}  # process group -> (rank, size) in it if it is gloo, else None


def _in_place_gloo(t: torch.Tensor, group) -> tuple[int, int] | None:
    """(rank, size) when ``t`` takes the in-place gloo path (see the Note), else None."""
    if t.device.type != "cpu":
        return None
    key = group if group is not None else dist.group.WORLD
    if key not in _GLOO:
        gloo = dist.get_backend(group) == "gloo"
        _GLOO[key] = (dist.get_rank(group), dist.get_world_size(group)) if gloo else None
    return _GLOO[key]


class _Works:
    """Several works waited as one (an all-gather made of broadcasts); none:
    already complete (``async_op=False``). Only works that block the CPU (gloo,
    CPU tensors): they are waited in slices (``_divergence.wait``)."""

    def __init__(self, works: list):
        self._works = works

    def wait(self) -> bool:
        for w in self._works:
            _divergence.wait(w)
        self._works = []
        return True


class ReduceScatterWork:
    """A reduce-scatter in flight. ``wait()`` returns this rank's reduced chunk;
    waiting again returns the same tensor without touching the collective
    (waiting a gloo work twice copies its result again)."""

    def __init__(self, work, output: torch.Tensor | None, finish=None):
        self._work, self._finish, self.output = work, finish, output

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            if isinstance(self._work, _Works):  # (a 2-rank exchange: waited in slices)
                self._work.wait()
            elif self.output is None or self.output.device.type == "cpu":  # blocks the CPU
                _divergence.wait(self._work)
            else:
                self._work.wait()
            self._work = None
            if self._finish is not None:
                self.output, self._finish = self._finish(), None
        return self.output


class Ready(ReduceScatterWork):
    """A reduction with nothing to communicate (one rank): the input is the result."""

    def __init__(self, output: torch.Tensor):
        super().__init__(None, output)


def all_gather(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool = True):
    """``output`` (world·S) ← every rank's ``shard`` (S), in rank order."""
    _stats.all_gather_calls += 1
    _stats.all_gather_bytes += _nbytes(output)
    gloo = _in_place_gloo(output, group)
    if gloo is None:
        work = _all_gather_tensor(output, shard, group=group, async_op=async_op)
        return work if async_op else _Works([])
    rank, world = gloo
    chunks = output.view(world, -1)
    if chunks[rank].data_ptr() != shard.data_ptr():
        chunks[rank].copy_(shard)
    works = [dist.broadcast(chunks[r], group=group, group_src=r, async_op=async_op)
             for r in range(world)]
    return _Works(works if async_op else [])


def reduce_scatter(flat_grad: torch.Tensor, group, op=dist.ReduceOp.AVG,
                   out: torch.Tensor | None = None, async_op: bool = True) -> ReduceScatterWork:
    """``op`` (mean by default) over ranks of this rank's chunk of ``flat_grad``
    (world·S); ``wait()`` gives the S-element result (in ``out`` if given). On
    gloo ``flat_grad`` is overwritten, and the result is allocated only when
    waited (not while the collective is in flight)."""
    _stats.reduce_scatter_calls += 1
    _stats.reduce_scatter_bytes += _nbytes(flat_grad)
    gloo = _in_place_gloo(flat_grad, group)
    if gloo is None:
        world = dist.get_world_size(group)
        if out is None:
            out = flat_grad.new_empty(flat_grad.numel() // world)
        work = _reduce_scatter_tensor(out, flat_grad, op=op, group=group, async_op=async_op)
        return ReduceScatterWork(work if async_op else None, out)
    rank, world = gloo
    if async_op and world == 2 and _nbytes(flat_grad) <= P2P_MAX_BYTES:
        return _exchange(flat_grad, group, op, out, rank)
    mine = flat_grad.view(world, -1)[rank]
    if out is not None:
        def finish():
            return torch.div(mine, world, out=out) if op == dist.ReduceOp.AVG else out.copy_(mine)
    elif op == dist.ReduceOp.AVG:
        finish = lambda: torch.div(mine, world)  # noqa: E731
    else:
        finish = mine.clone
    work = dist.all_reduce(flat_grad, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    if not async_op:
        return ReduceScatterWork(None, finish())
    return ReduceScatterWork(work, None, finish)


def _exchange(flat_grad: torch.Tensor, group, op, out, rank: int) -> ReduceScatterWork:
    """A small reduce-scatter over 2 gloo ranks as a point-to-point exchange
    (see the Note): the peer's chunk out, ours in, one addition."""
    chunks = flat_grad.view(2, -1)
    res = out if out is not None else flat_grad.new_empty(chunks.shape[1])
    peer = 1 - rank
    works = [dist.isend(chunks[peer], group=group, group_dst=peer),
             dist.irecv(res, group=group, group_src=peer)]

    def finish() -> torch.Tensor:
        res.add_(chunks[rank])  # (a + b == b + a: the all-reduce's bits)
        if op == dist.ReduceOp.AVG:
            res.div_(2)
        return res

    return ReduceScatterWork(_Works(works), None, finish)


def all_reduce(tensor: torch.Tensor, op, group, what: tuple | None = None) -> None:
    """All-reduce ``tensor`` in place, ``async_op=False`` (norms, flags, HSDP
    gradient shards: on CUDA inside the stream manager's all-reduce stream).

    A tensor on a device the group has no backend for (a CPU partial norm of
    offloaded gradients over an NCCL group: "No backend type associated with
    device type cpu") goes through the group's device and back."""
    _stats.all_reduce_calls += 1
    _stats.all_reduce_bytes += _nbytes(tensor)
    device = _group_device(group, tensor.device)
    if device == tensor.device and device.type == "cpu":  # blocks the CPU: in slices
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
        try:
            _divergence.wait(work)
        except _divergence.CollectiveStopped as e:
            if what is None:
                raise
            raise _divergence.collective_error(*what, e) from e
        return
    if device == tensor.device:
        dist.all_reduce(tensor, op=op, group=group)
        return
    moved = tensor.to(device)
    dist.all_reduce(moved, op=op, group=group)
    tensor.copy_(moved)


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
               input_splits: list[int], group) -> None:
    """``output`` ← from each rank, in rank order, its segment of ``input`` for
    this rank (uneven splits, both tensors 1-D and contiguous);
    ``async_op=False``. The state-dict conversions ([Note: state dicts in
    FSDP2's form] in _checkpoint.py). Tensors on a device the group has no
    backend for go through the group's device and back."""
    _stats.all_to_all_calls += 1
    _stats.all_to_all_bytes += _nbytes(input)
    device = _group_device(group, input.device)
    src = input if input.device == device else input.to(device)
    dst = output if output.device == device else torch.empty_like(output, device=device)
    work = dist.all_to_all_single(dst, src, output_splits, input_splits, group=group,
                                  async_op=True)
    if device.type == "cpu":  # blocks the CPU: in slices (a peer that stopped is noticed)
        _divergence.wait(work)
    else:
        work.wait()
    if dst is not output:
        output.copy_(dst)


def min_across(values: list[int], groups: list) -> list[int]:
    """The element-wise minimum of ``values`` (int64) over the ranks of
    ``groups``, all-reduced in one after the other, read back on the host (a
    sync on CUDA): the forward-order agreement, see [Note: forward order] in
    _forward_walk.py. Counted as all-reduces; issued on the current stream."""
    t = torch.tensor(values, dtype=torch.int64)
    for group in groups:
        _stats.all_reduce_calls += 1
        _stats.all_reduce_bytes += _nbytes(t)
        t = t.to(_group_device(group, t.device))
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return t.tolist()


def _group_device(group, device: torch.device) -> torch.device:
    """``device`` if ``group`` has a backend for its type, else a device it has one for."""
    backends = group_backends(group)
    if device.type in backends or not backends:
        return device
    kind = "cuda" if "cuda" in backends else next(iter(backends))
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())


def all_reduce_async(tensor: torch.Tensor, op, group):
    """In-place all-reduce, not waited (small tensors: the used-flags)."""
    _stats.all_reduce_calls += 1
    _stats.all_reduce_bytes += _nbytes(tensor)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return _Works([work]) if tensor.device.type == "cpu" else work
