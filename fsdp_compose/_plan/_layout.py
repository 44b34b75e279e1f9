"""Where each parameter's rows live: the layout of one flat group. Pure arithmetic.
How the layouts are found, and what they cost: docs/design.md, "Row-granular
shards", "Row-granular shards at scale", "Tensor-granular shards".

[Note: shard layout]
A flat group of ``W`` ranks is one unsharded buffer (the *flat*, ``numel``
elements) in which rank r's shard is the range ``[bounds[r], bounds[r+1])``:
the all-gather (shard in, flat out) and the reduce-scatter are zero-copy.
Every parameter is contiguous in the flat from ``offsets[i]``, a multiple of
the alignment, so its full-shape view is a plain view; every piece starts at
a multiple of the alignment in its rank's shard.
- *row granularity* (default): a boundary inside a parameter falls between
  two dim-0 rows, so a piece is ``(rows_r, *shape[1:])``, 0 rows allowed (a
  0-d parameter is one row of one element, a 1-d one's rows its elements).
  ``plan`` takes *equal chunks* (``Layout.even``: ``bounds[r] = r·chunk``,
  equal-size collectives) or *uneven pieces* (only alignment padding, the
  largest piece as small as whole rows allow, each rank's sum over groups
  close to its share; the parameters' order may rotate; ``numel`` a
  multiple of ``W·align``, the tail never gathered; the collectives pad every
  piece to the largest, ``chunk``: [Note: padded collectives] in _collectives.py).
- *tensor granularity* (opt-in): each parameter lies whole in one rank's chunk.

[Note: lanes]
From ``LANES_FROM`` ranks on, a group whose one-lane largest piece is past
the share by more than 1/``LANES_OVER`` (rows of many elements against a
share of a few rows: the 6.6B Llama block's ``w_down``, rows of 10944
elements against a share of 49.2K at 4096 ranks, 8.1% over) may take two
*lanes* (``_two_lanes``): the parameters with the coarsest rows first in the
flat (lane A), the others after them (lane B), each lane cut in rank order
as one lane is (``Layout.lanes``: each lane's bounds). Every rank's shard is
its piece of A then its piece of B, two ranges of the flat
(``Layout.segments``), so a rank short of the share in A takes rows of B
(2.7% over the share there). Every parameter's rows still lie on ranks in
rank order, one block each (its DTensor split, ``RowShard``); the flat is
the parameters in lane order; the collectives are the padded ones on every
backend (the staging's copies place the segments, gloo included).
"""
from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import Sequence

GRANULARITIES = ("row", "tensor")
ALIGN_BYTES = 16  # every piece starts at a multiple of this many bytes
EVEN_PADDING = 64  # equal chunks while they pad by at most total / 64, or one row per rank
# Row layouts of groups built from now on: None, ``plan`` chooses; True / False
# force equal chunks / uneven pieces (tests and measurements only; read by
# FlatGroup, not by ``plan``, which stays a function of its arguments).
FORCE_EVEN: bool | None = None


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
    offset: int               # where they start in the rank's shard


class Segments(tuple):
    """Every rank's ranges of the flat (two lanes), hashed once: the
    collectives look their index up by it at every call (a tuple of 4096
    ranks' segments takes ~0.45 ms to hash)."""

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = tuple.__hash__(self)
        return h


