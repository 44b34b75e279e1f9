"""Collectives as free functions, with byte counters.

All-gathers and reduce-scatters return a work handle; the caller decides
where to ``wait()``. On gloo they are issued with ``async_op=True`` and
``wait()`` blocks the CPU until the data is there. On CUDA the stream manager
issues them with ``async_op=False`` inside its side-stream context: c10d then
launches the NCCL kernel on that (current) stream, and the returned handle is
already complete (see [Note: side streams] in _streams.py).

The gloo in-place paths (all-gather as broadcasts, reduce-scatter as an
all-reduce or a 2-rank exchange) are in _gloo.py ([Note: gloo collectives]).

[Note: padded collectives]
Uneven pieces ([Note: shard layout] in _layout.py) on every backend but gloo
go through ONE equal-size collective, never torch's list forms (which NCCL
runs as one broadcast or reduce per rank): every rank's piece is padded to
the largest, ``slot`` elements, in a *staging* buffer of ``W·slot``, rank-major.
The copies between the flat (pieces end to end) and the staging are one
``index_select`` / ``index_copy_`` each, over blocks of ``U`` elements (``U``
divides every boundary, the slot and the staging's row), with the block
indices made once per layout (``_staging_index``); the padding is zeroed, so
a collective never reads memory nobody wrote. All-gather: this rank's piece
is copied into its row, gathered, copied out into the flat. Reduce-scatter:
the flat gradient is copied into the staging, reduced, and this rank's row's
first ``piece`` elements are the result. Cost: the staging (one group's size)
and one copy of the group each way; equal chunks stay zero-copy.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from . import _divergence, _gloo
from .._base._common import all_gather_tensor, group_backends, reduce_scatter_tensor
from .._base._job import job
from ..api import CommStats


def _stats() -> CommStats:
    """This job's counters (_job.py)."""
    j = job()
    if j.comm is None:
        j.comm = CommStats()
    return j.comm


_all_gather_tensor = all_gather_tensor  # (torch 2.13's names, _common)
_reduce_scatter_tensor = reduce_scatter_tensor


def comm_stats() -> CommStats:
    """A snapshot of the collectives this process issued in this job."""
    return dataclasses.replace(_stats())


def reset_comm_stats() -> None:
    j = job()
    j.comm_before_reset += _calls(_stats())
    j.comm = CommStats()


def _calls(s: CommStats) -> int:
    return s.all_gather_calls + s.reduce_scatter_calls + s.all_reduce_calls + s.all_to_all_calls


def issued() -> int:
    """Collectives this process issued so far in this job (reset_comm_stats()
    aside): where a rank is in the sequence every rank issues alike."""
    return job().comm_before_reset + _calls(_stats())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Works:
    """Several works waited as one (an all-gather made of broadcasts); none:
    already complete (``async_op=False``). Only works that block the CPU (gloo,
    CPU tensors): they are waited in slices (``_divergence.wait``)."""

    def __init__(self, works: list, at: tuple | None = None):
        self._works, self._at = works, at  # at: (group name, position), see _divergence.next_op

    def wait(self) -> bool:
        for w in self._works:
            _divergence.wait(w, self._at)
        self._works = []
        return True


class ReduceScatterWork:
    """A reduce-scatter in flight. ``wait()`` returns this rank's reduced chunk;
    waiting again returns the same tensor without touching the collective
    (waiting a gloo work twice copies its result again)."""

    def __init__(self, work, output: torch.Tensor | None, finish=None, at: tuple | None = None):
        self._work, self._finish, self.output, self._at = work, finish, output, at

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            if isinstance(self._work, _Works):  # (a 2-rank exchange: waited in slices)
                self._work.wait()
            elif self.output is None or self.output.device.type == "cpu":  # blocks the CPU
                _divergence.wait(self._work, self._at)
            else:
                self._work.wait()
            self._work = None
            if self._finish is not None:
                self.output, self._finish = self._finish(), None
        return self.output  # type: ignore[return-value]


class Ready(ReduceScatterWork):
    """A reduction with nothing to communicate (one rank): the input is the result."""

    def __init__(self, output: torch.Tensor):
        super().__init__(None, output)


