"""Where each parameter's rows live: the layout of one flat group. Pure arithmetic.

[Note: shard layout]
A flat group of ``W`` ranks is one unsharded buffer of ``W·S`` elements made
of ``W`` equal *chunks*: rank r keeps chunk ``[r·S, (r+1)·S)`` as its local
shard. So the all-gather is ONE equal-size collective (all-gather input = the
shard, output = the unsharded flat), and so is the reduce-scatter.

Every parameter is *contiguous* in the unsharded flat (starting at
``offsets[i]``, a multiple of the alignment): its full-shape view is a plain
view, zero-copy, whatever ranks it spans. What makes that possible is where
the chunk boundaries fall inside it:

- *row granularity* (the default): a boundary inside a parameter falls
  between two of its dim-0 rows, so each rank's piece is a block of whole
  rows, shape ``(rows_r, *shape[1:])`` (0 rows allowed). Parameters are laid
  out in order, each at the next aligned position; one that would cross the
  end of a chunk at a place that is not a row boundary is first moved forward
  by less than ``lcm(row, alignment)`` elements (padding) to a position from
  which the boundary is a row boundary. A parameter that crosses two
  boundaries or more holds a whole chunk, which must then be whole rows: the
  chunk size is a multiple of its row size. ``S`` is the smallest multiple of
  the alignment, from ``total / W`` up, with which this fill is valid and fits
  in ``W`` chunks: every rank but the last holds about ``S`` elements, the
  last the rest (the most any rank holds, which sets the collectives' size
  and the optimizer's time, is ``total / W`` plus the alignment and the
  row-boundary moves, plus, when a parameter spans several chunks, up to its
  row size).
- *tensor granularity* (opt-in): each parameter lies whole in one chunk; the
  parameters are assigned largest first to the rank that holds the fewest
  elements so far (ties: the lower rank), deterministic, and laid out in their
  own order inside each chunk; ``S`` is the largest rank's load. Other ranks'
  pieces are empty.

A 0-d parameter is one row of one element; a 1-d parameter's rows are its
elements. The alignment is applied to every piece's start, so every rank's
pieces start aligned in its shard.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

GRANULARITIES = ("row", "tensor")
ALIGN_BYTES = 16  # every piece starts at a multiple of this many bytes


def align_elems(itemsize: int) -> int:
    """The alignment in elements of ``itemsize`` bytes (at least 1)."""
    return max(1, ALIGN_BYTES // itemsize)


@dataclass(frozen=True)
class Slot:
    """What the layout needs to know about one parameter."""

    rows: int       # dim-0 size (1 for a 0-d parameter)
    row_numel: int  # elements per row (1 for 0-d and 1-d parameters)

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel


@dataclass(frozen=True)
class Piece:
    """One parameter's rows held by one rank."""

    entry: int                # index of the parameter in the group
    rows: tuple[int, int]     # [start, end) of its dim-0 rows
    offset: int               # where they start in the rank's chunk (its shard)


