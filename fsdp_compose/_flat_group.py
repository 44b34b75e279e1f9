"""One flat group: the parameters of one unit that share (dtype, requires_grad).

[Note: tensor vocabulary]
For a group on a mesh of ``W`` ranks, with ``S`` elements per rank:

- *local shard* ``shard`` (S): persistent, in the parameters' own dtype (the
  master copy), on the compute device, or on CPU with offloading. Rank r's
  chunk ``[r·S, (r+1)·S)`` of the padded flat buffer, laid out as in [Note:
  shard layout] (_layout.py): each parameter's piece on this rank is a block
  of whole dim-0 rows, and the sharded ``nn.Parameter``s the optimizer holds
  are views of it shaped ``(rows_r, *shape[1:])`` (``ParamEntry.piece``): the
  original ndim and trailing dims at every world size, the full shape at
  world size 1. Without mixed
  precision or offloading it is the all-gather *input*, as is: no copy-in.
- *unsharded flat* ``flat`` (W·S), in the *compute dtype* (``param_dtype`` of
  the unit's mixed-precision policy, else the parameters' dtype): a leaf
  tensor (``requires_grad`` when the group trains) whose storage is allocated
  on unshard and freed on reshard (``untyped_storage().resize_``), so the
  tensor and every view of it keep their identity across iterations. It is
  the all-gather *output*: no copy-out. With mixed precision or offloading,
  the shard is cast / copied in ONE pass into this rank's own chunk of
  ``flat``, and the all-gather runs in place from that chunk. At world size 1
  without either, it aliases the local shard and is never freed.
- *unsharded views*: the original parameters while unsharded, made by a
  single ``split`` of ``flat`` plus a ``view`` each. One split means one
  autograd node: backward writes ONE flat gradient (zeros for unused
  parameters and padding) into ``flat.grad`` through a single AccumulateGrad,
  whose post-accumulate hook is the group's post-backward.
  The split is re-made at every grad-enabled forward (``refresh_views``), not
  once: the autograd engine runs ready nodes in decreasing sequence number,
  so a split node created at ``fully_shard`` time would be starved until the
  whole backward is done (no reduce-scatter overlap, every unit unsharded at
  once). Made in pre-forward, it runs as soon as the unit's gradients are in.
- *flat gradient* ``flat.grad`` (W·S, compute dtype): the reduce-scatter
  *input*, as is (cast once first when ``reduce_dtype`` differs).
- *gradient shard* (S, the parameters' dtype, where the shard lives): the
  reduce-scatter output, as is when dtype and device match. ``p.grad`` of
  each sharded parameter is the matching view of it (``ParamEntry.piece``);
  only those views keep it alive, so ``zero_grad()`` frees it. At world size
  1 it is the flat gradient (a direct group has none: autograd sets p.grad).
- *post-forward shard* (W·S/N): with ``reshard_after_forward=N`` (an int),
  after forward this rank keeps its 1/N of ``flat`` (state ``PARTIAL``) and
  the backward all-gather runs within its group of N ranks.

[Note: parameters without a gradient]
The flat gradient has zeros wherever a parameter got no gradient, so it
cannot tell "no gradient" from "a zero gradient". Plain PyTorch and DDP
(``find_unused_parameters=True``) leave ``p.grad`` None for a parameter that
no rank produced a gradient for (Adam/AdamW would otherwise still move it:
momentum, weight decay), and ranks must agree on it (optimizer state, and
every later collective, depend on it). So:

- each group notes, per entry, whether this rank produced a gradient: a
  pre-hook on each split node sees None for every view that got none
  (``_before_split_backward``), OR-ed over the unit's uses and over the
  microbatches the flat gradient sums (``set_requires_gradient_sync(False)``);
- the flags travel with the reduction, so every rank learns whether any
  rank produced each gradient, whatever its own graph was: in a bucket, and
  for a flat gradient up to ``INLINE_FLAGS_BYTES``, as E more columns after
  the group's chunk in the rank-major reduce-scatter input (the same on
  every rank), so its output is the gradient shard then the flags' rank
  average (``_launch_inline``: one copy of the flat gradient); a larger
  group sends them in a tiny all-reduce (SUM, one fp32 per entry) right
  after its reduce-scatter on the same process group. With HSDP they are
  added into the partial sum and all-reduced over the replicas with the
  gradient (inline: in the same collective);
- folding: an entry no rank produced a gradient for, whose ``p.grad`` is
  None, keeps None; an entry whose sharded Parameter does not require grad
  (``requires_grad_(False)`` after fully_shard) is never touched; every other
  entry gets the rank average, as before.
A rank that produced every gradient does not read the counts (all >= 1):
on CUDA that read would be a device-to-host copy.

Layout (_layout.py): every parameter is contiguous in the unsharded flat and
starts at a multiple of ``ALIGN_BYTES`` (gap elements are padding); rank
chunks are equal (``S``), so every rank's shard starts aligned too.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import _collectives, _layout
from ._common import META_FIX, ShardedState, label, unit_error, weak_hook
from ._streams import Pending, StreamManager

ALIGN_BYTES = 16
# A flat gradient up to this size carries its used-flags in its own
# reduce-scatter (one copy, into a buffer with E more columns); a larger one
# sends them in a tiny all-reduce of their own, where that copy would cost
# more than the collective's latency (see [Note: parameters without a gradient]).
INLINE_FLAGS_BYTES = 256 << 10
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _divide_factors(total: int, reduce_dtype: torch.dtype) -> tuple[float | None, float | None]:
    """(pre, post) divisors for a SUM reduction over ``total`` ranks, or (None, None) for AVG.

    In fp16/bf16, summing W gradients then dividing can overflow (fp16) or lose
    the small ones; dividing by f before and W/f after (f a power of two near
    sqrt(W): exact scaling) keeps the partial sums in range.
    """
    if reduce_dtype not in _LOW_PRECISION or total == 1:
        return None, None
    f = 1
    while total % (2 * f) == 0 and (2 * f) * (2 * f) <= total:
        f *= 2
    return float(f), total / f


class TPSpec(NamedTuple):
    """How a tensor-parallel (DTensor) parameter is re-exposed while unsharded."""

    mesh: object          # the DTensor's DeviceMesh (e.g. mesh["tp"])
    placements: tuple
    shape: torch.Size     # its global shape
    stride: tuple


class PostForward(NamedTuple):
    """The smaller group a unit reshards to after forward (reshard_after_forward=int)."""

    pg: dist.ProcessGroup
    size: int   # N ranks hold the parameters between forward and backward
    rank: int   # this rank's index in it


@dataclass
class ParamEntry:
    """One unique original parameter inside a flat group."""

    fqn: str                        # name relative to the outermost fully_shard'd module
    shape: torch.Size
    offset: int                     # start in the unsharded flat buffer (contiguous there)
    slots: list                     # [(module, attr_name)] that hold this parameter
    rows: tuple[int, int]           # the dim-0 rows this rank holds ((0, 0): none)
    local_range: tuple[int, int]    # the same, as a slice of param.flatten()
    shard_range: tuple[int, int]    # the same elements' place in the local shard
    whole: bool                     # this rank's piece is all of it (see holds_whole)
    sharded: nn.Parameter = None    # view of the local shard, shaped ``piece_shape``
    unsharded: torch.Tensor = None  # full-shape view of the unsharded flat buffer
    tp: TPSpec | None = None        # a DTensor parameter: ``shape`` is its local TP shard's

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def piece_shape(self) -> torch.Size:
        """``(rows_r, *shape[1:])``; a 0-d parameter's piece is 1-D (1 or 0
        elements: a 0-d tensor cannot be empty), see docs/design.md."""
        if not self.shape:
            return torch.Size((self.local_range[1] - self.local_range[0],))
        return torch.Size((self.rows[1] - self.rows[0],) + tuple(self.shape[1:]))

    def piece(self, buf: torch.Tensor) -> torch.Tensor:
        """Its part of a shard-sized ``buf``, shaped like ``sharded``."""
        return buf[slice(*self.shard_range)].view(self.piece_shape)

    def holds_whole(self) -> bool:
        """This rank's piece is the whole parameter, or the group does not
        shard (world size 1). Never for a DTensor parameter whose placements
        are not all ``Replicate``: the flat group holds its local TP shard."""
        return self.whole

    def is_empty(self) -> bool:
        """This rank's piece has 0 rows."""
        return self.rows[1] == self.rows[0]

    def held_elsewhere(self) -> bool:
        """This rank holds none of it and another rank holds it: ``p.grad``
        stays None here (see [Note: empty pieces])."""
        return self.is_empty() and not self.whole