def _pieces(t: torch.Tensor, world: int, bounds: tuple | None) -> list[torch.Tensor]:
    """Every rank's range of ``t``: equal chunks, or ``[bounds[r], bounds[r+1])``."""
    if bounds is None:
        return list(t.view(world, -1))
    return [t[a:b] for a, b in zip(bounds, bounds[1:])]


# A test seam: groups built while it is True take the padded path on gloo too
# (the collectives and copies NCCL runs, with real data: tests/test_parity.py).
PAD_UNEVEN_ON_GLOO = False


def pads(group, device: torch.device) -> bool:
    """Uneven pieces over ``group`` for tensors on ``device`` go through the
    padded equal-size collective ([Note: padded collectives]); False: gloo's
    in-place path."""
    return PAD_UNEVEN_ON_GLOO or dist.get_backend(group) != "gloo"


_INDEX: dict = {}
_INDEX_KEPT = 64  # distinct (layout, bucket position, device): a few per model


def _segmented(bounds: tuple) -> bool:
    """``bounds`` is every rank's segments (two lanes: ``Layout.gather_spec``),
    not W + 1 boundaries (one range per rank)."""
    return isinstance(bounds[0], tuple)


def segments_of(bounds: tuple) -> tuple:
    """Every rank's ranges of the flat, in its shard's order (see ``_segmented``)."""
    if _segmented(bounds):
        return bounds
    return tuple(((a, b),) for a, b in zip(bounds, bounds[1:]))


def ranks_in(bounds: tuple) -> int:
    """The number of ranks ``bounds`` describes (see ``_segmented``)."""
    return len(bounds) if _segmented(bounds) else len(bounds) - 1


def piece_numel(bounds: tuple, rank: int) -> int:
    """Elements of ``rank``'s piece (see ``_segmented``)."""
    if _segmented(bounds):
        return sum(b - a for a, b in bounds[rank])
    return bounds[rank + 1] - bounds[rank]


def flat_end(bounds: tuple) -> int:
    """Where the last piece ends in the flat (the tail after it is never
    gathered): the last rank's last segment (the lanes tile the flat in order)."""
    return bounds[-1][-1][1] if _segmented(bounds) else bounds[-1]


