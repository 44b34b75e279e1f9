"""The planner's model of a run: what fully_shard built, per-rank bytes, and the step's schedule.

``tools.plan`` shards the model on the meta device over torch's fake process
group (rank 0 of N), so the flat groups, their layouts and the units are the
library's own; nothing here re-derives a layout. What this module adds:

- ``describe``: the units and groups of a sharded model, as plain data
  (``UnitInfo`` / ``GroupInfo``), each group keeping its ``_layout.Layout``,
  which places every rank's pieces (not only this rank's);
- ``rank_bytes``: for every rank, the bytes of its shards, its gradient
  shards after a backward and its optimizer state after a step;
- ``Step``: one training step of the schedule (_unit.py, _state.py and its parts) replayed
  on sizes: which flat buffers are allocated at each schedule event
  (``record_schedule``'s events), and the collectives issued.

[Note: planner schedule]
``Step`` replays the library's steady-state step (the second step on: the
forward prefetches and buckets by the recorded order) for a model whose units
run once each: the root's forward first, then every block in turn, inside it.
Two facts about the model are inferred from the module tree, not run:

- forward order: the blocks in module-registration order;
- when the root's own gradients are complete: at the end of backward if the
  root owns a module registered before the first block (an input embedding:
  its gradient comes last), else right after the root's backward starts
  (a final norm / head only).

It tracks, at every schedule event, the bytes of *unsharded parameters*
(every group's unsharded flat while allocated, and post-forward shards of
``reshard_after_forward=N``) and of *unsharded gradients* (each group's flat
gradient, and the inputs of reduce-scatters in flight). The peaks over
forward events and over backward events are what the plan reports; the
tracker of ``--measure`` (tools/_measure.py) samples the same quantities at
the same events of a real run. Not counted: the copies inside an all-gather
or reduce-scatter bucket (at most the bucket size each), autograd's per-
parameter gradients before the flat gradient is assembled, activations.

The forward is recorded in the package's ``StepRecord`` and the backward
follows the package's ``BackwardPlan`` (``_backward_plan.build_plan``: gather
and reduce orders, slots, prefetch stops, reduce buckets), walked by the
package's ``PlanWalker``, as RootContext's backward does: the walker returns
the all-gathers and reduce-scatters due, and the replay performs them with
sizes (memory and collective bookkeeping) where the runtime issues them.

Two backward schedules, as in [Note: gloo backward] (fsdp_compose/_runtime/_state.py):
``"cuda"`` (NCCL: prefetch at pre-backward, reshard at post-backward, a
reduce-scatter waited when the next one launches) and ``"gloo"`` (CPU:
reshard, prefetch, then wait, once a unit's gradients are computed).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_compose._plan import _layout
from fsdp_compose._plan._backward_plan import GATHER, PlanWalker, StepRecord, build_plan
from fsdp_compose.api import CommStats
from fsdp_compose._group._grad_path import INLINE_FLAGS_BYTES

# -------------------------------------------------------------- description
@dataclass(eq=False)
class GroupInfo:
    """One flat group, as sizes."""

    numel: int               # the unsharded flat's elements (W·S with equal chunks)
    shard: int               # S: rank 0's shard (every rank's with equal chunks; see shard_of)
    itemsize: int            # the shard's (the parameters' own dtype)
    compute_itemsize: int    # the unsharded flat's (param_dtype)
    reduce_itemsize: int     # the reduce-scatter's (reduce_dtype)
    dtype: str
    compute_dtype: str
    reduce_dtype: str
    converts_grad: bool      # the reduce output is cast to the shard's dtype
    requires_grad: bool
    direct: bool             # world size 1, nothing to cast: plain leaves
    aliased: bool            # the unsharded flat is the shard (never freed)
    world: int               # shard world
    replicas: int            # HSDP replicas
    post_forward: int | None  # reshard_after_forward=N
    layout: _layout.Layout
    offload: bool = False    # CPUOffloadPolicy: shards and gradient shards in host memory
    entries: list = field(default_factory=list)  # (fqn, ndim, rows) per parameter
    pads: bool = False       # the backend pads uneven pieces to one equal-size collective

    @property
    def trainable(self) -> bool:
        return self.requires_grad and not self.direct

    @property
    def even(self) -> bool:
        """Equal chunks (else uneven pieces: padded, or on gloo alone)."""
        return self.layout.even

    @property
    def padded(self) -> bool:
        """Uneven pieces, gathered and reduced padded to ``slot``."""
        return self.pads and not self.even

    @property
    def slot(self) -> int:
        """Each rank's part of the group's collectives: its shard, or the
        largest piece (padded: [Note: padded collectives] in _collectives.py)."""
        return self.layout.chunk

    @property
    def moved(self) -> int:
        """Elements of the group's all-gather output / reduce-scatter input:
        the flat, or W·slot where padded."""
        return self.world * self.slot if self.padded else self.numel

    def shard_of(self, rank: int) -> int:
        """Elements of ``rank``'s shard."""
        return self.layout.shard_numel(rank)

    @property
    def flat_bytes(self) -> int:
        return self.numel * self.compute_itemsize

    @property
    def grad_bytes(self) -> int:
        """The flat gradient autograd assembles (compute dtype)."""
        return self.numel * self.compute_itemsize

    @property
    def reduce_bytes(self) -> int:
        """The reduce-scatter's input (reduce dtype), without used-flags."""
        return self.numel * self.reduce_itemsize

    @property
    def flags(self) -> int:
        """E: one used-flag per parameter ([Note: parameters without a
        gradient] in fsdp_compose/_group/_grad_path.py)."""
        return len(self.entries)

    @property
    def inline_width(self) -> int:
        """Elements the flags take after the shard when they ride inline: E,
        then zeros to the next 16 bytes (``GradientPath.flags_row``)."""
        align = _layout.align_elems(self.reduce_itemsize)
        return self.flags + (-(self.slot + self.flags) % align)

    @property
    def inline_flags(self) -> bool:
        """Reduced alone, its flags ride in its reduce-scatter (small groups of
        equal chunks or padded pieces)."""
        return self.reduce_bytes <= INLINE_FLAGS_BYTES and (self.even or self.padded)

    def gather_key(self) -> tuple:
        return (self.compute_dtype, self.world,
                None if self.even or self.padded else id(self))

    def bucket_key(self) -> tuple:
        return (self.reduce_dtype, self.world, self.replicas,
                None if self.even or self.padded else id(self))