def _entries(params: list, locals_: list, layout: _layout.Layout, rank: int) -> list[ParamEntry]:
    """This rank's ParamEntry of every parameter, from the group's layout."""
    S = layout.chunk
    entries = []
    for i, ((p, slots, fqn), local) in enumerate(zip(params, locals_)):
        a, b = layout.rows_on(i, rank)
        k, off = layout.slots[i].row_numel, layout.offsets[i]
        start = off + a * k - rank * S  # in the shard
        tp = (TPSpec(p.device_mesh, tuple(p.placements), p.shape, p.stride())
              if isinstance(p, DTensor) else None)
        # (a DTensor that TP does not replicate is never whole here: its piece
        # is at most its local TP shard)
        whole = ((layout.world == 1 or b - a == layout.slots[i].rows)
                 and (tp is None or all(pl.is_replicate() for pl in tp.placements)))
        entries.append(ParamEntry(fqn, local.shape, off, slots, (a, b), (a * k, b * k),
                                  (start, start + (b - a) * k) if b > a else (0, 0), whole, tp=tp))
    return entries


def _split_plan(layout: _layout.Layout) -> tuple[list[int], list[int]]:
    """The unsharded flat split into the parameters (in flat order) and the
    padding between them: (split sizes, index of each parameter's piece). One
    split, one view per parameter (see ``refresh_views``)."""
    sizes, view_at, at = [], [0] * len(layout.slots), 0
    for i in sorted(range(len(layout.slots)), key=layout.offsets.__getitem__):
        if layout.offsets[i] > at:
            sizes.append(layout.offsets[i] - at)  # padding
        view_at[i] = len(sizes)
        sizes.append(layout.slots[i].numel)
        at = layout.offsets[i] + layout.slots[i].numel
    if layout.numel > at:
        sizes.append(layout.numel - at)  # tail padding
    return sizes, view_at