@dataclass(frozen=True)
class Layout:
    """The result: every rank's range of the flat and where every parameter starts in it."""

    granularity: str
    world: int
    chunk: int                      # equal chunks: S; uneven pieces: the largest piece
    offsets: tuple[int, ...]        # each parameter's start in the unsharded flat
    slots: tuple[Slot, ...]
    bounds: tuple[int, ...]         # W + 1: rank r holds [bounds[r], bounds[r+1]) of the flat
    numel: int                      # elements of the unsharded flat (W·S with equal chunks)
    # Two lanes ([Note: lanes]): each lane's W + 1 bounds (``bounds`` is then
    # the first lane's); empty: one range per rank, ``bounds``
    lanes: tuple[tuple[int, ...], ...] = ()

    @property
    def even(self) -> bool:
        """Equal chunks: ``bounds[r] == r·chunk`` and ``numel == W·chunk`` (one
        equal-size collective); else uneven pieces (see [Note: shard layout])."""
        return (not self.lanes and self.numel == self.world * self.chunk
                and self.bounds[-1] == self.numel)

    @property
    def contiguous(self) -> bool:
        """Every rank's shard is one range of the flat (``rank_range``)."""
        return not self.lanes

    def rank_range(self, rank: int) -> tuple[int, int]:
        """``rank``'s shard as a range of the unsharded flat (a contiguous layout)."""
        if self.lanes:
            raise ValueError("a layout of lanes has no single range per rank")
        return self.bounds[rank], self.bounds[rank + 1]

    @property
    def lane_bounds(self) -> tuple[tuple[int, ...], ...]:
        """Every lane's W + 1 bounds, in flat order (one lane: ``bounds``)."""
        return self.lanes or (self.bounds,)

    def segments(self, rank: int) -> tuple[tuple[int, int], ...]:
        """``rank``'s shard as ranges of the flat, in the order they lie in it."""
        return tuple((b[rank], b[rank + 1]) for b in self.lane_bounds)

    def gather_spec(self) -> tuple | None:
        """What the collectives need of an uneven layout (None: equal chunks):
        the bounds (one range per rank), or every rank's segments (lanes)."""
        if self.even:
            return None
        if not self.lanes:
            return self.bounds
        return self._segments

    @functools.cached_property
    def _segments(self) -> "Segments":
        return Segments(self.segments(r) for r in range(self.world))

    def shard_numel(self, rank: int) -> int:
        """Elements of ``rank``'s shard (its range, alignment gaps included)."""
        return sum(b[rank + 1] - b[rank] for b in self.lane_bounds)

    def _lane_of(self, entry: int) -> tuple[int, ...]:
        """The bounds of the lane parameter ``entry`` lies in (the lanes tile the flat)."""
        if not self.lanes:
            return self.bounds
        off = self.offsets[entry]
        for b in reversed(self.lanes):
            if off >= b[0]:
                return b
        return self.lanes[0]

    def shard_start(self, entry: int, rank: int) -> int:
        """Where parameter ``entry``'s first row held by ``rank`` lies in its
        shard (meaningful where it holds some: ``rows_on``)."""
        a, _ = self.rows_on(entry, rank)
        at = self.offsets[entry] + a * self.slots[entry].row_numel
        lane, before = self._lane_of(entry), 0
        for b in self.lane_bounds:
            if b is lane:
                break
            before += b[rank + 1] - b[rank]
        return before + at - lane[rank]

    def rows_on(self, entry: int, rank: int) -> tuple[int, int]:
        """The rows of parameter ``entry`` that ``rank`` holds; ``(0, 0)`` if none."""
        s, off, bounds = self.slots[entry], self.offsets[entry], self._lane_of(entry)
        lo, hi = max(off, bounds[rank]), min(off + s.numel, bounds[rank + 1])
        if lo >= hi:
            return (0, 0)
        return ((lo - off) // s.row_numel, (hi - off) // s.row_numel)

    @property
    def padding(self) -> int:
        """Elements of the unsharded flat that are not parameters."""
        return self.numel - sum(s.numel for s in self.slots)

    def ranks_of(self, entry: int) -> list[tuple[int, int, int]]:
        """``[(rank, first row, end row)]`` of every rank holding rows of parameter
        ``entry``, in rank order (the same on every rank: a function of the layout)."""
        s, off, bounds = self.slots[entry], self.offsets[entry], self._lane_of(entry)
        out, at, end = [], off, off + s.numel
        while at < end:
            r = bisect.bisect_right(bounds, at) - 1  # (skips ranks holding nothing)
            stop = min(end, bounds[r + 1])
            out.append((r, (at - off) // s.row_numel, (stop - off) // s.row_numel))
            at = stop
        return out

    @functools.cached_property
    def _order(self) -> tuple[int, ...]:
        # (an empty slot sharing an offset with a parameter comes first)
        return tuple(sorted(range(len(self.slots)),
                            key=lambda i: (self.offsets[i], self.slots[i].numel > 0)))

    def pieces(self, rank: int) -> list[Piece]:
        """``rank``'s non-empty pieces, in the order they lie in its shard."""
        out = []
        for i in self._order:
            a, b = self.rows_on(i, rank)
            if b > a:
                out.append(Piece(i, (a, b), self.shard_start(i, rank)))
        return sorted(out, key=lambda p: p.offset)

    @functools.cached_property
    def _rank_numel(self) -> tuple[int, ...]:
        held = [0] * self.world
        for i, s in enumerate(self.slots):
            for r, a, b in self.ranks_of(i):
                held[r] += (b - a) * s.row_numel
        return tuple(held)

    def rank_numel(self) -> tuple[int, ...]:
        """Elements (padding excluded) each rank holds."""
        return self._rank_numel

    def split_plan(self) -> tuple[list[int], list[int]]:
        """The unsharded flat split into the parameters (in flat order) and the
        padding between them: (split sizes, index of each parameter's piece). One
        split, one view per parameter (see ``FlatGroup.refresh_views``)."""
        sizes, view_at, at = [], [0] * len(self.slots), 0
        for i in self._order:
            if self.offsets[i] > at:
                sizes.append(self.offsets[i] - at)  # padding
            view_at[i] = len(sizes)
            sizes.append(self.slots[i].numel)
            at = max(at, self.offsets[i] + self.slots[i].numel)  # (empty slots share offsets)
        if self.numel > at:
            sizes.append(self.numel - at)  # tail padding
        return sizes, view_at


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """``[lo, hi)`` of part ``index`` when ``size`` is split into ``parts`` as
    ``torch.chunk`` (and so DTensor's ``Shard``) splits it: parts of
    ``ceil(size / parts)``, the last ones shorter or empty."""
    c = -(-size // parts) if size else 0
    lo = min(index * c, size)
    return lo, min(lo + c, size)


def contiguous_stride(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape`` (a 0-size dim counted as 1)."""
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def _ceil_to(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def plan(slots: Sequence[Slot], world: int, align: int, granularity: str = "row",
         before: Sequence[int] | None = None, even: bool | None = None) -> Layout:
    """The layout of a group of ``slots`` over ``world`` ranks, every piece
    starting at a multiple of ``align`` elements (see [Note: shard layout]).
    Row granularity takes equal chunks while they pad by at most
    ``total / EVEN_PADDING`` or one row (the group's longest, aligned) per
    rank, else uneven pieces; ``even`` forces one (True: equal, False: uneven).

    ``before``: the elements each rank already holds in earlier groups over the
    same ranks (in this group's element size), which uneven pieces even out
    (None: nothing). Raises ValueError for another granularity, or a
    ``before`` whose length is not ``world``.
    """
    slots = tuple(slots)
    if granularity == "tensor":
        chunk, offsets = _tensor_layout(slots, world, align)
        return _even(granularity, world, chunk, offsets, slots)
    if granularity != "row":
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if before is not None and len(before) != world:
        raise ValueError(f"before has {len(before)} loads for {world} ranks")
    total = sum(_ceil_to(s.numel, align) for s in slots)
    if world == 1:
        even = True  # (one rank holds everything either way)
    if even is not False:
        # equal chunks only up to the padding they may add (all of it when forced)
        row = max((math.lcm(s.row_numel, align) for s in slots if s.numel), default=align)
        limit = None if even else (total + max(total // EVEN_PADDING, world * row)) // world
        found = _row_layout(slots, world, align, limit)
        if found is not None:
            return _even(granularity, world, *found, slots)
    return _uneven(slots, world, align, before)


def _even(granularity, world, chunk, offsets, slots) -> Layout:
    return Layout(granularity, world, chunk, tuple(offsets), slots,
                  tuple(r * chunk for r in range(world + 1)), world * chunk)


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


def _row_layout(slots: tuple[Slot, ...], world: int, align: int,
                limit: int | None = None) -> tuple[int, list[int]] | None:
    """Equal chunks: (S, offsets), S searched from ``total / world`` up (by
    ``align``, later by the rows it must be a multiple of) for a valid
    ``_fill`` that fits in ``world`` chunks; None if S would exceed ``limit``."""
    total = sum(_ceil_to(s.numel, align) for s in slots)
    chunk = max(align, _ceil_to(-(-total // world), align))
    if limit is not None:
        # A parameter of more than 2·limit elements crosses two boundaries
        # (holds a whole chunk) at any chunk size up to the limit, so S must be
        # a multiple of its row: when the smallest such S is past the limit, no
        # fill needs trying.
        must = math.lcm(align, *(s.row_numel for s in slots if s.numel > 2 * limit))
        if _ceil_to(chunk, must) > max(limit, align):
            return None
    tries = 0
    while limit is None or chunk <= max(limit, align):
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
    return None


class _Cuts:
    """The positions an uneven boundary may take in a row group whose
    parameters lie end to end in ``order`` (see ``_uneven``): inside a
    parameter, an aligned row boundary before its end; a parameter's start;
    the end of the last one."""

    def __init__(self, slots: tuple[Slot, ...], order: list[int], align: int):
        self.offsets = [0] * len(slots)
        starts, steps, ends, pos = [], [], [], 0
        for i in order:
            s = slots[i]
            pos = _ceil_to(pos, align)
            self.offsets[i] = pos
            if s.numel:
                starts.append(pos)
                ends.append(pos + s.numel)
                steps.append(math.lcm(s.row_numel, align))  # rows at aligned offsets
            pos += s.numel
        self.end, self.align = pos, align
        self.starts, self.steps, self.ends = starts, steps, ends
        self.nxt = starts[1:] + [pos]
        self.max_step = max(steps, default=align)

    def floor(self, x: int) -> int:
        """The largest allowed position <= ``x``."""
        if not self.starts:
            return 0
        if x >= self.end:
            return self.end
        i = bisect.bisect_right(self.starts, x) - 1
        if i < 0:
            return 0
        st, k = self.starts[i], self.steps[i]
        return st + min((x - st) // k, (self.ends[i] - st - 1) // k) * k

    def ceil(self, x: int) -> int:
        """The smallest allowed position >= ``x``."""
        if x <= 0 or not self.starts:
            return 0 if x <= 0 else self.end
        if x >= self.end:
            return self.end
        i = bisect.bisect_right(self.starts, x) - 1
        st, k = self.starts[i], self.steps[i]
        m = -(-(x - st) // k)
        return st + m * k if st + m * k < self.ends[i] else self.nxt[i]

    def pieces_needed(self, limit: int, world: int) -> bool:
        """Whether ``world`` pieces of at most ``limit`` elements, cut at
        allowed positions, cover the group (greedy: each as long as it may be)."""
        at = 0
        for _ in range(world):
            if at + limit >= self.end:
                return True
            nxt = self.floor(at + limit)
            if nxt <= at:
                return False
            at = nxt
        return at >= self.end

    def smallest_limit(self, world: int) -> int:
        """The smallest largest piece over ``world`` ranks (a binary search
        from the even share)."""
        lo = max(1, -(-self.end // world))
        hi = lo + self.max_step + self.align
        while not self.pieces_needed(hi, world):
            hi *= 2
        while lo < hi:
            mid = (lo + hi) // 2
            if self.pieces_needed(mid, world):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def bounds(self, limit: int, world: int, loads: Sequence[int],
               held: Sequence[int] | None = None) -> list[int]:
        """Every rank's boundary (see ``_uneven``): nearest its target, within
        what keeps each piece, this one and those after it, within ``limit``
        (less what rank r holds already in this group, ``held[r]``: two lanes)."""
        room = [limit - (held[r] if held is not None else 0) for r in range(world)]
        least = [0] * (world + 1)  # the smallest boundary from which the rest still fits
        least[world] = self.end
        for r in range(world - 1, 0, -1):
            least[r] = self.ceil(least[r + 1] - room[r])
        prefix = [0]
        for r, b in enumerate(loads):
            prefix.append(prefix[-1] + b + (held[r] if held is not None else 0))
        grand = prefix[-1] + self.end
        bounds = [0]
        for r in range(1, world):
            low, high = max(least[r], bounds[-1]), self.floor(bounds[-1] + room[r - 1])
            t = min(max(r * grand // world - prefix[r], low), high)
            down, up = self.floor(t), self.ceil(t)
            down = down if down >= low else low
            up = up if up <= high else high
            bounds.append(down if t - down <= up - t else up)
        bounds.append(self.end)
        return bounds


def _uneven(slots: tuple[Slot, ...], world: int, align: int,
            before: Sequence[int] | None) -> Layout:
    """Uneven pieces (see [Note: shard layout]). First the smallest largest
    piece ``S`` (the equal-size collective pads every piece to it: [Note:
    padded collectives] in _collectives.py); then the parameters' order in
    the flat (a rotation of their registration order) and the boundaries
    that even out the ranks' loads: each boundary at the allowed position
    nearest its target, ``r·(Σbefore + T)/W`` minus what ranks ``< r`` hold
    already, among those that keep every piece within ``S``. The rotation
    with the smallest largest load wins (ties: the smaller sum of squares,
    then the first; the first within a row of the even share is taken
    without trying the others); where one
    parameter's rows are coarse, rotating moves its pieces, which are
    shorter than ``S``, onto other ranks from one group to the next."""
    cuts = _Cuts(slots, list(range(len(slots))), align)
    limit = cuts.smallest_limit(world)
    if world >= LANES_FROM and limit * LANES_OVER > (cuts.end // world) * (LANES_OVER + 1):
        lanes = _two_lanes(slots, world, align, limit, before)
        if lanes is not None:
            return lanes
    loads = list(before) if before is not None else [0] * world
    best = None
    n = len(slots)
    for shift in range(n if before is not None and any(loads) else 1):
        order = list(range(shift, n)) + list(range(shift))
        c = cuts if shift == 0 else _Cuts(slots, order, align)
        if c.end != cuts.end or not c.pieces_needed(limit, world):
            continue
        bounds = c.bounds(limit, world, loads)
        new = [loads[r] + bounds[r + 1] - bounds[r] for r in range(world)]
        score = (max(new), sum(x * x for x in new))
        if best is None or score < best[0]:
            best = (score, c, bounds)
        if score[0] <= (sum(loads) + c.end) // world + c.max_step:
            break  # within a row of the even share: no rotation can do much better
    assert best is not None  # (rotation 0 always fits the limit it was searched for)
    _, c, bounds = best
    chunk = max(b - a for a, b in zip(bounds, bounds[1:]))
    numel = max(_ceil_to(c.end, world * align), world * align)
    return Layout("row", world, chunk, tuple(c.offsets), slots, tuple(bounds), numel)


# Two lanes are tried from LANES_FROM ranks on (where the coarse rows matter:
# a share of a few rows), where one lane's largest piece is over the even
# share by more than 1/LANES_OVER, and kept where their largest piece is
# smaller by more than 1/LANES_BETTER of the share. (Tests lower LANES_FROM.)
LANES_FROM = 64
LANES_OVER = 33
LANES_BETTER = 100


def _two_lanes(slots: tuple[Slot, ...], world: int, align: int, chunk: int,
               before: Sequence[int] | None) -> Layout | None:
    """[Note: lanes] Whole rows of a coarse parameter (rows of many elements
    against the share) leave the pieces inside it short of the share and every
    other piece over it. Two lanes: the parameters with the coarsest rows
    (lane A, first in the flat) and the rest (lane B), each cut at row
    boundaries in rank order, as one lane is; every rank holds a piece of
    each, A's then B's in its shard, so a rank short of the share in A takes
    rows of B. Greedy (``_fill_lanes``): rank by rank, at most ``alpha``
    elements of A, then as much of B as the largest piece ``L`` allows; ``L``
    by binary search for each ``alpha`` (a multiple of A's row, up to
    ``chunk``), the smallest kept (``_search_lanes``). The ranks holding A's
    pieces (the fuller ones) start where ``before`` (the earlier groups'
    loads) is least. None: no split into two lanes, or none better than
    ``chunk`` (one lane's largest piece) by more than 1/LANES_BETTER of the share."""
    found = _search_lanes(slots, world, align, chunk)
    if found is None:
        return None
    lane_a, a, b, share, limit, alpha = found
    if (chunk - limit) * LANES_BETTER <= share:
        return None
    ba, bb = _fill_lanes(a, b, world, limit, alpha)  # type: ignore[misc]
    loads = list(before) if before is not None else [0] * world
    if any(loads):
        m = sum(1 for r in range(world) if ba[r + 1] > ba[r])  # ranks holding A
        window = sum(loads[:m])
        first, least = 0, window
        for k in range(1, world - m + 1):
            window += loads[k + m - 1] - loads[k - 1]
            if window < least:
                first, least = k, window
        moved = _fill_lanes(a, b, world, limit, alpha, first) if first else None
        if moved is not None:
            ba, bb = moved
    # B's bounds again, each nearest its target (the loads evened out), as one lane's
    held = [ba[r + 1] - ba[r] for r in range(world)]
    even = b.bounds(limit, world, loads, held)
    if all(y - x <= limit - h for x, y, h in zip(even, even[1:], held)):
        bb = even
    start_b = _ceil_to(a.end, align)
    # (A's last piece takes the alignment gap before B; the ranks after it hold none)
    ba = [start_b if x >= a.end else x for x in ba]
    lane_a_bounds = tuple(ba)
    lane_b_bounds = tuple(start_b + x for x in bb)
    offsets = [a.offsets[i] if i in lane_a else start_b + b.offsets[i] for i in range(len(slots))]
    pieces = [lane_a_bounds[r + 1] - lane_a_bounds[r] + lane_b_bounds[r + 1] - lane_b_bounds[r]
              for r in range(world)]
    numel = max(_ceil_to(start_b + b.end, world * align), world * align)
    return Layout("row", world, max(pieces), tuple(offsets), slots, lane_a_bounds, numel,
                  lanes=(lane_a_bounds, lane_b_bounds))


@functools.lru_cache(maxsize=16)  # (a model's identical blocks: one search)
def _search_lanes(slots: tuple[Slot, ...], world: int, align: int, chunk: int):
    """(lane A's indices, A's cuts, B's cuts, the share, L, alpha) of ``_two_lanes``, or
    None (one lane or none better than ``chunk``); a function of its arguments
    only (cached: the thresholds are ``_two_lanes``'s)."""
    steps = {i: math.lcm(s.row_numel, align) for i, s in enumerate(slots) if s.numel}
    coarse = max(steps.values(), default=0)
    lane_a = [i for i in steps if steps[i] == coarse]
    lane_b = [i for i in range(len(slots)) if i not in lane_a]
    if not lane_a or not any(slots[i].numel for i in lane_b):
        return None
    a, b = _Cuts(slots, lane_a, align), _Cuts(slots, lane_b, align)
    share = -(-(_ceil_to(a.end, align) + b.end) // world)
    best = None
    for alpha in range(a.max_step, chunk + 1, a.max_step):
        # (only a better L than the best so far is searched for)
        lo, hi = share, chunk if best is None else best[0] - 1
        if hi < lo or _fill_lanes(a, b, world, hi, alpha) is None:
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            if _fill_lanes(a, b, world, mid, alpha) is not None:
                hi = mid
            else:
                lo = mid + 1
        if best is None or lo < best[0]:
            best = (lo, alpha)
    if best is None:
        return None
    return lane_a, a, b, share, best[0], best[1]


def _fill_lanes(a: _Cuts, b: _Cuts, world: int, limit: int, alpha: int,
                first: int = 0) -> tuple[list[int], list[int]] | None:
    """Both lanes' bounds (each from 0 in its lane): rank by rank from rank
    0, at most ``alpha`` elements of A (none before rank ``first``), then B up
    to ``limit`` in all; None where they do not cover both lanes."""
    ba, bb = [0], [0]
    for r in range(world):
        at_a, at_b = ba[-1], bb[-1]
        na = at_a if at_a >= a.end or r < first else a.floor(at_a + min(alpha, limit))
        nb = at_b if at_b >= b.end else max(at_b, b.floor(at_b + limit - (na - at_a)))
        ba.append(na)
        bb.append(nb)
    return (ba, bb) if ba[-1] >= a.end and bb[-1] >= b.end else None


def _tensor_layout(slots: tuple[Slot, ...], world: int, align: int) -> tuple[int, list[int]]:
    """(S, offsets): largest first to the least-loaded rank (ties: the lower),
    in slot order inside each chunk; S is the largest load."""
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


def chunked(slot: Slot, world: int) -> Layout:
    """One parameter laid out as FSDP2 shards it (``torch.chunk`` on dim 0):
    rank r holds rows ``[min(r·c, R), min((r+1)·c, R))``, ``c = ceil(R / W)``,
    so the last ranks may hold fewer rows or none. For a parameter whose class
    defines FSDP2's all-gather extension (_extension.py): the rows a subclass
    sees on each rank, and the global shape its DTensor shows, are then
    FSDP2's. Equal chunks when ``W`` divides ``R``, else uneven pieces; no
    alignment padding (the parameter is alone in its group, starting at 0)."""
    c = -(-slot.rows // world)
    bounds = tuple(min(r * c, slot.rows) * slot.row_numel for r in range(world + 1))
    return Layout("row", world, c * slot.row_numel, (0,), (slot,), bounds, slot.numel)