@dataclass(eq=False)
class UnitInfo:
    fqn: str
    groups: list[GroupInfo]
    reshard_after_forward: bool   # as resolved at lazy init
    is_root: bool = False

    @property
    def trainable(self) -> list[GroupInfo]:
        return [g for g in self.groups if g.trainable]

    @property
    def numel(self) -> int:
        return sum(sum(s.numel for s in g.layout.slots) for g in self.groups)


def _dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


def describe(root_unit, blocks: list, padded: bool = True) -> list[UnitInfo]:
    """[root, *blocks] (forward order, see [Note: planner schedule]) as UnitInfo;
    ``root_unit`` and ``blocks`` are fsdp_compose ``Unit`` objects. ``padded``:
    uneven groups take the padded equal-size collectives (every backend but
    gloo), else gloo's in-place ones."""
    out = []
    for u in [root_unit, *blocks]:
        groups = []
        for g in u.groups:
            info = GroupInfo(
                numel=g.padded_numel, shard=g.shard_numel, itemsize=g.dtype.itemsize,
                compute_itemsize=g.compute_dtype.itemsize,
                reduce_itemsize=g.reduce_dtype.itemsize, dtype=_dtype_name(g.dtype),
                compute_dtype=_dtype_name(g.compute_dtype),
                reduce_dtype=_dtype_name(g.reduce_dtype),
                converts_grad=g.reduce_dtype != g.dtype, requires_grad=g.requires_grad,
                direct=g.direct, aliased=g.aliased, world=g.world, replicas=g.replicas,
                post_forward=g.post_forward.size if g.post_forward is not None else None,
                layout=g.layout, offload=g.offload, pads=padded,
                entries=[(e.fqn, len(e.shape), e.shape[0] if len(e.shape) else 1)
                         for e in g.entries])
            groups.append(info)
        out.append(UnitInfo(u.fqn, groups, u.resolve_reshard_after_forward(u is root_unit),
                            u is root_unit))
    return out