@dataclass
class _GradLaunch:
    """A reduce-scatter in flight, and how to fold its output into p.grad."""

    group: "FlatGroup"
    streams: StreamManager
    pending: Pending | None  # wait() gives the reduced output
    used: "_UsedFlags"   # per entry: did this rank, and how many ranks, produce a gradient
    post_divide: float | None = None
    span: tuple[int, int] | None = None  # this group's part of a bucket's output
    bucket: torch.Tensor | None = None   # the input, from streams.bucket (released once waited)
    done: bool = field(default=False)
    folded: bool = field(default=False)

    def fold(self, out: torch.Tensor) -> None:
        self.folded = True
        if self.span is not None:
            out = out[self.span[0]:self.span[1]]
        self.group._finish_reduce(out, self.used, self.post_divide, self.streams)

    def finish(self) -> None:
        if not self.done:
            out = self.pending.wait()
            if self.bucket is not None:
                self.streams.release(self.bucket)
                self.bucket = None
            self.done = True
            if not self.folded:
                self.fold(out)
            self.used.release()


def _fold_all(launches: list[_GradLaunch]):
    """The post-reduce of a reduce-scatter shared by ``launches``: on CUDA the
    stream manager runs it at once on a side stream (see [Note: post-reduce]
    in _streams.py); on gloo each launch folds at ``finish``."""
    def fold(out: torch.Tensor) -> None:
        for launch in launches:
            launch.fold(out)
    return fold


