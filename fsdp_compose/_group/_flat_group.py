"""One flat group: the parameters of one unit that share (dtype, requires_grad).

This file holds its storage: the shard, the unsharded flat and the views over
them, gathered (``unshard``) and freed (``reshard``). Where each parameter's
rows lie: _layout.py and _param_entry.py; the gradient: ``group.grad``, a
``GradientPath`` (_grad_path.py). Decisions and measurements: docs/design.md,
"Views and how they are swapped", "World size 1: parameters keep their shape".

[Note: tensor vocabulary] (``S``: this rank's ``shard_numel``)
- *shard* (S, the parameters' dtype, in host memory with offload): the master
  copy, this rank's range ``flat_range`` of the flat ([Note: shard layout]);
  the sharded Parameters are views of it (``ParamEntry.piece``).
- *flat* (``padded_numel``, ``compute_dtype``): a leaf whose storage is
  allocated at unshard and freed at reshard (``untyped_storage().resize_``),
  so it and its views keep their identity. The all-gather's output, the
  shard its input (a cast or offload first copies the shard in ONE pass into
  this rank's range of the flat, then gathers in place).
- *views*: ONE ``split`` of the flat plus a ``view`` each, re-made at every
  grad-enabled forward (``refresh_views``: an older split node would run last
  in backward), so backward writes ONE *flat gradient* (``flat.grad``, zeros
  where none came), whose post-accumulate hook is the post-backward. Its
  reduce-scatter's output, the *gradient shard* (S, the shard's dtype and
  device), is held only by the ``p.grad`` views of it: ``zero_grad()`` frees it.

[Note: world size 1] Every rank holds every row, so a piece is the whole
parameter, in its shape (0-dim: 1-D, ``piece_shape``). ``FlatGroup.mode``, a
``FlatMode``, is decided by ``_decide_mode`` when the group is built or re-made:
- ``GATHERED``: world size > 1: the flat is the all-gather output, freed at reshard;
- ``COPIED``: world size 1 with a cast (``param_dtype``) or offload: the flat
  is a copy of the whole shard (one pass, no collective), freed at reshard;
- ``ALIASED``: world size 1, nothing to copy: the flat IS the shard, never
  freed; views, split node and flat gradient as at any world size (for a
  DTensor, a 0-dim parameter, its own reduce dtype, HSDP, a post-forward group);
- ``DIRECT``: ``ALIASED`` with none of those: the sharded Parameters are
  full-shape leaves over the shard with their own AccumulateGrad (plain
  PyTorch's backward): no views, no flat gradient, no hooks.
A unit is *passive* (``Unit.passive``) when every group is ``DIRECT`` and it
casts nothing; a model *communicates* (``RootContext.communicates``) when some
group is ``GATHERED``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum
from operator import attrgetter
from typing import Any, NamedTuple, NoReturn, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._base import _compat
from .._comm import _collectives

from .._plan import _layout
from .._base._common import META_FIX, ShardedState, unit_error, weak_hook
from ._grad_path import GradientPath
from ._param_entry import ParamEntry, make_entries, user_attrs
from ._row_dtensor import local_of
from .._comm._streams import Backend, Pending

# which collective a unit waits for, in a DivergenceError (see _divergence.py)
_GATHER = "the all-gather of its parameters"


class FlatMode(Enum):
    """What a group's unsharded flat is (see [Note: world size 1])."""

    GATHERED = "gathered"  # world > 1: the all-gather output
    COPIED = "copied"      # world 1, a cast or offload: a copy of the shard
    ALIASED = "aliased"    # world 1: the shard itself
    DIRECT = "direct"      # ALIASED, and the Parameters are autograd's leaves: no flat gradient


class PostForward(NamedTuple):
    """The smaller group a unit reshards to after forward (reshard_after_forward=int)."""

    pg: dist.ProcessGroup
    size: int   # N ranks hold the parameters between forward and backward
    rank: int   # this rank's index in it