def _staging_index(bounds: tuple, slot: int, row: int, at: int, device: torch.device):
    """(U, flat blocks' staging blocks, the staging's padding blocks) for
    pieces ``bounds`` (see ``segments_of``) padded to ``slot`` in rows of
    ``row`` elements starting at column ``at`` (see the Note), as int64
    tensors on ``device``, blocks of ``U`` elements; made once per key."""
    key = (bounds, slot, row, at, device)
    got = _INDEX.get(key)
    if got is None:
        segs = segments_of(bounds)
        W = len(segs)
        edges = [x for rank in segs for seg in rank for x in seg]
        unit = math.gcd(slot, row, at, *edges)
        # each segment: (flat start, staging start, length) in blocks
        parts, used = [], []
        for r, rank in enumerate(segs):
            col = r * row + at
            for lo, hi in rank:
                if hi > lo:
                    parts.append((lo // unit, col // unit, (hi - lo) // unit))
                col += hi - lo
            used.append(col - r * row - at)
        parts.sort()  # (flat order: the segments tile the flat up to the last one's end)
        stage_at = torch.tensor([p[1] for p in parts], dtype=torch.int64)
        n = torch.tensor([p[2] for p in parts], dtype=torch.int64)
        before = torch.cumsum(n, 0) - n                     # flat blocks of earlier segments
        src = torch.repeat_interleave(stage_at - before, n) + torch.arange(int(n.sum()))
        u = torch.tensor(used, dtype=torch.int64) // unit   # (W,) blocks used per row
        first = (torch.arange(W) * row + at) // unit        # (W,) each row's first block
        m = slot // unit - u                                # (W,) padding blocks per row
        pad = (torch.repeat_interleave(first + u - (torch.cumsum(m, 0) - m), m)
               + torch.arange(int(m.sum())))
        got = _INDEX[key] = (unit, src.to(device), pad.to(device))
        if len(_INDEX) > _INDEX_KEPT:
            _INDEX.pop(next(iter(_INDEX)))
    return got


_SLOTS: dict = {}


def staging_slot(bounds: tuple) -> int:
    """The padded piece: the largest (a pass over W pieces, made once per layout)."""
    slot = _SLOTS.get(bounds)
    if slot is None:
        slot = _SLOTS[bounds] = max(piece_numel(bounds, r) for r in range(ranks_in(bounds)))
        if len(_SLOTS) > _INDEX_KEPT:
            _SLOTS.pop(next(iter(_SLOTS)))
    return slot


def pack(staging: torch.Tensor, flat: torch.Tensor, bounds: tuple, slot: int,
         row: int | None = None, at: int = 0) -> None:
    """Every rank's piece of ``flat`` into its row of ``staging`` (rows of
    ``row`` elements, this group's part from column ``at``), padding zeroed."""
    row = slot if row is None else row
    unit, src, pad = _staging_index(bounds, slot, row, at, flat.device)
    blocks = staging.view(-1, unit)
    blocks.index_copy_(0, src, flat[:flat_end(bounds)].view(-1, unit))
    if pad.numel():
        blocks.index_fill_(0, pad, 0)


def unpack(flat: torch.Tensor, staging: torch.Tensor, bounds: tuple, slot: int,
           row: int | None = None, at: int = 0) -> None:
    """The inverse of ``pack``: every rank's row of ``staging`` into its piece of ``flat``."""
    row = slot if row is None else row
    unit, src, _ = _staging_index(bounds, slot, row, at, flat.device)
    torch.index_select(staging.view(-1, unit), 0, src,
                       out=flat[:flat_end(bounds)].view(-1, unit))


class _Then:
    """A work whose ``wait()`` then runs ``finish`` once (a copy out of the staging)."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._finish is not None:
            self._finish()
            self._finish = None
        return True


def _padded_all_gather(output, shard, group, async_op: bool, bounds: tuple, slot: int, at):
    W, r = ranks_in(bounds), dist.get_rank(group)
    staging = output.new_empty(W * slot)
    mine = staging[r * slot:(r + 1) * slot]
    n = piece_numel(bounds, r)
    mine[:n].copy_(shard)
    mine[n:].zero_()
    work = _all_gather_tensor(staging, mine, group=group, async_op=async_op)

    def finish():
        unpack(output, staging, bounds, slot)
    if not async_op:
        finish()
        return _Works([])
    return _Then(_Works([work], at) if output.device.type == "cpu" else work, finish)


def _padded_reduce_scatter(flat_grad, group, op, out, async_op: bool, bounds: tuple, slot: int,
                           at):
    W, r = ranks_in(bounds), dist.get_rank(group)
    staging = flat_grad.new_empty(W * slot)
    pack(staging, flat_grad, bounds, slot)
    res = flat_grad.new_empty(slot)
    n = piece_numel(bounds, r)
    work = _reduce_scatter_tensor(res, staging, op=op, group=group, async_op=async_op)

    def finish():
        if out is None:
            return res[:n]
        return out.copy_(res[:n])
    if not async_op:
        return ReduceScatterWork(None, finish())
    if flat_grad.device.type == "cpu":
        return ReduceScatterWork(_Works([work], at), None, finish)
    return ReduceScatterWork(work, None, finish)


def all_gather(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool = True,
               bounds: tuple | None = None, padded: bool | None = None):
    """``output`` (world·S) ← every rank's ``shard`` (S), in rank order.

    ``bounds`` (uneven pieces, see [Note: shard layout] in _layout.py): rank r's
    shard goes to ``output[bounds[r]:bounds[r+1]]``; on gloo the broadcasts
    below, on every other backend one equal-size all-gather of the pieces
    padded to the largest ([Note: padded collectives]; the bytes counted are
    the padded ones). ``padded``: the group's own decision (None: by the backend)."""
    padded = bounds is not None and (pads(group, output.device) if padded is None else padded)
    _stats().all_gather_calls += 1
    at = _divergence.next_op(group)
    if padded and bounds is not None:
        slot = staging_slot(bounds)
        _stats().all_gather_bytes += ranks_in(bounds) * slot * output.element_size()
        return _padded_all_gather(output, shard, group, async_op, bounds, slot, at)
    _stats().all_gather_bytes += _nbytes(output)
    gloo = _gloo.in_place(output, group) if bounds is None else _gloo.uneven(group, output)
    if gloo is None:
        work = _all_gather_tensor(output, shard, group=group, async_op=async_op)
        return work if async_op else _Works([])
    works = _gloo.all_gather(_pieces(output, gloo[1], bounds), shard, group, gloo[0],
                             async_op, skip_empty=bounds is not None)
    return _Works(works if async_op else [], at)


def reduce_scatter(flat_grad: torch.Tensor, group, op=dist.ReduceOp.AVG,
                   out: torch.Tensor | None = None, async_op: bool = True,
                   bounds: tuple | None = None, padded: bool | None = None) -> ReduceScatterWork:
    """``op`` (mean by default) over ranks of this rank's chunk of ``flat_grad``
    (world·S); ``wait()`` gives the S-element result (in ``out`` if given). On
    gloo ``flat_grad`` is overwritten, and the result is allocated only when
    waited (not while the collective is in flight). ``bounds``: uneven pieces,
    this rank's is ``flat_grad[bounds[r]:bounds[r+1]]`` (on gloo the
    all-reduce below; on every other backend one equal-size reduce-scatter of
    the pieces padded to the largest, [Note: padded collectives])."""
    padded = bounds is not None and (pads(group, flat_grad.device) if padded is None
                                     else padded)
    _stats().reduce_scatter_calls += 1
    at = _divergence.next_op(group)
    if padded and bounds is not None:
        slot = staging_slot(bounds)
        _stats().reduce_scatter_bytes += ranks_in(bounds) * slot * flat_grad.element_size()
        return _padded_reduce_scatter(flat_grad, group, op, out, async_op, bounds, slot, at)
    _stats().reduce_scatter_bytes += _nbytes(flat_grad)
    gloo = (_gloo.in_place(flat_grad, group) if bounds is None
            else _gloo.uneven(group, flat_grad))
    if gloo is None:
        world = dist.get_world_size(group)
        if out is None:
            out = flat_grad.new_empty(flat_grad.numel() // world)
        work = _reduce_scatter_tensor(out, flat_grad, op=op, group=group, async_op=async_op)
        return ReduceScatterWork(work if async_op else None, out)
    rank, world = gloo
    chunks = _pieces(flat_grad, world, bounds)
    if async_op and _gloo.exchanges(world, _nbytes(flat_grad)):
        works, finish = _gloo.exchange(chunks, group, op, out, rank)
        return ReduceScatterWork(_Works(works, at), None, finish)
    work, finish = _gloo.reduce_scatter(flat_grad, chunks[rank], group, op, out, world, async_op)
    if not async_op:
        return ReduceScatterWork(None, finish())
    return ReduceScatterWork(work, None, finish, at)


def all_reduce(tensor: torch.Tensor, op, group, what: tuple[str, str] | None = None,
               blocks_cpu: bool | None = None) -> None:
    """All-reduce ``tensor`` in place, ``async_op=False`` (norms, flags, HSDP
    gradient shards: on CUDA inside the stream manager's all-reduce stream).
    ``blocks_cpu``: whether the wait blocks the CPU (then it is sliced, see
    _divergence.wait); None: a CPU tensor on a group with a CPU backend
    (gloo); the stream manager says False on its side streams.

    A tensor on a device the group has no backend for (a CPU partial norm of
    offloaded gradients over an NCCL group: "No backend type associated with
    device type cpu") goes through the group's device and back."""
    _stats().all_reduce_calls += 1
    _stats().all_reduce_bytes += _nbytes(tensor)
    at = _divergence.next_op(group)
    device = _group_device(group, tensor.device)
    if blocks_cpu is None:
        blocks_cpu = device.type == "cpu"
    if device == tensor.device and blocks_cpu:  # in slices
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
        try:
            _divergence.wait(work, at)
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


def reduce_small(tensor: torch.Tensor, op, group, doing: str) -> None:
    """``tensor`` (a few elements: a norm, a flag) reduced over ``group`` in
    place, for a call of the user's outside the step (``doing`` names it:
    clip_grad_norm_).

    Where the wait blocks the CPU (gloo) it is an all-gather and a reduction
    here, in rank order: gloo pairs the n-th collectives of one kind, so an
    all-reduce issued on some ranks only would pair with the others' step
    check (an all-reduce of another size: gloo aborts the process). An
    all-gather pairs with nothing there; the sliced wait sees the peers in
    their check and every rank raises a DivergenceError naming ``doing``
    (_divergence.user_collective). Elsewhere (NCCL) an all-reduce."""
    device = _group_device(group, tensor.device)
    if device != tensor.device or device.type != "cpu" or op not in (
            dist.ReduceOp.SUM, dist.ReduceOp.MAX):
        all_reduce(tensor, op, group)
        return
    flat = tensor.detach().reshape(-1).contiguous()
    out = flat.new_empty(dist.get_world_size(group) * flat.numel())
    _count_all_reduce(flat)  # (counted as the reduction it is: comm_stats()'s
    # all-gathers are the parameters')
    _divergence.user_collective(
        group, lambda: _all_gather_tensor(out, flat, group=group, async_op=True),
        f"{doing} (an all-gather)", blocks_cpu=True)
    out = out.view(-1, flat.numel())
    red = out.sum(0) if op == dist.ReduceOp.SUM else out.amax(0)  # (amax keeps a NaN)
    tensor.copy_(red.view_as(tensor))


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
               input_splits: list[int], group) -> None:
    """``output`` ← from each rank, in rank order, its segment of ``input`` for
    this rank (uneven splits, both tensors 1-D and contiguous);
    ``async_op=False``. The state-dict conversions ([Note: state dicts in
    FSDP2's form] in _checkpoint.py). Tensors on a device the group has no
    backend for go through the group's device and back."""
    _stats().all_to_all_calls += 1
    _stats().all_to_all_bytes += _nbytes(input)
    at = _divergence.next_op(group)
    device = _group_device(group, input.device)
    src = input if input.device == device else input.to(device)
    dst = output if output.device == device else torch.empty_like(output, device=device)
    work = dist.all_to_all_single(dst, src, output_splits, input_splits, group=group,
                                  async_op=True)
    if device.type == "cpu":  # blocks the CPU: in slices (a peer that stopped is noticed)
        _divergence.wait(work, at)
    else:
        work.wait()
    if dst is not output:
        output.copy_(dst)


def min_across(values: list[int], groups: list) -> list[int]:
    """The element-wise minimum of ``values`` (int64) over the ranks of
    ``groups``, all-reduced in one after the other, read back on the host: the
    forward-order agreement, see [Note: forward order] in _forward_walk.py.
    Counted as all-reduces. This is the path without side streams (gloo): a
    wait that blocks the CPU is sliced (``_divergence.wait``), so a peer that
    stopped is noticed; on CUDA the stream manager runs ``min_in_place``."""
    t = torch.tensor(values, dtype=torch.int64)
    for group in groups:
        t = t.to(_group_device(group, t.device))
        _count_all_reduce(t)
        at = _divergence.next_op(group)
        if t.device.type == "cpu":
            _divergence.wait(dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group,
                                             async_op=True), at)
        else:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return t.tolist()


def min_in_place(t: torch.Tensor, groups: list) -> _Works:
    """``t`` (int64, on the groups' device) becomes its element-wise minimum
    over ``groups``, issued ``async_op=False`` on the current stream (the
    stream manager's side stream)."""
    for group in groups:
        _count_all_reduce(t)
        _divergence.next_op(group)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return _Works([])


def _count_all_reduce(t: torch.Tensor) -> None:
    _stats().all_reduce_calls += 1
    _stats().all_reduce_bytes += _nbytes(t)


def _group_device(group, device: torch.device) -> torch.device:
    """``device`` if ``group`` has a backend for its type, else a device it has one for."""
    backends = group_backends(group)
    if device.type in backends or not backends:
        return device
    kind = "cuda" if "cuda" in backends else next(iter(backends))
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())


def all_reduce_async(tensor: torch.Tensor, op, group, async_op: bool = True):
    """In-place all-reduce, not waited (small tensors: the used-flags).
    ``async_op=False``: on CUDA, issued on the current (side) stream, see
    [Note: side streams] in _streams.py."""
    _stats().all_reduce_calls += 1
    _stats().all_reduce_bytes += _nbytes(tensor)
    at = _divergence.next_op(group)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    if not async_op:
        return _Works([])
    return _Works([work], at) if tensor.device.type == "cpu" else work