class _UsedFlags:
    """Per entry of one group: whether this rank produced a gradient
    (``local``), and what the reduction made of the flags: the E elements
    after the gradient shard in the reduce-scatter output (``inline``), or
    ``counts``, all-reduced by ``pending`` (None at world size 1)."""

    def __init__(self, local: list[bool], inline: bool = False, pending: Pending | None = None,
                 counts: torch.Tensor | None = None):
        self.local, self.inline, self._pending, self.counts = local, inline, pending, counts

    def wait(self) -> None:
        """Order the caller (the post-reduce: on CUDA a side stream) after the
        flags' all-reduce."""
        if self._pending is not None:
            self._pending.wait()

    def release(self) -> None:
        """The compute stream waits too, then the flags' buffer may go (see
        [Note: side streams] in _streams.py: every collective is waited by the
        stream that allocated its tensors)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def any_rank(self, trains) -> list[bool] | None:
        """Per entry: did any rank produce a gradient (> 0: a sum or an
        average); None: every entry that ``trains`` did here, nothing to read."""
        if all(u or not t for u, t in zip(self.local, trains)):
            return None
        if self.counts is None:
            return self.local
        return [c > 0 for c in self.counts.tolist()]


def _flags_tensor(flags: list[bool], device: torch.device,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    t = torch.tensor(flags, dtype=dtype)
    if device.type == "cuda":  # no sync: from pinned memory, on the current stream
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class FlatGroup:
    def __init__(self, unit_fqn: str, params: list, *, device: torch.device,
                 world: int, rank: int, pg, rs_pg,
                 param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None,
                 offload: bool = False, pin_memory: bool = True,
                 replicate_pg=None, post_forward: PostForward | None = None,
                 granularity: str = "row"):
        # params: [(param, [(module, name), ...], rel_fqn)] in registration order
        first = params[0][0]
        # any entry trains (its sharded Parameter requires grad), see sync_requires_grad
        self.requires_grad: bool = first.requires_grad
        self._trains: tuple[bool, ...] = (first.requires_grad,) * len(params)
        self.world, self.rank = world, rank
        self.pg, self.rs_pg = pg, rs_pg  # all-gathers / reduce-scatters, see _state.py
        self.replicate_pg = replicate_pg  # HSDP: gradient shards are all-reduced over it
        self.replicas = dist.get_world_size(replicate_pg) if replicate_pg is not None else 1
        self.requires_all_reduce = True   # HSDP: False keeps a partial sum, no all-reduce
        self.post_forward = post_forward
        self.offload, self.pin_memory = offload, pin_memory
        self.mesh_device = device  # where fully_shard put it (the flat's device with offload)
        self._policy_dtypes = (param_dtype, reduce_dtype)  # the unit's mp_policy, or Nones
        self._set_dtype(first.dtype)
        self.unit_fqn = unit_fqn
        self.state = ShardedState.SHARDED
        self._views_installed = False  # the modules hold the full-shape views

        itemsize = min(first.element_size(), self.compute_dtype.itemsize)
        align = max(1, ALIGN_BYTES // itemsize)
        locals_ = [p.to_local() if isinstance(p, DTensor) else p for p, _, _ in params]
        self.layout = layout = _layout.plan(
            [_layout.Slot(t.shape[0] if t.dim() else 1, math.prod(t.shape[1:]))
             for t in locals_], world, align, granularity)
        self.granularity = granularity
        self.padded_numel = layout.numel
        self.shard_numel = layout.chunk
        self.entries: list[ParamEntry] = _entries(params, locals_, layout, rank)
        self._split_sizes, self._view_at = _split_plan(layout)
        # [Note: world size 1] Every rank holds every element, so a sharded
        # Parameter's piece is the whole parameter, in its own shape (a 0-dim
        # one is 1-D: see ``piece_shape``). When there is also nothing to
        # cast, reduce (HSDP) or re-expose (DTensor), the group is *direct*:
        # the Parameters are then full-shape leaves over the shard with their own
        # AccumulateGrad (plain PyTorch's backward): no views to swap, no flat
        # gradient, no hooks (see Unit.passive). Not for 0-dim parameters: their
        # piece is 1-D (a 0-dim exp_avg would look like a replicated scalar
        # such as ``step`` in optimizer state), so it cannot be the leaf itself.
        self.direct = self._can_be_direct()

        self._grad_hook = None
        self._hooked_flat = None   # the flat tensor the grad hook is registered on
        self._views_stale = False  # sync_requires_grad changed what the views must be
        self._used = [False] * len(self.entries)  # see [Note: parameters without a gradient]
        self._flags_row: tuple | None = None  # (flags, their tensor): read-only, reused
        # called by the split node's pre-hook after the used-flags (set by the unit, gloo)
        self.on_grads_computed = None
        self._split_prehook = weak_hook(self, "_before_split_backward")
        self._allocate(torch.device("meta") if locals_[0].is_meta else device)
        with torch.no_grad():
            for e, (p, _, _), local in zip(self.entries, params, locals_):
                e.sharded.__dict__.update(p.__dict__)  # user attributes survive
                if not local.is_meta and e.local_range[1] > e.local_range[0]:
                    src = local.detach().reshape(-1)[slice(*e.local_range)]
                    self.shard[slice(*e.shard_range)].copy_(src)

        self._pending: Pending | None = None
        self._pf_shard: torch.Tensor | None = None   # post-forward shard (PARTIAL)
        self._unsynced: torch.Tensor | None = None   # accumulated flat grad in reduce dtype
        self._partial: tuple | None = None  # HSDP: (reduce-scattered, flags), not all-reduced
        self.unsharded_version = -1                  # shard._version when last gathered

    def _set_dtype(self, dtype: torch.dtype) -> None:
        """The shard's dtype (the master copy) and what follows from it."""
        param_dtype, reduce_dtype = self._policy_dtypes
        self.dtype = dtype
        floating = dtype.is_floating_point
        self.compute_dtype = param_dtype if (param_dtype and floating) else dtype
        self.reduce_dtype = reduce_dtype if (reduce_dtype and floating) else self.compute_dtype
        # one pass (cast and/or host-to-device) into flat's own chunk before the all-gather
        self._copies_in = self.compute_dtype != dtype or self.offload

    def _can_be_direct(self) -> bool:
        """See [Note: world size 1]."""
        return (self.world == 1 and all(e.tp is None and len(e.shape) > 0 for e in self.entries)
                and self.replicas == 1 and not self._copies_in and self.reduce_dtype == self.dtype
                and self.post_forward is None)

    # ------------------------------------------------------------- storage
    def _allocate(self, device: torch.device, params: list | None = None) -> None:
        """(Re)create the shard, the sharded Parameters and the unsharded flat on ``device``.

        ``params``: keep these Parameter objects (one per entry) as the sharded
        Parameters: their values are copied into the new shard, then their
        ``.data`` becomes their piece of it (see ``adopt_params``).
        """
        self.device = device
        meta = device.type == "meta"
        self.shard_device = torch.device("cpu") if self.offload and not meta else device
        shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.shard_device)
        if self.offload and self.pin_memory and not meta and torch.cuda.is_available():
            shard = shard.pin_memory()
        self.shard = shard
        for i, (e, trains) in enumerate(zip(self.entries, self._trains)):
            if params is None:
                e.sharded = nn.Parameter(e.piece(shard), requires_grad=trains)
                continue
            p = params[i]
            with torch.no_grad():
                if not meta and not p.is_meta and e.shard_range[1] > e.shard_range[0]:
                    shard[slice(*e.shard_range)].copy_(p.detach().reshape(-1))
                p.data = e.piece(shard)
            e.sharded = p
        self._aliased = self.world == 1 and not self._copies_in
        if self._aliased:
            self.flat = shard.data  # alias, own version counter; never freed
        else:
            self.flat = torch.empty(self.padded_numel, dtype=self.compute_dtype, device=device)
        self.flat.requires_grad_(self.requires_grad and not self.direct)
        # `.data` shares storage but not the version counter: writing the
        # all-gather into it does not invalidate tensors saved for backward.
        self.flat_data = self.flat.data
        self._hook_flat()
        self.refresh_views()
        self._free_flat()

    def set_grad_hook(self, hook) -> None:
        """``hook`` runs when the flat gradient is accumulated (the post-backward);
        registered whenever the flat requires grad (see sync_requires_grad)."""
        self._grad_hook = hook
        self._hook_flat()

    def _hook_flat(self) -> None:
        if self._grad_hook is not None and self.flat.requires_grad \
                and self._hooked_flat is not self.flat:
            self.flat.register_post_accumulate_grad_hook(self._grad_hook)
            self._hooked_flat = self.flat

    def sync_requires_grad(self) -> bool:
        """Follow ``requires_grad_()`` called on the sharded Parameters after
        fully_shard (pre-forward, every rank alike). A frozen entry's view is
        detached from the flat (no gradient, never folded into); a group with
        no trainable entry left stops requiring grad (no reduce-scatter), and
        starts again when one trains. Returns True when something changed."""
        trains = tuple(e.sharded.requires_grad for e in self.entries)
        if trains == self._trains:
            return False
        self._trains = trains
        self.requires_grad = any(trains)
        if not self.direct:  # (a direct group's Parameters are autograd's own leaves)
            self.flat.requires_grad_(self.requires_grad)
            self._hook_flat()
            self._views_stale = True  # re-made at the next unshard (storage needed)
        return True

    def materialize_(self, device: torch.device) -> None:
        """Give a group built on the meta device real (uninitialised) storage.

        The sharded Parameters and the flat leaf are NEW objects (a meta tensor
        cannot become a real one in place); the modules' slots are updated.
        Callers that index Parameters (the ``_SHARDED`` map) re-register them.
        """
        if self.device.type != "meta":
            raise unit_error(self.unit_fqn, "materialize_: the group is not on the meta device.")
        old = [e.sharded for e in self.entries]
        self._allocate(device)
        for e, o in zip(self.entries, old):
            e.sharded.__dict__.update(o.__dict__)
        self.install_sharded()

    def adopt_params(self, params: list) -> None:
        """``nn.Module._apply`` (a cast, a move, ``to_empty``) changed the sharded
        Parameters: their ``.data``, or the objects the modules hold (``params``,
        one per entry, all of one dtype and device). See [Note: casts after
        fully_shard] in _fully_shard.py.

        A new shard in their dtype, on their device (on CPU with offload), holds
        their values; they become views of it again. The compute and reduce
        dtypes follow the new dtype unless the unit's mp_policy fixes them; the
        unsharded flat is re-made (a new leaf: the unit registers its gradient
        hook again); whether the group is direct is decided again. The layout
        (offsets, padding, every rank's range) is kept. A gradient accumulated
        without sync is cast along, as ``_apply`` casts ``p.grad``. Only while
        SHARDED (the caller reshards first).
        """
        first = params[0]
        flat_grad = self.flat.grad
        self._set_dtype(first.dtype)
        self.direct = self._can_be_direct()
        device = first.device
        if self.offload and device.type != "meta":
            device = self.mesh_device  # the shard stays on CPU; the flat where it computes
        self._grad_hook = None
        self._allocate(device, params)
        self.install_sharded()
        self.unsharded_version = -1
        if flat_grad is not None and self.flat.requires_grad:
            self.flat.grad = flat_grad.to(self.device, self.compute_dtype)
        if self._unsynced is not None:
            self._unsynced = self._unsynced.to(self.device, self.reduce_dtype)
        if self._partial is not None:  # (HSDP: the sum and its used-flags)
            p_out, p_used = self._partial
            if p_used.counts is not None:
                p_used.counts = p_used.counts.to(self.device)
            self._partial = (p_out.to(self.device, self.reduce_dtype), p_used)

    # ------------------------------------------------------------------ views
    def refresh_views(self) -> None:
        """Re-make the full-shape views (and their one split node), see the Note."""
        if self.direct:  # the Parameters are full-shape already
            for e in self.entries:
                e.unsharded = e.sharded
            self.split_node = None
            return
        if self.state is ShardedState.UNSHARDING:
            self._ensure_flat()  # (gathered in a bucket: not yet, see _GatherBucketWork)
        chunks = torch.split(self.flat, self._split_sizes)
        for e, i, trains in zip(self.entries, self._view_at, self._trains):
            v = chunks[i] if trains else chunks[i].detach()
            v = v.view(e.shape)
            if e.tp is not None:  # the module sees its TP DTensor; grads flow to v
                v = DTensor.from_local(v, e.tp.mesh, e.tp.placements, run_check=False,
                                       shape=e.tp.shape, stride=e.tp.stride)
            e.unsharded = v
        # the node that assembles flat.grad from the views' gradients (None: no grad)
        self.split_node = chunks[0].grad_fn
        if self.split_node is not None:
            self.split_node.register_prehook(self._split_prehook)
        self._views_installed = False
        self._views_stale = False

    def _before_split_backward(self, grad_outputs) -> None:
        """The split node's pre-hook: note which views got a gradient (None:
        none, see [Note: parameters without a gradient]), then tell the unit
        (see [Note: gloo backward] in _unit.py)."""
        used = self._used
        for k, i in enumerate(self._view_at):
            if grad_outputs[i] is not None:
                used[k] = True
        if self.on_grads_computed is not None:
            self.on_grads_computed(grad_outputs)

    def install_sharded(self) -> None:
        for e in self.entries:
            for m, name in e.slots:
                m._parameters[name] = e.sharded
        self._views_installed = False

    def install_unsharded(self) -> None:
        if self._views_installed:
            return
        for e in self.entries:
            for m, name in e.slots:
                m._parameters[name] = e.unsharded
        self._views_installed = True

    # ---------------------------------------------------------- unshard/reshard
    def _frees_storage(self) -> bool:
        return not self._aliased and self.device.type != "meta"

    def _free_flat(self) -> None:
        if self._frees_storage():
            self.flat.untyped_storage().resize_(0)

    def _alloc_flat(self) -> None:
        if self._frees_storage():
            self.flat.untyped_storage().resize_(self.padded_numel * self.flat.element_size())

    def _ensure_flat(self) -> None:
        """The flat allocated if it is not (a group gathered in a bucket gets
        it at its first use, see _GatherBucketWork)."""
        if self._frees_storage() and self.flat.untyped_storage().nbytes() == 0:
            self._alloc_flat()

    def unshard(self, streams: StreamManager) -> None:
        """Issue the all-gather (no wait). Idempotent."""
        if self.state is ShardedState.UNSHARDED or self.state is ShardedState.UNSHARDING:
            return
        if self.device.type == "meta":
            raise unit_error(self.unit_fqn,
                             f"parameters {[e.fqn for e in self.entries]} are on the meta device.",
                             META_FIX)
        if self.state is ShardedState.PARTIAL:  # gather within the post-forward group
            pf = self.post_forward
            self._alloc_flat()
            self._pending = streams.all_gather(self.flat_data, self._pf_shard, pf.pg)
            self.state = ShardedState.UNSHARDING
            return
        self.unsharded_version = self.shard._version
        if self._aliased:
            self.state = ShardedState.UNSHARDED
            return
        self._alloc_flat()
        src = self.shard
        if self._copies_in:  # cast / host-to-device in one pass, into our own chunk
            S = self.shard_numel
            src = self.flat_data[self.rank * S:(self.rank + 1) * S]
            streams.copy_in(src, self.shard, from_host=self.offload)
        if self.world == 1:
            self.state = ShardedState.UNSHARDED
            return
        self._pending = streams.all_gather(self.flat_data, src, self.pg)
        self.state = ShardedState.UNSHARDING

    def gather_key(self) -> tuple | None:
        """Groups with equal keys can share one all-gather (see gather_bucket);
        None: this group is not gathered by a plain all-gather right now."""
        if self.state is not ShardedState.SHARDED or self.world == 1 or self._aliased \
                or self.device.type == "meta":
            return None
        return (self.compute_dtype, self.pg, self.world, self.device)

    def _complete_gather(self) -> None:
        """UNSHARDING -> UNSHARDED: wait for the all-gather (no-op otherwise)."""
        if self.state is ShardedState.UNSHARDING:
            self._pending.wait()
            self._pending = None
            self._pf_shard = None
            self.state = ShardedState.UNSHARDED

    def wait_for_unshard(self) -> None:
        self._complete_gather()
        if self.state is ShardedState.UNSHARDED:
            self.install_unsharded()

    def reshard(self, to_post_forward: bool = False) -> None:
        """Free the unsharded flat. ``to_post_forward``: keep this rank's 1/N of it
        (reshard_after_forward=N) for a backward all-gather within N ranks."""
        if self.state is ShardedState.SHARDED:
            return
        self._complete_gather()  # never free memory a collective writes
        if self.state is ShardedState.PARTIAL:
            if not to_post_forward:
                self._pf_shard = None
                self.state = ShardedState.SHARDED
            return
        self.install_sharded()
        if to_post_forward and self.post_forward is not None and self._frees_storage():
            n = self.padded_numel // self.post_forward.size
            i = self.post_forward.rank
            self._pf_shard = self.flat_data[i * n:(i + 1) * n].clone()
            self._free_flat()
            self.state = ShardedState.PARTIAL
            return
        self._free_flat()
        self.state = ShardedState.SHARDED

    def keep_unsharded(self) -> None:
        """Stay gathered past backward (set_reshard_after_backward(False)), but
        let the modules show the sharded Parameters between steps."""
        self._complete_gather()
        if self.state is ShardedState.UNSHARDED:
            self.install_sharded()

    # --------------------------------------------------------------- gradients
    # The gradient shard is held only by the p.grad views (through their
    # ``_base``): ``zero_grad(set_to_none=True)`` frees it, as in plain PyTorch.
    # We keep weak references, to recognise our views and accumulate into them.
    #
    # [Note: empty pieces] Where this rank holds none of a parameter that
    # other ranks hold (``ParamEntry.held_elsewhere``: a row piece of 0 rows,
    # or a tensor-layout parameter owned by another rank), ``p.grad`` stays
    # None: the optimizer skips the parameter here, as it skips any parameter
    # without a gradient, and keeps no state for it on this rank. An empty
    # gradient would make optimizers that normalise by the element count
    # divide by zero (torch.optim.Adafactor) and run matrix code on empty
    # matrices (Muon).
    def _adopt_grad_shard(self, buf: torch.Tensor, take: list[bool]) -> None:
        """``buf`` becomes the gradient shard of the entries in ``take`` (not
        of an empty piece held elsewhere, see [Note: empty pieces])."""
        for e, t in zip(self.entries, take):
            if t and not e.held_elsewhere():
                e.sharded.grad = e.piece(buf)

    def stash_unsynced_grad(self) -> None:
        """No gradient sync this backward: keep the flat gradient for the next.

        In the compute dtype autograd accumulates into ``flat.grad`` in place;
        when the reduce dtype is wider (bf16 compute, fp32 reduce) the sum is
        kept in the reduce dtype instead, as torch FSDP2 does.
        """
        g = self.flat.grad
        if g is None or g.dtype == self.reduce_dtype:
            return
        self.flat.grad = None
        if self._unsynced is None:
            self._unsynced = g.to(self.reduce_dtype)
        else:
            self._unsynced.add_(g)

    def drop_grad(self) -> None:
        """Forget the flat gradient and flags of a backward that raised midway."""
        self.flat.grad = None
        self._unsynced = None
        self._used = [False] * len(self.entries)

    def launch_reduce_scatter(self, streams: StreamManager) -> _GradLaunch:
        """Reduce-scatter ``flat.grad`` (zeros if this rank produced none)."""
        inline = self.padded_numel * self.reduce_dtype.itemsize <= INLINE_FLAGS_BYTES
        if self.world > 1 and inline:
            return _launch_inline([self], streams)[0]
        flat_grad, used, pre, post = self.take_grad()
        if self.world == 1:  # the flat gradient is the gradient shard
            if self.replicas > 1 and inline:  # HSDP: the flags ride in the all-reduce
                out = torch.cat([flat_grad, self.flags_row(used)])
                return _GradLaunch(self, streams, streams.ready(out),
                                   _UsedFlags(used, inline=True), post)
            return _GradLaunch(self, streams, streams.ready(flat_grad), _UsedFlags(used), post)
        op = dist.ReduceOp.AVG if pre is None else dist.ReduceOp.SUM
        counts = _flags_tensor(used, self.device)  # see [Note: parameters without a gradient]
        # The flags' all-reduce is issued first: on CUDA the post-reduce (the
        # fold, which reads them) runs as soon as the reduce-scatter is issued.
        with label("used_flags", self.unit_fqn):  # (tools.timeline tells it from the reduction)
            flags = streams.all_reduce(counts, self.rs_pg, dist.ReduceOp.SUM)
        launch = _GradLaunch(self, streams, None, _UsedFlags(used, pending=flags, counts=counts),
                             post)
        launch.pending = streams.reduce_scatter(flat_grad, self.rs_pg, op, _fold_all([launch]),
                                                self.replicate_pg is not None)
        return launch

    def bucket_key(self) -> tuple:
        """Groups with equal keys can share one reduce-scatter (see launch_bucket)."""
        return (self.reduce_dtype, self.rs_pg, self.world, self.device, self.replicas)

    def flags_row(self, used: list[bool]) -> torch.Tensor:
        """``used`` as a tensor in the reduce dtype on the device, to be copied
        (the same flags step after step: made once)."""
        key = (tuple(used), self.device, self.reduce_dtype)  # (a model moved or cast)
        if self._flags_row is None or self._flags_row[0] != key:
            self._flags_row = (key, _flags_tensor(used, self.device, self.reduce_dtype))
        return self._flags_row[1]

    def take_grad(self):
        """The flat gradient, ready to reduce: in ``reduce_dtype``, unsynced
        microbatches added, pre-divided. Returns (flat_grad, used flags, pre, post)."""
        flat_grad = self.flat.grad
        self.flat.grad = None
        if flat_grad is None:
            flat_grad = torch.zeros(self.padded_numel, dtype=self.reduce_dtype, device=self.device)
        elif flat_grad.dtype != self.reduce_dtype:
            flat_grad = flat_grad.to(self.reduce_dtype)
        if self._unsynced is not None:
            flat_grad = flat_grad.add_(self._unsynced)
            self._unsynced = None
        used, self._used = self._used, [False] * len(self.entries)
        pre, post = _divide_factors(self.world * self.replicas, self.reduce_dtype)
        if pre is not None:
            flat_grad.div_(pre)
        return flat_grad, used, pre, post

    def _split_flags(self, out: torch.Tensor, used: _UsedFlags):
        """(gradient shard, flag sums): views into ``out`` when the flags came
        inline, else ``used.counts``."""
        if used.inline:
            return out[:self.shard_numel], out[self.shard_numel:]
        if used.counts is None:  # (shard world size 1: the flags are local)
            used.counts = _flags_tensor(used.local, self.device)
        return out, used.counts

    def _finish_reduce(self, out: torch.Tensor, used: _UsedFlags, post: float | None,
                       streams: StreamManager) -> None:
        """On CUDA this runs on a side stream (see [Note: post-reduce] in _streams.py)."""
        used.wait()
        if self.replicate_pg is not None:  # HSDP: then across the replicas
            grad, counts = self._split_flags(out, used)
            if self._partial is not None:  # (its gradient and flags are added alike)
                p_out, p_used = self._partial
                p_grad, p_counts = self._split_flags(p_out, p_used)
                grad.add_(p_grad)
                counts.add_(p_counts.to(counts.dtype))
                used.local = [a or b for a, b in zip(used.local, p_used.local)]
                streams.hold(p_out)
                streams.hold(p_counts)
                self._partial = None
            if not self.requires_all_reduce:
                self._partial = (out, used)  # p.grad is left alone until an all-reduced backward
                return
            op = dist.ReduceOp.AVG if post is None else dist.ReduceOp.SUM
            _collectives.all_reduce(out, op, self.replicate_pg)  # (inline: the flags too)
            if not used.inline:
                _collectives.all_reduce(counts, dist.ReduceOp.SUM, self.replicate_pg)
        if used.inline:
            out, used.counts = out[:self.shard_numel], out[self.shard_numel:]
        if post is not None:
            out.div_(post)
        if self.offload:  # device-to-host, folded once the copy has landed
            host = streams.to_host(out, self.dtype, self.pin_memory)
            if used.counts is not None:  # (read by the fold, after the copy)
                used.counts = streams.to_host(used.counts, used.counts.dtype, self.pin_memory)
            # p.grad is read then: an earlier fold of this group may be waiting too
            streams.on_host(lambda: self._fold_grad(host, used.any_rank(self._trains)))
            return
        if out.dtype != self.dtype:
            out = out.to(self.dtype)
        self._fold_grad(out, used.any_rank(self._trains))

    def _fold_grad(self, out: torch.Tensor, any_rank: list[bool] | None) -> None:
        """Add this reduction into p.grad, see [Note: parameters without a gradient].
        ``any_rank[k]``: some rank produced entry k's gradient (None: all did)."""
        with torch.no_grad():
            entries = self.entries
            if all(e.sharded.grad is None for e in entries):  # the common case: adopt it
                take = [t and (any_rank is None or any_rank[k])
                        for k, t in enumerate(self._trains)]
                self._adopt_grad_shard(out, take)
                return
            # accumulation without zero_grad, a partial zero_grad (an optimizer
            # over part of the unit), p.grad set by the user: one by one
            for k, e in enumerate(entries):
                if not self._trains[k]:
                    continue  # frozen: backward leaves p.grad alone
                g = e.sharded.grad
                piece = e.piece(out)
                if g is not None:
                    g.add_(piece.view_as(g))
                elif (any_rank is None or any_rank[k]) and not e.held_elsewhere():
                    e.sharded.grad = piece.clone()  # (a view would keep all of out alive)

    def __repr__(self) -> str:
        dt = str(self.dtype) if self.compute_dtype == self.dtype else f"{self.dtype}->{self.compute_dtype}"
        return (f"FlatGroup({self.unit_fqn!r}, {dt}, requires_grad={self.requires_grad}, "
                f"params={len(self.entries)}, numel={self.padded_numel}, shard={self.shard_numel}, "
                f"{self.granularity}, {self.state.name})")