@dataclass(frozen=True)
class GroupSpec:
    """What a group is, one frozen value (``FlatGroup.spec``, each field also
    readable as ``group.<field>``): its mesh and process groups, its dtypes
    and its mode. Made by fully_shard; replaced (dtypes, mode) only when a
    cast or move re-makes the group (``adopt_params``). The schedule, the
    step checks, the planner and the state-dict code read it."""

    mesh: object                 # the unit's DeviceMesh (state dicts place DTensors on it)
    pg: object                   # its all-gathers
    rs_pg: object                # its reduce-scatters (see _backward_plan.py)
    replicate_pg: object         # HSDP: gradient shards are all-reduced over it; or None
    world: int                   # ranks the shard is split over
    rank: int                    # this rank's index among them
    replicas: int                # HSDP replicas (1: none)
    post_forward: PostForward | None  # reshard_after_forward=N
    offload: bool                # the shard lives in host memory
    pin_memory: bool
    granularity: str             # "row" or "tensor" (see [Note: shard layout])
    mesh_device: torch.device    # where fully_shard put it (the flat's device with offload)
    dtype: torch.dtype | None = None          # the shard's (the master copy)
    compute_dtype: torch.dtype | None = None  # the unsharded flat's (param_dtype)
    reduce_dtype: torch.dtype | None = None   # the reduce-scatter's
    mode: FlatMode | None = None              # see [Note: world size 1]


_T = TypeVar("_T", covariant=True)


class _SpecField(Protocol[_T]):
    """What a type checker sees of a ``_spec_field``: reading gives a ``_T``,
    assigning is refused."""

    def __get__(self, group: object, owner: object = None) -> _T: ...
    def __set__(self, group: object, value: NoReturn) -> None: ...


def _spec_field(name: str) -> Any:
    """``group.<name>`` reads ``group.spec.<name>``; read-only (a property
    without a setter), and no Python frame per read (an ``attrgetter``)."""
    return property(attrgetter(f"spec.{name}"))