# ---------------------------------------------------------- per-rank bytes
def rank_pieces(layout: _layout.Layout) -> list[list[tuple[int, int]]]:
    """For every rank, ``(entry, elements)`` of each non-empty piece it holds."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(layout.world)]
    for i, s in enumerate(layout.slots):
        for r, a, b in layout.ranks_of(i):
            out[r].append((i, (b - a) * s.row_numel))
    return out


# Optimizer state per parameter that has a gradient, on every rank: (bytes per
# element of the parameter's dtype, fixed bytes). AdamW: exp_avg, exp_avg_sq
# and a float32 ``step``; SGD(momentum=0.9): one momentum buffer; Muon: one
# momentum buffer for a 2-D parameter, AdamW's state for the rest. Where a rank
# holds none of a parameter its gradient is empty and an element-wise optimizer
# keeps (empty) state for it: AdamW's ``step``; Muon does not see it (nothing).
OPTIMIZERS = ("adamw", "sgd", "muon")


def _state_bytes(optimizer: str, numel: int, itemsize: int, ndim: int) -> int:
    if optimizer == "sgd" or (optimizer == "muon" and ndim == 2):
        return numel * itemsize
    return 2 * numel * itemsize + 4


@dataclass
class RankBytes:
    params: list[int]   # per rank
    grads: list[int]
    optim: list[int]

    def total(self, r: int) -> int:
        return self.params[r] + self.grads[r] + self.optim[r]


def rank_bytes(units: list[UnitInfo], optimizer: str, grad_buffers: list[list[GroupInfo]],
               host_copies: bool = False) -> RankBytes:
    """Every rank's shard, gradient-shard and optimizer-state bytes.

    ``grad_buffers``: the groups whose gradient shards share one buffer (a
    reduce-scatter bucket's output, see ``Step``): it lives on a rank while
    any of them holds a piece there. Direct groups (world size 1) get
    autograd's own ``p.grad``, one tensor per parameter. ``host_copies``
    (the CUDA schedule): an offloaded group's gradient shard is its own copy
    in host memory (``StreamManager.to_host``: the shard, no used-flags); on
    gloo it stays a view of the reduce-scatter's output.
    """
    world = max((g.layout.world for u in units for g in u.groups), default=1)
    params, grads, optim = [0] * world, [0] * world, [0] * world
    holds: dict[int, list[bool]] = {}
    for u in units:
        for g in u.groups:
            pieces = rank_pieces(g.layout)
            holds[id(g)] = [bool(p) for p in pieces]
            for r in range(world):
                params[r] += g.shard_of(r) * g.itemsize
                if not g.requires_grad:
                    continue
                held = dict(pieces[r])
                for i, (_, ndim, _) in enumerate(g.entries):
                    optim[r] += _state_bytes(optimizer, held.get(i, 0), g.itemsize, ndim)
                if g.direct:
                    grads[r] += sum(n for _, n in pieces[r]) * g.itemsize
    for buf in grad_buffers:
        if host_copies and all(g.offload for g in buf):
            for g in buf:
                for r in range(world):
                    grads[r] += g.shard * g.itemsize if holds[id(g)][r] else 0
            continue
        # a reduce-scatter with the flags inline outputs each group's shard
        # followed by its E flags; p.grad views keep that whole buffer alive
        inline = buf[0].world > 1 and (len(buf) > 1 or buf[0].inline_flags)
        if len(buf) == 1 or buf[0].converts_grad:  # one buffer per group
            for g in buf:
                flags = g.inline_width if inline and not g.converts_grad else 0
                item = g.itemsize if g.converts_grad else g.reduce_itemsize
                for r in range(world):
                    grads[r] += (g.shard_of(r) + flags) * item if holds[id(g)][r] else 0
            continue
        size = sum(g.slot + (g.inline_width if inline else 0) for g in buf) \
            * buf[0].reduce_itemsize
        for r in range(world):
            grads[r] += size if any(holds[id(g)][r] for g in buf) else 0
    return RankBytes(params, grads, optim)


# ---------------------------------------------------------------- the step
_SHARDED, _UNSHARDED, _PARTIAL = "sharded", "unsharded", "partial"


class Step:
    """One steady-state training step replayed on sizes (see the Note).

    After ``run()``: ``events`` is ``[(event, unit fqn, phase, param bytes,
    grad bytes)]`` at every schedule event, ``comm`` the collectives, and
    ``grad_buffers`` the groups sharing each gradient-shard buffer.
    """

    def __init__(self, units: list[UnitInfo], *, schedule: str, prefetch_depth: int = 1,
                 gather_bucket_bytes: int = 1 << 20, reduce_bucket_bytes: int = 1 << 20,
                 overlap_reduce_scatter: bool = True, root_grads_last: bool = True):
        if schedule not in ("cuda", "gloo"):
            raise ValueError(f"schedule must be 'cuda' or 'gloo', got {schedule!r}")
        self.units = units
        self.root = units[0]
        self.gloo = schedule == "gloo"
        self.depth = prefetch_depth
        self.ag_limit, self.rs_limit = gather_bucket_bytes, reduce_bucket_bytes
        self.overlap = overlap_reduce_scatter
        self.root_grads_last = root_grads_last
        self.communicates = any(g.world > 1 for u in units for g in u.groups)
        self.state = {id(g): _SHARDED for u in units for g in u.groups}
        self.pf = set()                      # groups holding a post-forward shard
        self.lazy: set[int] = set()          # gathered in a bucket, flat not yet allocated
        self.ag_held: dict[str, list] = {}   # gloo: compute dtype -> groups of the kept buffer
        self.flat_grad: dict[int, int] = {}  # group -> flat gradient bytes
        self.in_flight: list[tuple[list[GroupInfo], int]] = []  # (groups, input bytes)
        self.comm = CommStats()  # the same counters comm_stats() reports
        self.gathers: dict[int, int] = {}  # group -> all-gathers of it per step
        self.shard_all_reduces: dict[int, tuple] = {}  # group -> (it, HSDP all-reduces)
        self.events: list[tuple] = []
        self.grad_buffers: list[list[GroupInfo]] = []
        self.phase = "forward"

    # ------------------------------------------------------------ memory
    def param_bytes(self) -> int:
        n = 0
        for u in self.units:
            for g in u.groups:
                if g.aliased:
                    continue
                if self.state[id(g)] == _UNSHARDED and id(g) not in self.lazy:
                    n += g.flat_bytes
                if id(g) in self.pf:
                    n += g.flat_bytes // g.post_forward
        return n

    def grad_bytes(self) -> int:
        return sum(self.flat_grad.values()) + sum(b for _, b in self.in_flight)

    def _event(self, name: str, unit: UnitInfo) -> None:
        self.events.append((name, unit.fqn, self.phase, self.param_bytes(), self.grad_bytes()))

    def all_reduce_bytes_of(self, rank: int) -> int:
        """``comm.all_reduce_bytes`` (rank 0's) as ``rank`` counts them: with
        uneven pieces, HSDP all-reduces each rank's own shard."""
        return self.comm.all_reduce_bytes + sum(
            n * (g.shard_of(rank) - g.shard) * g.reduce_itemsize
            for g, n in self.shard_all_reduces.values())

    def peaks(self) -> dict:
        fwd = [p + g for e, _, ph, p, g in self.events if ph == "forward"]
        bwd = [p + g for e, _, ph, p, g in self.events if ph == "backward"]
        return {"forward": max(fwd, default=0), "backward": max(bwd, default=0)}

    # ------------------------------------------------------ unshard/reshard
    def _is_unsharded(self, u: UnitInfo) -> bool:
        return any(self.state[id(g)] != _SHARDED for g in u.groups)

    def _gather_bytes(self, u: UnitInfo) -> int | None:
        if not u.groups or any(self.state[id(g)] != _SHARDED or g.world == 1 or g.aliased
                               for g in u.groups):
            return None
        return sum(g.flat_bytes for g in u.groups)

    def _count_gather(self, groups: list[GroupInfo]) -> None:
        self.comm.all_gather_calls += 1
        self.comm.all_gather_bytes += sum(g.moved * g.compute_itemsize for g in groups)
        for g in groups:
            self.gathers[id(g)] = self.gathers.get(id(g), 0) + 1

    def _unshard(self, u: UnitInfo, order: list[UnitInfo] | None) -> None:
        """RootContext.gather: a bucket (RootContext._bucket), else a bucket of one."""
        if self.ag_limit > 0 and self.communicates and order is not None and u in order:
            run, total = [], 0
            for v in order[order.index(u):]:
                nb = self._gather_bytes(v)
                if nb is None or (run and total + nb > self.ag_limit):
                    break
                run.append(v)
                total += nb
            if len(run) >= 2:
                by_key: dict[tuple, list] = {}
                for v in run:
                    self._event("all_gather", v)
                    for g in v.groups:
                        by_key.setdefault(g.gather_key(), []).append(g)
                for groups in by_key.values():
                    self._count_gather(groups)
                    if len(groups) >= 2:  # _flat_group.gather_bucket: flats made at use
                        self._bucket_gathered(groups)
                    for g in groups:
                        self.state[id(g)] = _UNSHARDED
                return
        issued = False
        for g in u.groups:
            st = self.state[id(g)]
            issued |= g.world > 1 and st in (_SHARDED, _PARTIAL)
            if st == _UNSHARDED:
                continue
            if st == _PARTIAL or (not g.aliased and g.world > 1):
                self._count_gather([g])
            self.state[id(g)] = _UNSHARDED  # (the post-forward shard lives until the wait)
        if issued:
            self._event("all_gather", u)

    def _bucket_gathered(self, groups: list[GroupInfo]) -> None:
        """A bucket's flats are allocated when each group waits; on gloo the
        previous bucket of the dtype is flushed first (its kept buffer is
        reused: see [Note: bucket buffers] in fsdp_compose/_comm/_streams.py)."""
        if self.gloo:
            for g in self.ag_held.pop(groups[0].compute_dtype, []):
                self.lazy.discard(id(g))
            self.ag_held[groups[0].compute_dtype] = groups
        self.lazy.update(id(g) for g in groups)

    def _wait(self, u: UnitInfo) -> None:
        for g in u.groups:
            self.pf.discard(id(g))
            self.lazy.discard(id(g))

    def _reshard_group(self, g: GroupInfo, to_post_forward: bool = False) -> None:
        st = self.state[id(g)]
        if st == _SHARDED:
            return
        self.pf.discard(id(g))  # (_complete_gather)
        self.lazy.discard(id(g))
        if st == _PARTIAL:
            if not to_post_forward:
                self.state[id(g)] = _SHARDED
            return
        if to_post_forward and g.post_forward is not None and not g.aliased:
            self.pf.add(id(g))
            self.state[id(g)] = _PARTIAL
            return
        self.state[id(g)] = _SHARDED

    def _reshard(self, u: UnitInfo, to_post_forward: bool = False) -> None:
        if self._is_unsharded(u):
            self._event("reshard", u)
        for g in u.groups:
            self._reshard_group(g, to_post_forward)

    # ------------------------------------------------------------ forward
    def forward(self) -> None:
        self.phase = "forward"
        self.record = StepRecord()  # the package's, as RootContext keeps it
        self._pre_forward(self.root)
        for u in self.units[1:]:
            self._pre_forward(u)
            self._post_forward(u)
        self._post_forward(self.root)

    def _pre_forward(self, u: UnitInfo) -> None:
        self._event("pre_forward", u)
        self.record.record_pre(u)
        self._unshard(u, self.units)
        i = self.units.index(u)
        for v in self.units[i + 1:i + 1 + self.depth]:
            if not self._is_unsharded(v):
                self._event("prefetch", v)
                self._unshard(v, self.units)
        self._wait(u)

    def _post_forward(self, u: UnitInfo) -> None:
        self._event("post_forward", u)
        self.record.expect_backward(u)
        if u.reshard_after_forward:
            self._reshard(u, to_post_forward=True)

    # ----------------------------------------------------------- backward
    def backward(self) -> None:
        self.phase = "backward"
        # the package's plan of this backward (_backward_plan.build_plan)
        self.plan = build_plan(self.record, prefetch_depth=self.depth,
                               reduces=lambda u: bool(u.trainable),
                               grad_bytes=lambda u: sum(g.reduce_bytes for g in u.trainable),
                               bucket_bytes=self.rs_limit)
        self.G = list(self.plan.gather_order)
        self.walker = PlanWalker(self.plan, bucketed=self.rs_limit > 0 and self.communicates)
        # A unit whose flat aliases its shard (world size 1) keeps the split
        # node made at fully_shard time: the engine runs it after the rest of
        # backward, latest-made (the root) first (see RootContext._refresh_views).
        late = [u for u in [self.root, *reversed(self.units[1:])]
                if u.trainable and all(g.aliased for g in u.trainable)]
        root = self.root
        self._pre_backward(root)
        if not self.root_grads_last and root not in late:
            self._unit_grads(root)
        for u in reversed(self.units[1:]):
            self._pre_backward(u)
            if u not in late:
                self._unit_grads(u)
        if self.root_grads_last and root not in late:
            self._unit_grads(root)
        for u in late:
            self._unit_grads(u)
        self._final()

    def _hooked(self, u: UnitInfo) -> bool:
        """Its gradients run RootContext.grads_computed (gloo, a group with world > 1)."""
        return self.gloo and any(g.world > 1 for g in u.trainable)

    def _pre_backward(self, u: UnitInfo) -> None:
        self._event("pre_backward", u)
        if self.record.expects_backward(u):
            late = self._hooked(u) and u.reshard_after_forward
            self._gather_up_to(self.plan.stop(u, prefetch=not late))
        self._unshard(u, self.G)
        self._wait(u)

    def _gather_up_to(self, stop: int, final: bool = False) -> None:
        # (every unit gets a gradient here: no zero-filled demand, gets_grad None)
        self._perform(self.walker.up_to(stop, final=final))

    def _perform(self, steps: list[tuple]) -> None:
        """The walker's steps, as RootContext._perform does them."""
        for step in steps:
            if step[0] is GATHER:
                self._unshard(step[1], self.G)
            else:
                self._launch(step[1], bucketed=step[2])

    def _unit_grads(self, u: UnitInfo) -> None:
        """Its parameter gradients are computed, assembled, accumulated."""
        for g in u.trainable:
            if self._hooked(u) and g.world > 1:  # RootContext.grads_computed
                if self.state[id(g)] != _SHARDED:
                    self._event("reshard", u)
                    self._reshard_group(g)
                self._gather_up_to(self.plan.stop(u))
                self._drain()
            self.flat_grad[id(g)] = g.grad_bytes  # the split backward's cat
        if not u.trainable:
            return
        self._event("post_backward", u)
        self._reshard(u)
        self._perform(self.walker.mark_ready(u))

    def _launch(self, units: list[UnitInfo], bucketed: bool = False) -> None:
        self._drain()
        for u in units:
            self._event("reduce_scatter", u)
        by_key: dict[tuple, list] = {}
        for u in units:
            for g in u.trainable:
                key = g.bucket_key() if bucketed or g.padded else (id(g),)
                by_key.setdefault(key, []).append(g)
        for groups in by_key.values():
            if groups[0].world == 1 or len(groups) == 1:
                parts = [[g] for g in groups]
            else:
                parts = [groups]
            for part in parts:
                nbytes = sum(g.moved * g.reduce_itemsize for g in part)
                for g in part:
                    self.flat_grad.pop(id(g), None)
                if part[0].world > 1:
                    W = part[0].world
                    self.comm.reduce_scatter_calls += 1
                    if len(part) > 1 or part[0].inline_flags:  # E flag columns per rank
                        nbytes += sum(W * g.inline_width * g.reduce_itemsize for g in part)
                        self.comm.reduce_scatter_bytes += nbytes
                    else:  # the flags' own all-reduce (fp32), next to it
                        self.comm.reduce_scatter_bytes += nbytes
                        self.comm.all_reduce_calls += 1
                        self.comm.all_reduce_bytes += part[0].flags * 4
                self.in_flight.append((part, nbytes if part[0].world > 1 else 0))
                self.grad_buffers.append(part)
        if not self.overlap:
            self._drain()

    def _drain(self) -> None:
        for part, _ in self.in_flight:
            if part[0].replicas > 1:  # one all-reduce per bucket (inline flags in it)
                inline = len(part) > 1 or part[0].inline_flags
                self.comm.all_reduce_calls += 1 if inline else 2
            for g in part:
                if g.replicas > 1:
                    n = self.shard_all_reduces.get(id(g), (g, 0))[1]
                    self.shard_all_reduces[id(g)] = (g, n + 1)
                    self.comm.all_reduce_bytes += (g.shard + (g.inline_width if inline else 0)) \
                        * g.reduce_itemsize + (0 if inline else g.flags * 4)
        self.in_flight = []

    def _final(self) -> None:
        self._event("final_callback", self.root)
        self._gather_up_to(len(self.G) - 1, final=True)
        self._drain()
        for u in self.units:
            self._reshard(u)

    def run(self) -> "Step":
        self.forward()
        self.backward()
        return self



# ------------------------------------------------------------ HSDP proposal
def _step_bytes(groups: list[GroupInfo], gathers: dict, layout_of) -> int:
    """All-gather + reduce-scatter (+ HSDP all-reduce) bytes of one step, as
    ``comm_stats()`` counts them (used-flags left out), with each group laid
    out by ``layout_of(g)`` -> (layout, replicas)."""
    total = 0
    for g in groups:
        lay, replicas = layout_of(g)
        # what the collective moves: the flat, or every piece padded to the largest
        moved = lay.world * lay.chunk if g.pads and not lay.even else lay.numel
        if lay.world > 1:
            total += gathers.get(id(g), 0) * moved * g.compute_itemsize
        if g.trainable:
            if lay.world > 1:
                total += moved * g.reduce_itemsize
            if replicas > 1:
                total += lay.shard_numel(0) * g.reduce_itemsize
    return total


def hsdp_proposal(units: list[UnitInfo], step: Step, world: int,
                  margin: float = 0.01) -> dict | None:
    """``{"shard": n, "bytes": b}`` when HSDP over shard groups of ``n`` ranks
    (``world / n`` replicas; ``n`` a power of two below ``world``) would move
    fewer bytes per step than plain FSDP over ``world`` ranks, by more than
    ``margin`` (the ``n`` that moves fewest); else None.

    Counted as ``comm_stats()`` counts them (a collective's buffer: the flat
    for all-gathers and reduce-scatters, the shard for HSDP's all-reduce), so
    what HSDP saves is padding: the layouts pad by up to about a row per rank
    ([Note: shard layout] in fsdp_compose/_plan/_layout.py), which is most of a
    rank's share once that share is a row or less. Each group is laid out
    again at ``n`` ranks by the library's own ``_layout.plan`` (groups with
    the same parameter shapes once per size: a 4096-rank 70B plan stays in
    seconds); the step's gathers per group are the replayed step's.
    """
    groups = [g for u in units for g in u.groups if g.world > 1 and not g.aliased]
    if not groups or any(g.replicas > 1 for g in groups):
        return None
    fsdp = _step_bytes(groups, step.gathers, lambda g: (g.layout, 1))
    cache: dict = {}

    def at(n):
        def layout_of(g):
            align = _layout.align_elems(min(g.itemsize, g.compute_itemsize))
            key = (g.layout.slots, align, g.layout.granularity, n)
            if key not in cache:
                cache[key] = _layout.plan(g.layout.slots, n, align, g.layout.granularity)
            return cache[key], world // n
        return layout_of

    best = None
    n = 2
    while n < world:
        if world % n == 0:
            b = _step_bytes(groups, step.gathers, at(n))
            if best is None or b < best["bytes"]:
                best = {"shard": n, "bytes": b}
        n *= 2
    if best is None or best["bytes"] >= fsdp * (1 - margin):
        return None
    best["fsdp_bytes"] = fsdp
    return best


# ------------------------------------------------------------- what NCCL sees
# (latency per collective in seconds, bus bandwidth in bytes/s): a ring moves
# (W-1)/W of an all-gather's output or a reduce-scatter's input per rank, and
# twice that for an all-reduce. The links and their defaults (NVLink within a
# node, InfiniBand NDR across nodes): tools.plan's PlanConfig.links,
# --alpha-us / --beta-gbs.


def _estimate(calls: int, ag_rs_bytes: float, ar_bytes: float, world: int,
              links: tuple) -> dict:
    ring = (world - 1) / world if world > 1 else 0.0
    return {k: calls * a + (ag_rs_bytes + 2 * ar_bytes) * ring / b for k, a, b in links}


def _fsdp2_numel(g: GroupInfo) -> int:
    """The group's parameters as FSDP2 lays them out: each padded to a
    multiple of W rows (torch.chunk on dim 0), in one all-gather per unit."""
    W = g.world
    return sum(-(-s.rows // W) * W * s.row_numel for s in g.layout.slots)


def nccl_view(units: list[UnitInfo], step: "Step", padded: bool, links: tuple) -> dict:
    """Per step: c10d calls and the NCCL operations they become, bytes,
    collective padding and an alpha-beta estimate, for our layout and for
    FSDP2's (one all-gather per unit gather, one reduce-scatter per unit
    with gradients, each parameter padded to W rows) on the same schedule;
    ``links``: the estimate's (name, latency s, bus bandwidth B/s)."""
    c = step.comm
    calls = c.all_gather_calls + c.reduce_scatter_calls + c.all_reduce_calls
    groups = [g for u in units for g in u.groups]
    world = max((g.world for g in groups), default=1)
    # the list forms uneven pieces took before: one broadcast / reduce per rank
    uneven = sum(step.gathers.get(id(g), 0) + (1 if g.trainable and g.world > 1 else 0)
                 for g in groups if not g.even and g.world > 1)
    ag_rs = c.all_gather_bytes + c.reduce_scatter_bytes
    params = sum(sum(s.numel for s in g.layout.slots) * g.itemsize for g in groups)
    moved_params = sum((step.gathers.get(id(g), 0) + (1 if g.trainable else 0))
                       * sum(s.numel for s in g.layout.slots) * g.compute_itemsize
                       for g in groups if g.world > 1 and not g.aliased)
    f2_calls = f2_bytes = f2_params = 0
    f2_rank = 0
    for u in units:
        comm = [g for g in u.groups if g.world > 1 and not g.aliased]
        if not comm:
            continue
        gathers = max(step.gathers.get(id(g), 0) for g in comm)
        f2_calls += gathers + (1 if any(g.trainable for g in comm) else 0)
        f2_bytes += gathers * sum(_fsdp2_numel(g) * g.compute_itemsize for g in comm)
        f2_bytes += sum(_fsdp2_numel(g) * g.reduce_itemsize for g in comm if g.trainable)
        f2_params += sum(_fsdp2_numel(g) * g.itemsize for g in comm)
        f2_rank += sum(_fsdp2_numel(g) // g.world * g.itemsize for g in comm)
    return {
        "collective_calls": calls,
        "nccl_ops": calls if padded else calls + (world - 1) * uneven,
        "nccl_ops_list_forms": calls + (world - 1) * uneven,
        "collective_bytes": ag_rs + c.all_reduce_bytes,
        "collective_padding_percent": 100 * (ag_rs / max(moved_params, 1) - 1),
        "est_seconds": _estimate(calls, ag_rs, c.all_reduce_bytes, world, links),
        "fsdp2": {"calls": f2_calls, "bytes": f2_bytes,
                  "padding_percent": 100 * (f2_params / max(params, 1) - 1),
                  "param_bytes": f2_rank,
                  "est_seconds": _estimate(f2_calls, f2_bytes, 0, world, links)},
    }