def launch_bucket(groups: list[FlatGroup], streams: StreamManager) -> list[_GradLaunch]:
    """ONE reduce-scatter for several groups with the same ``bucket_key()``.

    For many small units, where a collective's latency dominates its bytes:
    one collective instead of one per unit, for one copy (``_launch_inline``).
    """
    first = groups[0]
    if first.world == 1 or len(groups) == 1:  # nothing to merge
        return [g.launch_reduce_scatter(streams) for g in groups]
    return _launch_inline(groups, streams)


def _launch_inline(groups: list[FlatGroup], streams: StreamManager) -> list[_GradLaunch]:
    """Reduce-scatter the groups' flat gradients with their used-flags inline.

    The input is rank-major: for each rank r, every group's chunk r followed
    by its E flags (the same in every chunk), in turn: one ``cat`` of the flat
    gradients viewed as (W, S_i) and the flags as (W, E_i). The output is, for
    every group, its gradient shard then the rank average of its flags (> 0
    where any rank produced the gradient), end to end; each group adopts its
    slice (a view).
    """
    first = groups[0]
    taken = [g.take_grad() for g in groups]
    W = first.world
    cols = []
    for g, (flat_grad, used, _, _) in zip(groups, taken):
        cols.append(flat_grad.view(W, g.shard_numel))
        cols.append(g.flags_row(used).expand(W, len(used)))
    n = sum(c.shape[1] for c in cols)
    flat = streams.bucket("reduce_scatter", W * n, cols[0].dtype, first.device).view(W, n)
    torch.cat(cols, dim=1, out=flat)  # (see [Note: bucket buffers] in _streams.py)
    op = dist.ReduceOp.AVG if taken[0][2] is None else dist.ReduceOp.SUM
    launches, at = [], 0
    for g, (_, used, _, post) in zip(groups, taken):
        n = g.shard_numel + len(used)
        launches.append(_GradLaunch(g, streams, None, _UsedFlags(used, inline=True), post,
                                    (at, at + n)))
        at += n
    pending = streams.reduce_scatter(flat.view(-1), first.rs_pg, op, _fold_all(launches),
                                     first.replicate_pg is not None)  # waited once, shared
    for launch in launches:
        launch.pending = pending
        launch.bucket = flat
    return launches