class FlatGroup:
    """One group's storage (see the module docstring). ``state``: SHARDED or
    PARTIAL -> UNSHARDING (``unshard`` or ``gather_bucket`` issued the
    all-gather; UNSHARDED at once where nothing is gathered) -> UNSHARDED
    (``wait_for_unshard``) -> SHARDED or PARTIAL (``reshard``)."""

    # the spec's fields, read as the group's own (``g.world``, ``g.dtype``, ...);
    # the dtypes and the mode are set in __init__, before any read
    mesh: _SpecField[Any] = _spec_field("mesh")
    pg: _SpecField[Any] = _spec_field("pg")
    rs_pg: _SpecField[Any] = _spec_field("rs_pg")
    replicate_pg: _SpecField[Any] = _spec_field("replicate_pg")
    world: _SpecField[int] = _spec_field("world")
    rank: _SpecField[int] = _spec_field("rank")
    replicas: _SpecField[int] = _spec_field("replicas")
    post_forward: _SpecField[PostForward | None] = _spec_field("post_forward")
    offload: _SpecField[bool] = _spec_field("offload")
    pin_memory: _SpecField[bool] = _spec_field("pin_memory")
    granularity: _SpecField[str] = _spec_field("granularity")
    mesh_device: _SpecField[torch.device] = _spec_field("mesh_device")
    dtype: _SpecField[torch.dtype] = _spec_field("dtype")
    compute_dtype: _SpecField[torch.dtype] = _spec_field("compute_dtype")
    reduce_dtype: _SpecField[torch.dtype] = _spec_field("reduce_dtype")
    mode: _SpecField[FlatMode] = _spec_field("mode")

    def __init__(self, unit_fqn: str, params: list, *, device: torch.device,
                 world: int, rank: int, pg, rs_pg,
                 param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None,
                 offload: bool = False, pin_memory: bool = True,
                 replicate_pg=None, post_forward: PostForward | None = None,
                 granularity: str = "row", mesh=None, loads: list | None = None):
        # loads: bytes each rank of the group holds in earlier groups over the
        # same ranks, updated here (uneven layouts even the sums out, see
        # [Note: shard layout]); None: this group alone
        # params: [(param, [(module, name), ...], rel_fqn)] in registration order
        first = params[0][0]
        # any entry trains (its sharded Parameter requires grad), see sync_requires_grad
        self.requires_grad: bool = first.requires_grad
        self._trains: tuple[bool, ...] = (first.requires_grad,) * len(params)
        self._set_spec(GroupSpec(
            mesh, pg, rs_pg, replicate_pg, world, rank,
            dist.get_world_size(replicate_pg) if replicate_pg is not None else 1,
            post_forward, offload, pin_memory, granularity, device))
        self._policy_dtypes = (param_dtype, reduce_dtype)  # the unit's mp_policy, or Nones
        self._set_dtype(first.dtype)
        self.unit_fqn = unit_fqn
        self.state = ShardedState.SHARDED
        self._views_installed = False  # the modules hold the full-shape views

        itemsize = min(first.element_size(), self.compute_dtype.itemsize)
        align = _layout.align_elems(itemsize)
        locals_ = [self._local_of(p) for p, _, _ in params]
        held = first.element_size()  # (loads are the bytes of the shards)
        self.layout = layout = self._plan_layout(
            [_layout.Slot(t.shape[0] if t.dim() else 1, math.prod(t.shape[1:]))
             for t in locals_], world, align, granularity,
            None if loads is None else [b // held for b in loads])
        if loads is not None:
            for r in range(world):
                loads[r] += layout.shard_numel(r) * held
        self.padded_numel = layout.numel
        self.shard_numel = layout.shard_numel(rank)
        # this rank's range of the flat (None: two lanes, [Note: lanes] in _layout.py);
        # every rank's (uneven pieces, see Layout.gather_spec) or None (equal chunks)
        self.flat_range = layout.rank_range(rank) if layout.contiguous else None
        self.gather_bounds = layout.gather_spec()
        # uneven pieces through one padded equal-size collective (decided by the
        # backend once: [Note: padded collectives] in _collectives.py; always
        # for two lanes, whose pieces are not ranges of the flat)
        self._pads = world > 1 and (_collectives.pads(pg, device) or not layout.contiguous)
        self.entries: list[ParamEntry] = make_entries(params, locals_, layout, rank, mesh)
        self._split_sizes, self._view_at = layout.split_plan()
        self._set_spec(replace(self.spec, mode=self._decide_mode()))
        self.grad = GradientPath(self)  # the gradient half (_grad_path.py)

        self._grad_hook = None
        self._hooked_flat = None   # the flat tensor the grad hook is registered on
        self._views_stale = False  # sync_requires_grad changed what the views must be
        self._split_prehook = weak_hook(self.grad, "_before_split_backward")
        self._allocate(torch.device("meta") if locals_[0].is_meta else device)
        with torch.no_grad():
            for e, (p, _, _), local in zip(self.entries, params, locals_):
                self._copy_attrs(e, p)  # user attributes survive
                if not local.is_meta and e.local_range[1] > e.local_range[0]:
                    src = local.detach().reshape(-1)[slice(*e.local_range)]
                    self.shard[slice(*e.shard_range)].copy_(src)

        self._pending: Pending | None = None
        self._pf_shard: torch.Tensor | None = None   # post-forward shard (PARTIAL)
        self.unsharded_version = -1                  # shard._version when last gathered

    @staticmethod
    def _local_of(p: torch.Tensor) -> torch.Tensor:
        """The tensor whose values and shape the group holds for ``p``."""
        return p.to_local() if isinstance(p, DTensor) else p

    @staticmethod
    def _plan_layout(slots: list, world: int, align: int, granularity: str,
                     before: list | None) -> _layout.Layout:
        """The group's layout (see [Note: shard layout]); ``before``: the loads
        of earlier groups over the same ranks, in this group's elements."""
        return _layout.plan(slots, world, align, granularity, before=before,
                            even=_layout.FORCE_EVEN)

    def _set_dtype(self, dtype: torch.dtype) -> None:
        """The shard's dtype (the master copy) and what follows from it."""
        param_dtype, reduce_dtype = self._policy_dtypes
        floating = dtype.is_floating_point
        compute = param_dtype if (param_dtype and floating) else dtype
        reduce = reduce_dtype if (reduce_dtype and floating) else compute
        self._set_spec(replace(self.spec, dtype=dtype, compute_dtype=compute, reduce_dtype=reduce))

    @property
    def _copies_in(self) -> bool:
        """One pass (cast and/or host-to-device) into the flat's own chunk
        before the all-gather."""
        return self.compute_dtype != self.dtype or self.offload

    def _decide_mode(self) -> FlatMode:
        """See [Note: world size 1]; needs the entries and the dtypes."""
        if self.world > 1:
            return FlatMode.GATHERED
        if self._copies_in:
            return FlatMode.COPIED
        if (all(e.tp is None and e.row is None and len(e.shape) > 0 for e in self.entries)
                and self.replicas == 1
                and self.reduce_dtype == self.dtype and self.post_forward is None):
            return FlatMode.DIRECT
        return FlatMode.ALIASED

    def _set_spec(self, spec: GroupSpec) -> None:
        """``spec`` and the flags read from its mode at every hook (plain
        attributes: an enum lookup, or a ``device.type`` string, per read
        cost ~1 us several hundred times a step on the overhead shape):

        - ``direct``: the sharded Parameters are autograd's own leaves
          (``FlatMode.DIRECT``);
        - ``aliased``: the flat is the shard, never freed (``ALIASED`` or
          ``DIRECT``)."""
        self.spec = spec
        mode = spec.mode
        self.direct: bool = mode is FlatMode.DIRECT
        self.aliased: bool = self.direct or mode is FlatMode.ALIASED

    # ------------------------------------------------------------- storage
    def _new_shard(self, device: torch.device) -> None:
        """A zeroed shard for ``device`` (host memory with offload, pinned if
        asked and a GPU is there); sets ``device`` and ``shard_device``."""
        self.device = device
        self.on_meta = meta = device.type == "meta"  # (read per hook: _frees_storage)
        self.shard_device = torch.device("cpu") if self.offload and not meta else device
        shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.shard_device)
        if self.offload and self.pin_memory and not meta and torch.cuda.is_available():
            shard = shard.pin_memory()
        self.shard = shard

    def _allocate(self, device: torch.device, params: list | None = None) -> None:
        """(Re)create the shard, the sharded Parameters and the unsharded flat on ``device``.

        ``params``: keep these Parameter objects (one per entry) as the sharded
        Parameters: their values are copied into the new shard, then their
        ``.data`` becomes their piece of it (see ``adopt_params``).
        """
        self._new_shard(device)
        shard, meta = self.shard, device.type == "meta"
        for i, (e, trains) in enumerate(zip(self.entries, self._trains)):
            if params is None:
                e.sharded = e.new_sharded(e.piece(shard), trains)
                continue
            p = params[i]
            with torch.no_grad():
                if not meta and not p.is_meta and e.shard_range[1] > e.shard_range[0]:
                    shard[slice(*e.shard_range)].copy_(local_of(p).detach().reshape(-1))
                e.set_data(p, e.piece(shard))
                if e.row is not None:  # (lost where nn.Module._apply swapped its contents)
                    p._fsdp_name = e.fqn
            e.sharded = p
        if self.aliased:
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

    def _copy_attrs(self, e: ParamEntry, p: torch.Tensor) -> None:
        """The user attributes of original parameter ``p`` onto its sharded Parameter."""
        e.sharded.__dict__.update(user_attrs(p))

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
        with _compat.no_subclass_dispatch():  # (per forward: no RowParam dispatch)
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
        """Give a group built on the meta device real (uninitialised) storage;
        RuntimeError if it is not on meta. The sharded Parameters and the flat
        leaf are NEW objects (the modules' slots are updated): callers that
        index Parameters (``_registry.SHARDED``) re-register them."""
        if self.device.type != "meta":
            raise unit_error(self.unit_fqn, "materialize_: the group is not on the meta device.")
        old = [e.sharded for e in self.entries]
        self._allocate(device)
        for e, o in zip(self.entries, old):
            e.sharded.__dict__.update(user_attrs(o))
        self.install_sharded()

    def adopt_params(self, params: list) -> None:
        """``nn.Module._apply`` (a cast, a move, ``to_empty``) changed the sharded
        Parameters: their ``.data``, or the objects the modules hold (``params``,
        one per entry, all of one dtype and device). See [Note: casts after
        fully_shard] in _fsdp_module.py.

        A new shard in their dtype, on their device (on CPU with offload), holds
        their values; they become views of it again. The compute and reduce
        dtypes follow the new dtype unless the unit's mp_policy fixes them; the
        unsharded flat is re-made (a new leaf: the unit registers its gradient
        hook again); its mode (direct or not) is decided again. The layout
        (offsets, padding, every rank's range) is kept. A gradient accumulated
        without sync is cast along, as ``_apply`` casts ``p.grad``. Only while
        SHARDED (the caller reshards first).
        """
        first = params[0]
        flat_grad = self.flat.grad
        self._set_dtype(first.dtype)
        self._set_spec(replace(self.spec, mode=self._decide_mode()))
        device = first.device
        if self.offload and device.type != "meta":
            device = self.mesh_device  # the shard stays on CPU; the flat where it computes
        self._grad_hook = None
        self._allocate(device, params)
        self.install_sharded()
        self.unsharded_version = -1
        self.grad._move_grad_state(flat_grad)

    # ------------------------------------------------------------------ views
    def refresh_views(self) -> None:
        """Re-make the full-shape views and their one split node (see [Note:
        tensor vocabulary]); a direct group's views are its Parameters."""
        if self.direct:  # the Parameters are full-shape already
            for e in self.entries:
                e.unsharded = e.sharded
            self.split_node = None
            return
        if self.state is ShardedState.UNSHARDING:
            self._ensure_flat()  # (gathered in a bucket: not yet, see _GatherBucketWork)
        # (the method, not torch.split's Python layers: per unit per step)
        chunks = self.flat.split_with_sizes(self._split_sizes)
        for e, i, trains in zip(self.entries, self._view_at, self._trains):
            v = chunks[i] if trains else chunks[i].detach()
            if len(e.shape) != 1:  # (a 1-D parameter's chunk is its shape: no view
                v = v.view(e.shape)  # node, ~10 us per parameter per step)
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
        return not self.aliased and not self.on_meta

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

    def unshard(self, streams: Backend) -> None:
        """Issue the all-gather (no wait); idempotent. PARTIAL: within the
        post-forward group. Raises RuntimeError on the meta device."""
        if self.state is ShardedState.UNSHARDED or self.state is ShardedState.UNSHARDING:
            return
        if self.device.type == "meta":
            raise unit_error(self.unit_fqn,
                             f"parameters {[e.fqn for e in self.entries]} are on the meta device.",
                             META_FIX)
        if self.state is ShardedState.PARTIAL:  # gather within the post-forward group
            pf = self.post_forward
            self._alloc_flat()
            self._pending = streams.all_gather(
                self.flat_data, self._pf_shard, pf.pg,  # type: ignore[arg-type, union-attr]
                (self.unit_fqn, _GATHER))
            self.state = ShardedState.UNSHARDING
            return
        self.unsharded_version = self.shard._version
        if self.aliased:
            self.state = ShardedState.UNSHARDED
            return
        self._alloc_flat()
        src = self.shard
        if self._copies_in:  # cast / host-to-device in one pass, into our own chunk
            src = (self.flat_data[slice(*self.flat_range)] if self.flat_range is not None
                   else self.flat_data.new_empty(self.shard_numel))  # (two lanes: staged anyway)
            streams.copy_in(src, self.shard, from_host=self.offload)
        if self.mode is FlatMode.COPIED:  # (the copy is the whole flat)
            self.state = ShardedState.UNSHARDED
            return
        self._pending = streams.all_gather(self.flat_data, src, self.pg, (self.unit_fqn, _GATHER),
                                           bounds=self.gather_bounds, padded=self.padded())
        self.state = ShardedState.UNSHARDING

    def gathers_together(self, streams) -> bool:
        """Gathered with the unit's other such groups in one all-gather
        (``_extension.gather_together``); a plain group never is."""
        return False

    @property
    def slot(self) -> int:
        """Each rank's part of the group's all-gather and reduce-scatter: the
        shard (equal chunks), or the largest piece ([Note: padded collectives]
        in _collectives.py)."""
        return self.layout.chunk

    def padded(self) -> bool:
        """Uneven pieces gathered and reduced padded to ``slot`` (every backend
        but gloo), which can share buckets; False: equal chunks, or gloo's
        in-place path for uneven pieces (alone)."""
        return self.gather_bounds is not None and self._pads

    def shares_reduce(self) -> bool:
        """Reduced with the unit's other such groups of its key even when the
        unit is not in a bucket (``_group_ops.reduce_scatter``): padded groups."""
        return self.padded()

    def gather_key(self) -> tuple | None:
        """Groups with equal keys can share one all-gather (see gather_bucket);
        None: this group is not gathered by a plain all-gather right now. A
        group of uneven pieces on gloo shares with none (its key is its own)."""
        if self.state is not ShardedState.SHARDED or self.mode is not FlatMode.GATHERED \
                or self.on_meta:
            return None
        return (self.compute_dtype, self.pg, self.world, self.device,
                id(self) if self.gather_bounds is not None and not self.padded() else None)

    def _complete_gather(self) -> None:
        """UNSHARDING -> UNSHARDED: wait for the all-gather (no-op otherwise)."""
        if self.state is ShardedState.UNSHARDING:
            self._pending.wait()  # type: ignore[union-attr]
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

    def __repr__(self) -> str:
        dt = (str(self.dtype) if self.compute_dtype == self.dtype
              else f"{self.dtype}->{self.compute_dtype}")
        return (f"FlatGroup({self.unit_fqn!r}, {dt}, requires_grad={self.requires_grad}, "
                f"params={len(self.entries)}, numel={self.padded_numel}, shard={self.shard_numel}, "
                f"{self.granularity}, {self.state.name})")


class _GatherBucketWork:
    """The all-gather several groups share, waited once. Each group's chunks
    are copied into its flat when that group waits (its flat allocated then,
    or at its views' refresh just before), so at most the bucket and the flats
    in use are alive; the bucket is released after the last copy. ``flush()``
    copies out every group still waiting (the next bucket of the same kind
    wants the kept buffer: [Note: bucket buffers] in _streams.py)."""

    def __init__(self, pending: Pending, groups: list[FlatGroup], buf: torch.Tensor,
                 streams: Backend):
        self._pending, self._buf, self._streams = pending, buf, streams
        self._at: dict[int, tuple[FlatGroup, int]] = {}
        at = 0
        for g in groups:
            self._at[id(g)] = (g, at)
            at += g.slot
        self._row = at

    def wait_group(self, g: FlatGroup) -> bool:
        """``g``'s chunks are in its flat."""
        self._pending.wait()  # (idempotent; on CUDA it orders the current stream)
        entry = self._at.pop(id(g), None)
        if entry is not None:
            g._ensure_flat()
            W, at, S = g.world, entry[1], g.slot
            if g.gather_bounds is None:  # (its column of the rank-major bucket,
                # as one as_strided: ``buf.view(W, -1)[:, at:at + S]`` took ~2x as long)
                buf = self._buf
                g.flat_data.view(W, S).copy_(
                    buf.as_strided((W, S), (self._row, 1), buf.storage_offset() + at))
            else:  # (uneven pieces: see [Note: padded collectives] in _collectives.py)
                _collectives.unpack(g.flat_data, self._buf, g.gather_bounds, S, self._row, at)
            if not self._at:
                self._streams.release(self._buf)
                self._buf = self._streams = None  # type: ignore[assignment]
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


def gather_bucket(groups: list[FlatGroup], streams: Backend) -> None:
    """ONE all-gather for several sharded groups with the same ``gather_key()``:
    rank-major (for each rank r, every group's chunk r in turn, an uneven
    group's piece padded to its ``slot``); this rank's row is filled from the
    shards (cast / host-to-device in the same pass), and each group's chunks
    are copied into its flat when that group waits (``_GatherBucketWork``).
    Every group is UNSHARDING after it."""
    first = groups[0]
    W, total = first.world, sum(g.slot for g in groups)
    held = streams.holder_of("all_gather", first.compute_dtype, first.device)
    if isinstance(held, _GatherBucketWork):
        held.flush()  # the kept buffer: its chunks copied out, it is free again
    work = _GatherBucketWork(None, groups, None, streams)  # type: ignore[arg-type]
    buf = streams.bucket("all_gather", W * total, first.compute_dtype, first.device, holder=work)
    mine, at = buf.view(W, total)[first.rank], 0
    base = mine.storage_offset()
    for g in groups:
        g.unsharded_version = g.shard._version
        streams.copy_in(mine.as_strided((g.shard_numel,), (1,), base + at), g.shard,
                        from_host=g.offload)  # (mine[at:at + n], one C call)
        if g.slot > g.shard_numel:  # (a padded piece: nobody reads it, every byte written)
            mine[at + g.shard_numel:at + g.slot].zero_()
        at += g.slot
    what = (first.unit_fqn, f"{_GATHER} (a bucket of {len(groups)} groups from here on)")
    work._pending, work._buf = streams.all_gather(buf, mine, first.pg, what), buf
    for g in groups:
        g._pending = _GroupShare(work, g)  # type: ignore[assignment]  # (a wait() of its own)
        g.state = ShardedState.UNSHARDING