@dataclass(frozen=True)
class Layout:
    """The result: the chunk size and where every parameter starts in the flat."""

    granularity: str
    world: int
    chunk: int                      # S: elements per rank (shard size)
    offsets: tuple[int, ...]        # each parameter's start in the unsharded flat
    slots: tuple[Slot, ...]

    @property
    def numel(self) -> int:
        """Elements of the unsharded flat (``W·S``)."""
        return self.world * self.chunk

    def rows_on(self, entry: int, rank: int) -> tuple[int, int]:
        """The rows of parameter ``entry`` that ``rank`` holds; ``(0, 0)`` if none."""
        s, off = self.slots[entry], self.offsets[entry]
        lo, hi = max(off, rank * self.chunk), min(off + s.numel, (rank + 1) * self.chunk)
        if lo >= hi:
            return (0, 0)
        return ((lo - off) // s.row_numel, (hi - off) // s.row_numel)

    def pieces(self, rank: int) -> list[Piece]:
        """``rank``'s non-empty pieces, in the order they lie in its chunk."""
        out = []
        for i in sorted(range(len(self.slots)), key=self.offsets.__getitem__):
            a, b = self.rows_on(i, rank)
            if b > a:
                start = self.offsets[i] + a * self.slots[i].row_numel
                out.append(Piece(i, (a, b), start - rank * self.chunk))
        return out

    @functools.cached_property
    def _rank_numel(self) -> tuple[int, ...]:
        held = [0] * self.world
        for s, off in zip(self.slots, self.offsets):
            at, end = off, off + s.numel
            while at < end:  # the chunks it lies in
                r = at // self.chunk
                stop = min(end, (r + 1) * self.chunk)
                held[r] += stop - at
                at = stop
        return tuple(held)

    def rank_numel(self) -> tuple[int, ...]:
        """Elements (padding excluded) each rank holds."""
        return self._rank_numel

    def split_plan(self) -> tuple[list[int], list[int]]:
        """The unsharded flat split into the parameters (in flat order) and the
        padding between them: (split sizes, index of each parameter's piece). One
        split, one view per parameter (see ``FlatGroup.refresh_views``)."""
        sizes, view_at, at = [], [0] * len(self.slots), 0
        for i in sorted(range(len(self.slots)), key=self.offsets.__getitem__):
            if self.offsets[i] > at:
                sizes.append(self.offsets[i] - at)  # padding
            view_at[i] = len(sizes)
            sizes.append(self.slots[i].numel)
            at = self.offsets[i] + self.slots[i].numel
        if self.numel > at:
            sizes.append(self.numel - at)  # tail padding
        return sizes, view_at


def _ceil_to(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def plan(slots: Sequence[Slot], world: int, align: int, granularity: str = "row") -> Layout:
    """The layout of a group of ``slots`` over ``world`` ranks, every piece
    starting at a multiple of ``align`` elements (see [Note: shard layout])."""
    slots = tuple(slots)
    if granularity == "row":
        chunk, offsets = _row_layout(slots, world, align)
    elif granularity == "tensor":
        chunk, offsets = _tensor_layout(slots, world, align)
    else:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    return Layout(granularity, world, chunk, tuple(offsets), slots)


def _fill(slots: tuple[Slot, ...], align: int, chunk: int) -> tuple[list[int], int, int]:
    """Row layout with chunk size ``chunk``: (offsets, end of the last parameter,
    need), where ``need`` > 1 is the lcm of the row sizes that the chunk size
    must be a multiple of because a parameter crosses two boundaries or more
    (then the offsets are not valid)."""
    offsets, pos, need = [], 0, 1
    for s in slots:
        pos = _ceil_to(pos, align)
        n, k = s.numel, s.row_numel
        boundary = (pos // chunk + 1) * chunk
        if n and pos + n > boundary and (boundary - pos) % k:
            # Move it forward to the first aligned start from which the
            # boundary is a row boundary: starts congruent to the boundary
            # modulo lcm(k, align) (the boundary itself is one).
            step = math.lcm(k, align)
            pos = boundary - (boundary - pos) // step * step
        if pos + n > boundary + chunk and chunk % k:
            need = math.lcm(need, k)  # a whole chunk inside it must be whole rows
        offsets.append(pos)
        pos += n
    return offsets, pos, need


_LINEAR_TRIES = 256


def _row_layout(slots: tuple[Slot, ...], world: int, align: int) -> tuple[int, list[int]]:
    total = sum(_ceil_to(s.numel, align) for s in slots)
    chunk = max(align, _ceil_to(-(-total // world), align))
    tries = 0
    while True:
        offsets, end, need = _fill(slots, align, chunk)
        tries += 1
        # The next candidate: the next multiple of the alignment (a multiple of
        # ``need`` may not be the smallest size that works), or, after
        # _LINEAR_TRIES of those, the next multiple of ``need`` (a row size
        # of tens of thousands of elements would otherwise take that many
        # fills); when the parameters did not fit, the size at which this
        # fill's end would.
        if need > 1:
            chunk = (chunk + align if tries < _LINEAR_TRIES
                     else _ceil_to(chunk + 1, math.lcm(align, need)))
        elif end > world * chunk:
            chunk = max(chunk + align, _ceil_to(-(-end // world), align))
        else:
            return chunk, offsets


def _tensor_layout(slots: tuple[Slot, ...], world: int, align: int) -> tuple[int, list[int]]:
    load = [0] * world
    owner = [0] * len(slots)
    for i in sorted(range(len(slots)), key=lambda i: (-slots[i].numel, i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += _ceil_to(slots[i].numel, align)
    chunk = max(align, max(load))
    offsets, at = [0] * len(slots), [0] * world
    for i, s in enumerate(slots):
        r = owner[i]
        offsets[i] = r * chunk + at[r]
        at[r] += _ceil_to(s.numel, align)
    return chunk, offsets