class _GatherBucketWork:
    """The all-gather several groups share: waited once; each group's chunks
    are copied from the bucket into its flat buffer when that group waits
    (its flat is allocated then, or at its views' refresh just before), and
    the bucket is released after the last copy.

    So the bucket's flats are not all allocated at once: a unit's flat exists
    from its own pre-forward / pre-backward on, as without buckets, and at
    most the bucket plus the flats in use are alive (not the bucket plus
    every flat it covers). ``flush()`` copies out every group still waiting
    (the next bucket of the same kind wants the kept buffer, see [Note:
    bucket buffers] in _streams.py)."""

    def __init__(self, pending: Pending, groups: list[FlatGroup], buf: torch.Tensor,
                 streams: StreamManager):
        self._pending, self._buf, self._streams = pending, buf, streams
        self._at: dict[int, tuple[FlatGroup, int]] = {}
        at = 0
        for g in groups:
            self._at[id(g)] = (g, at)
            at += g.shard_numel

    def wait_group(self, g: FlatGroup) -> bool:
        """``g``'s chunks are in its flat."""
        self._pending.wait()  # (idempotent; on CUDA it orders the current stream)
        entry = self._at.pop(id(g), None)
        if entry is not None:
            g._ensure_flat()
            W, at, S = g.world, entry[1], g.shard_numel
            g.flat_data.view(W, S).copy_(self._buf.view(W, -1)[:, at:at + S])
            if not self._at:
                self._streams.release(self._buf)
                self._buf = self._streams = None
        return True

    def flush(self) -> None:
        for g, _ in list(self._at.values()):
            self.wait_group(g)


class _GroupShare:
    """One group's wait on a shared all-gather bucket."""

    def __init__(self, work: _GatherBucketWork, group: FlatGroup):
        self._work, self._group = work, group

    def wait(self) -> bool:
        return self._work.wait_group(self._group)


def gather_bucket(groups: list[FlatGroup], streams: StreamManager) -> None:
    """ONE all-gather for several sharded groups with the same ``gather_key()``.

    The bucket is rank-major (for each rank r, every group's chunk r in turn):
    this rank's row is filled from the shards (cast / host-to-device in the
    same pass), gathered, and each group's chunks are copied into its flat
    when that group waits (see _GatherBucketWork). For many small units,
    where a collective's latency dominates its bytes: one collective instead
    of one per unit, for two copies of the bucket.
    """
    first = groups[0]
    W, total = first.world, sum(g.shard_numel for g in groups)
    work = _GatherBucketWork(None, groups, None, streams)
    buf = streams.bucket("all_gather", W * total, first.compute_dtype, first.device, holder=work)
    mine, at = buf.view(W, total)[first.rank], 0
    for g in groups:
        g.unsharded_version = g.shard._version
        streams.copy_in(mine[at:at + g.shard_numel], g.shard, from_host=g.offload)
        at += g.shard_numel
    work._pending, work._buf = streams.all_gather(buf, mine, first.pg), buf
    for g in groups:
        g._pending = Pending(_GroupShare(work, g), ())
        g.state = ShardedState.UNSHARDING
