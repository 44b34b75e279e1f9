"""Sharded parameters as DTensors over our row pieces (docs/dtensor-params.md).

A sharded parameter is ``nn.Parameter(RowParam)``: a DTensor of the
parameter's global shape whose placement is ``RowShard(split)`` and whose
local tensor is this rank's rows, the view of the unit's flat shard the
parameter always was (zero-copy). ``RowShard`` is a ``Shard(0)`` that knows
the real split (our layout's rows per rank, not ``torch.chunk``'s), so
DTensor's own data movement (``full_tensor``, ``redistribute``,
``distribute_tensor``'s scatter) and DCP's chunk offsets are right for it.
``RowParam`` is a thin DTensor subclass whose ``__torch_function__`` keeps
the split on results that keep dim 0, and refuses, naming the parameter
and the op, any result that DTensor would describe with a fresh
``Shard(0)`` of unevenly split rows (silently wrong otherwise).

[Note: TP parameters as RowParams]
A tensor-parallel (DTensor) parameter inside a unit keeps its local TP
shard in the flat group, and our rows split that shard's dim 0. Its
sharded Parameter is a RowParam over the unit's mesh joined with its TP
mesh (``_compat.concat_meshes``), placed ``(RowShard(cuts), *TP's)``: on a
``(dp, tp)`` mesh ``(RowShard, Shard(1))`` for a row-wise weight and
``(RowShard(within tp), Shard(0))`` for a column-wise one, where FSDP2 shows
``(Shard(0), Shard(1))`` and ``(_StridedShard(0), Shard(0))``. Our rows are
cut inside each TP block (``within``), so DTensor's own data movement, which
nests the placements left to right, would be wrong for them: the RowShard
refuses it (``_not_strided``), and ``full_tensor`` / ``redistribute`` /
DCP's chunk offsets go through this class (``_tp_form``, ``local_box``):
our rows gathered first, then torch's own on the TP placements. Ops are
guarded as for uneven rows (``_uneven``).

[Note: RowShard equality]
``RowShard(s) == Shard(0)`` (DTensorSpec's shard-order checks and the
in-place fast path compare placements) but ``hash(RowShard(s))`` is the
split's: DTensor caches redistribute plans and sharding propagation by
hashed specs, and with ``Shard``'s hash the first split seen would be
returned for every later tensor of that shape, including a plain FSDP2
``Shard(0)`` one (measured: docs/dtensor-params.md, E1). Two RowShards are
equal only with the same split. This breaks Python's hash/eq contract
between a RowShard and ``Shard(0)`` on purpose.

Private torch API used here (signatures identical in 2.11, 2.13, 2.14): the
``Shard`` methods DTensor moves data through (``_split_tensor``,
``_to_replicate_tensor``, ``_replicate_to_shard``, ``_to_new_shard_dim``,
``_reduce_shard_tensor``, ``_shard_tensor``, ``_local_shard_size_and_offset``),
``DTensorSpec`` / ``TensorMeta``, and ``DTensor._local_tensor``.
"""
from __future__ import annotations

import contextlib
import copy
import sys
from bisect import bisect_right
from typing import Any, Sequence, overload

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._base import _compat
from .._base._compat import DTensorSpec, TensorMeta, funcol, tree_map_only
from .._base._compat import pytree_leaves as tree_leaves
from .._base._common import all_gather_tensor
from .._plan._layout import chunk_range

__all__ = ["RowShard", "TPShard", "RowParam", "row_param", "local_of"]


# all_gather_single (2.13+); all_gather_tensor on 2.11, deprecated since
_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


# The RowParam call in progress (name, args, kwargs), named in the errors of
# the collectives it issues (set by RowParam.__torch_function__; None: DTensor
# called ours directly)
_doing: tuple | None = None


@contextlib.contextmanager
def _calling(name: str, p):
    global _doing
    outer = _doing
    if outer is None:
        _doing = (name, (p,), {})
    try:
        yield
    finally:
        _doing = outer


def _describe_doing() -> str:
    if _doing is None:
        return "a DTensor redistribution of a sharded parameter"
    name, args, kwargs = _doing
    names = [t._fsdp_name for t in tree_leaves((args, kwargs))
             if isinstance(t, RowParam) and t._fsdp_name]
    return (f"{name}() of sharded parameter '{names[0]}'" if names
            else f"{name}() of a sharded parameter")

_C10D_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
             "product": dist.ReduceOp.PRODUCT}


def _collective(kind: str, mesh, mesh_dim: int, device: torch.device, issue) -> None:
    """Issue ``issue()`` (a c10d collective, ``async_op=True``, returning its
    work) on the mesh dim's group as a user's call: on some ranks only, it
    raises on every rank at the others' next step check instead of waiting
    for the backend's timeout (_divergence.user_collective)."""
    from .._comm import _divergence
    doing = f"{_describe_doing()} ({kind})"
    _divergence.user_collective(mesh.get_group(mesh_dim), issue, doing,
                                blocks_cpu=device.type == "cpu")


def _gather_rows(padded: torch.Tensor, mesh, mesh_dim: int) -> torch.Tensor:
    """The mesh dim's ``padded`` pieces, concatenated in coordinate order."""
    if torch.compiler.is_compiling():
        return _wait(_ALL_GATHER(padded, gather_dim=0, group=(mesh, mesh_dim)))
    padded = padded.contiguous()
    out = padded.new_empty((padded.size(0) * mesh.size(mesh_dim),) + tuple(padded.shape[1:]))
    # (gloo checks the output as a flat list of the inputs' sizes: dim 0 only, as here)
    group = mesh.get_group(mesh_dim)
    _collective("an all-gather", mesh, mesh_dim, padded.device,
                lambda: all_gather_tensor(out, padded, group=group, async_op=True))
    return out


def _all_reduce(tensor: torch.Tensor, reduce_op, mesh, mesh_dim: int) -> torch.Tensor:
    op = _C10D_OPS.get(reduce_op) if isinstance(reduce_op, str) else None
    if op is None or torch.compiler.is_compiling():  # (avg and the like: torch's own path)
        return _wait(funcol.all_reduce(tensor, reduce_op, group=(mesh, mesh_dim)))
    out = tensor.contiguous().clone()
    group = mesh.get_group(mesh_dim)
    _collective("an all-reduce", mesh, mesh_dim, out.device,
                lambda: dist.all_reduce(out, op=op, group=group, async_op=True))
    return out


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    extra = rows - t.size(0)
    if extra == 0:
        return t.contiguous()
    return F.pad(t, [0, 0] * (t.dim() - 1) + [0, extra]).contiguous()


_SPLITS: dict = {}


class RowShard(Shard):
    """``Shard(0)`` with the real split: rank ``c`` of the mesh dim holds rows
    ``[cuts[c], cuts[c + 1])``. See [Note: RowShard equality].

    ``within > 1``: a tensor-parallel parameter inside a unit whose TP
    placement (on a later mesh dim) also shards dim 0 into ``within`` blocks:
    the cuts split the rows of each TP block, not of the whole tensor, as
    FSDP2's ``_StridedShard`` does (see [Note: TP parameters as RowParams])."""

    def __init__(self, cuts: Sequence[int], within: int = 1):
        super().__init__(0)
        cuts = tuple(int(c) for c in cuts)
        # interned: one tuple per distinct split in the process
        self.cuts = _SPLITS.setdefault(cuts, cuts)
        self.within = int(within)
        self._hash = hash(("RowShard", self.cuts, self.within))
        self.has_empty = any(b == a for a, b in zip(self.cuts, self.cuts[1:]))

    # ------------------------------------------------------------ identity
    def __eq__(self, other: object) -> bool:
        if isinstance(other, RowShard):
            return other.cuts == self.cuts and other.within == self.within
        return Shard.__eq__(self, other)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (RowShard, (self.cuts, self.within) if self.within > 1 else (self.cuts,))

    def __deepcopy__(self, memo):
        return self  # immutable

    def __repr__(self) -> str:
        sizes = [b - a for a, b in zip(self.cuts, self.cuts[1:])]
        shown = "/".join(map(str, sizes[:8])) + ("/..." if len(sizes) > 8 else "")
        within = f", within {self.within} TP blocks" if self.within > 1 else ""
        return f"RowShard(dim=0, rows={shown}{within})"

    def __str__(self) -> str:
        return "RS(0)"

    # ------------------------------------------------------------- queries
    def rows_of(self, coord: int) -> tuple[int, int]:
        return self.cuts[coord], self.cuts[coord + 1]

    @property
    def largest(self) -> int:
        return max(b - a for a, b in zip(self.cuts, self.cuts[1:]))

    def is_chunked(self) -> bool:
        """The split is ``torch.chunk``'s (a plain ``Shard(0)`` would say the same)."""
        n, w = self.cuts[-1], len(self.cuts) - 1
        c = -(-n // w) if n else 0
        return all(self.cuts[i] == min(i * c, n) for i in range(w + 1))

    def local_shard_size_and_offset(self, curr_local_size, num_chunks, rank):  # type: ignore[override]
        return self._local_shard_size_and_offset(curr_local_size, num_chunks, rank)

    def _local_shard_size_and_offset(self, curr_local_size, num_chunks, rank):
        # (within > 1: the size a later TP Shard(0) divides into this rank's
        # rows; DTensor's offsets are then not ours, and nothing of ours reads
        # them: RowParam gives DCP its own, local_box)
        a, b = self.rows_of(int(rank))
        return (b - a) * self.within, a * self.within

    def _not_strided(self) -> None:
        if self.within > 1:
            raise _strided_refusal()

    # ------------------------------------------------------- data movement
    def _split_tensor(self, tensor, num_chunks, *, with_padding=True, contiguous=True):
        self._not_strided()
        most = self.largest
        out, pads = [], []
        for a, b in zip(self.cuts, self.cuts[1:]):
            t = tensor.narrow(0, a, b - a)
            if with_padding:
                pads.append(most - (b - a))
                t = _pad_rows(t, most)
            out.append(t.contiguous() if contiguous else t)
        return out, pads

    def _select_split_tensor(self, tensor, num_chunks, index, *, with_padding=True,
                             contiguous=True, clone=True):
        self._not_strided()
        a, b = self.rows_of(int(index))
        t = tensor.narrow(0, a, b - a)
        if contiguous:
            t = t.contiguous()
        return t.clone() if clone and t.data_ptr() == tensor.data_ptr() else t

    def _shard_tensor(self, tensor, mesh, mesh_dim, src_data_rank=0):
        self._not_strided()
        coord = mesh.get_coordinate()
        if coord is None:
            return tensor.new_empty(0, requires_grad=tensor.requires_grad)
        if src_data_rank is None:
            return self._select_split_tensor(tensor, 0, coord[mesh_dim])
        # the source rank's rows, scattered: all-gather-free, as Shard does it
        full = tensor.contiguous()
        group = mesh.get_group(mesh_dim)
        src = dist.get_global_rank(group, src_data_rank)
        _collective("a broadcast", mesh, mesh_dim, full.device,
                    lambda: dist.broadcast(full, src=src, group=group, async_op=True))
        return self._select_split_tensor(full, 0, coord[mesh_dim])

    def _to_replicate_tensor(self, local_tensor, mesh, mesh_dim, current_logical_shape):
        self._not_strided()
        return self.gather(local_tensor, mesh, mesh_dim)

    def gather(self, local_tensor, mesh, mesh_dim):
        """Every coordinate's rows of the mesh dim, in row order."""
        most = self.largest
        padded = _pad_rows(local_tensor, most)
        g = _gather_rows(padded, mesh, mesh_dim)
        if all(b - a == most for a, b in zip(self.cuts, self.cuts[1:])):
            return g
        return torch.cat([g.narrow(0, i * most, b - a)
                          for i, (a, b) in enumerate(zip(self.cuts, self.cuts[1:]))])

    def _replicate_to_shard(self, local_tensor, mesh, mesh_dim, shard_index):
        self._not_strided()
        a, b = self.rows_of(int(shard_index))
        return local_tensor.narrow(0, a, b - a).clone()

    def _to_new_shard_dim(self, local_tensor, mesh, mesh_dim, current_logical_shape,
                          new_shard_dim):
        self._not_strided()
        # through the full tensor: off the hot path (init, checkpoints, user calls)
        full = self._to_replicate_tensor(local_tensor, mesh, mesh_dim, current_logical_shape)
        coord = mesh.get_coordinate()[mesh_dim]
        chunks = torch.chunk(full, mesh.size(mesh_dim), dim=new_shard_dim)
        if coord < len(chunks):
            return chunks[coord].contiguous()
        shape = list(full.shape)
        shape[new_shard_dim] = 0
        return full.new_empty(shape)

    def _reduce_shard_tensor(self, tensor, mesh, reduce_op, mesh_dim):
        self._not_strided()
        full = _all_reduce(tensor, reduce_op, mesh, mesh_dim)
        a, b = self.rows_of(mesh.get_coordinate()[mesh_dim])
        return full.narrow(0, a, b - a).clone()


class _StridedRefusal(NotImplementedError):
    """DTensor tried to move the rows of a TP parameter's strided spec."""


def _strided_refusal() -> NotImplementedError:
    return _StridedRefusal(
        f"fsdp_compose [rank {_rank()}]: {_describe_doing()}: DTensor would move the rows of a "
        "tensor-parallel parameter sharded inside a unit as if the data-parallel split came "
        "before the TP one (it comes after: RowShard within TP blocks). Call .full_tensor() "
        "or .redistribute() on the parameter itself, or .to_local() for this rank's rows.")


class TPShard(Shard):
    """A TP placement ``Shard(0)`` in the spec of a parameter whose rows we
    also split (``RowShard(within=...)``): equal to ``Shard(0)``, but DTensor
    may not move data through it, since its nesting of the two splits is not
    ours (see [Note: TP parameters as RowParams]); it raises instead of
    cutting or gathering the wrong rows (or entering a collective with sizes
    that differ between ranks)."""

    def __init__(self, dim: int = 0):
        super().__init__(dim)

    def __eq__(self, other: object) -> bool:
        return Shard.__eq__(self, other)

    def __hash__(self) -> int:
        return hash(("TPShard", self.dim))

    def __reduce__(self):
        return (TPShard, (self.dim,))

    def __deepcopy__(self, memo):
        return self  # immutable

    def _split_tensor(self, *args, **kwargs):
        raise _strided_refusal()

    _select_split_tensor = _shard_tensor = _reduce_shard_tensor = _split_tensor
    _to_replicate_tensor = _replicate_to_shard = _to_new_shard_dim = _split_tensor


TPShard.__module__ = "fsdp_compose"


# ---------------------------------------------------------------- RowParam

# Calls that read metadata only: no DTensor dispatch, nothing cached
_NO_DISPATCH = frozenset({
    "__get__", "__set__", "size", "dim", "numel", "stride", "__repr__", "__format__",
    "is_contiguous", "data_ptr", "untyped_storage", "element_size", "register_hook",
    "register_post_accumulate_grad_hook", "__setstate__", "__len__", "__hash__",
    "_is_view", "is_floating_point", "is_complex", "get_device", "nelement", "ndimension",
    "__dir__",
})

# Calls that dispatch but whose result does not depend on the split: run as
# they are (``detach``, ``redistribute`` and in-place ones keep the split)
_PASS = frozenset({
    "detach", "detach_", "requires_grad_", "to_local", "full_tensor", "redistribute",
    "__eq__", "type", "__bool__",
})


# Reductions with no identity element: on an empty piece they raise on that
# rank alone while the others enter DTensor's collective (a hang). Where a
# piece is empty they run on the whole tensor instead (the same on every rank).
_NO_IDENTITY = frozenset({
    "amax", "amin", "max", "min", "argmax", "argmin", "aminmax", "median", "nanmedian",
    "mode", "kthvalue", "topk", "quantile", "nanquantile", "vector_norm", "norm",
    "linalg_vector_norm", "logsumexp", "cummax", "cummin", "msort", "sort", "argsort",
})
# Ops that reorder or pick rows: DTensor would apply them to each rank's rows
# (flip(0) of a 5/2 split is silently wrong); they run on the whole tensor.
_REORDER = frozenset({
    "flip", "flipud", "fliplr", "roll", "rot90", "index_select", "take", "gather",
    "take_along_dim", "masked_select", "nonzero", "unique", "unique_consecutive",
})


def _row_index(spec: DTensorSpec) -> int | None:
    """The mesh dim of a spec's RowShard, the dims before it ``Replicate``
    (HSDP's replicas); the dims after it, if any, are a TP parameter's own
    placements (the *tail*). None for any other placements."""
    pls = spec.placements
    for k, pl in enumerate(pls):
        if isinstance(pl, RowShard):
            return k if all(q.is_replicate() for q in pls[:k]) else None
    return None


def _rows(spec: DTensorSpec) -> RowShard | None:
    """The RowShard a spec carries (see ``_row_index``), or None."""
    k = _row_index(spec)
    return None if k is None else spec.placements[k]  # type: ignore[return-value]


def _has_tail(spec: DTensorSpec) -> bool:
    """A TP parameter's spec: placements after the RowShard that are not ``Replicate``."""
    k = _row_index(spec)
    return k is not None and any(not q.is_replicate() for q in spec.placements[k + 1:])


def _may_be_empty(spec: DTensorSpec) -> bool:
    """Some rank's piece may be empty. A TP parameter's cuts differ between
    TP coordinates where its TP blocks do (torch.chunk's): the answer must be
    the same on every rank, so for it, always."""
    pl = _rows(spec)
    return pl is not None and (pl.has_empty or _has_tail(spec))


def _uneven(t) -> bool:
    """``t`` is a RowParam with a dim whose split is not what DTensor would
    assume: not torch.chunk's, or nested in a TP parameter's placements."""
    if not isinstance(t, RowParam) or t.dim() == 0:
        return False
    pl = _rows(t._spec)
    return pl is not None and (not pl.is_chunked() or _has_tail(t._spec))


def _uneven_operand(args, kwargs) -> bool:
    return any(_uneven(t) for t in tree_leaves((args, kwargs)))


def _on_whole(func, args, kwargs):
    """``func`` on the whole tensors (each DTensor operand gathered), its
    tensor results replicated DTensors on the first RowParam's mesh: right
    for any op, on every torch (2.11's DTensor has no ``flip``), alike on
    every rank."""
    mesh = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, RowParam))._spec.mesh
    whole = tree_map_only(DTensor, lambda d: d.full_tensor(), (args, kwargs))
    out = func(*whole[0], **whole[1])
    return tree_map_only(torch.Tensor, lambda t: DTensor.from_local(
        t, mesh, [Replicate()] * mesh.ndim, run_check=False), out)


def _split_of(d: DTensor):
    """The dim-0 split a DTensor claims: ``(mesh dim, cuts, within, the
    placements after it)`` for a RowShard, or a ``Shard(0)`` over its mesh's
    last dim with the others replicated (a 1-D mesh, or HSDP's); else None."""
    spec = d._spec
    if d.dim() == 0:
        return None
    k = _row_index(spec)
    if k is not None:
        pl: Any = spec.placements[k]
        return (k, pl.cuts, pl.within, tuple(  # (TPShard(0) is Shard(0) here: by dim)
            ("S", q.dim) if isinstance(q, Shard) else repr(q) for q in spec.placements[k + 1:]))
    if not all(q.is_replicate() for q in spec.placements[:-1]):
        return None
    pl = spec.placements[-1]
    if type(pl) is Shard and pl.dim == 0:
        n, w = d.shape[0], spec.mesh.size(spec.mesh.ndim - 1)
        c = -(-n // w) if n else 0
        return (spec.mesh.ndim - 1, tuple(min(i * c, n) for i in range(w + 1)), 1, ())
    return None


def _names(ts) -> str:
    return ", ".join(sorted({getattr(t, "_fsdp_name", None) or "?" for t in ts
                             if isinstance(t, RowParam)}))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _rebuild(local, spec, requires_grad: bool, is_param: bool, extra: dict):
    t: torch.Tensor = row_param(local, spec, requires_grad)
    if is_param:
        t = torch.nn.Parameter(t, requires_grad=requires_grad)
    t.__dict__.update(extra)
    return t


# A pickle names a class or function by its module path: ``torch.save`` of a
# state dict writes these two. They are named by the package's top (which
# exports them) rather than by this file's folder, so a saved file does not
# depend on where the module lives in the package.
RowShard.__module__ = "fsdp_compose"
_rebuild.__module__ = "fsdp_compose"
_rebuild.__name__ = _rebuild.__qualname__ = "_rebuild_row_param"


def _refuse(op: str, params, why: str) -> NotImplementedError:
    return NotImplementedError(
        f"fsdp_compose [rank {_rank()}]: {op} on the sharded parameter(s) {_names(params)}: "
        f"{why}. Call .full_tensor() first (or .to_local() for this rank's rows).")


class RowParam(DTensor):
    """The DTensor class of sharded parameters, their gradients and optimizer
    state (see the module doc)."""

    _fsdp_name: str | None = None

    def __reduce_ex__(self, proto):
        # torch's pickling of a wrapper subclass reads the wrapper's storage
        # unless its data_ptr() is 0, which it is not for a local tensor with a
        # storage offset (our pieces are views into the flat shard): pickle
        # the local tensor and the spec instead.
        with _compat.no_subclass_dispatch():
            extra = {k: v for k, v in self.__dict__.items()
                     if k not in ("_local_tensor", "_spec", "_is_param")}
            return (_rebuild, (self._local_tensor, self._spec, self.requires_grad,
                               bool(self.__dict__.get("_is_param")), extra))

    # ``p.grad`` as a Python property: torch's getter and setter would reach
    # __torch_function__ (~4-6 us per call; ``zero_grad`` reads and clears
    # every parameter's ``grad`` every step); this costs about a third of it.
    # The setter also mirrors the gradient onto the local tensor (mirror_grad).
    def _get_grad(self):
        with _compat.no_subclass_dispatch():
            return _GRAD.__get__(self)

    def _set_grad(self, g):
        with _compat.no_subclass_dispatch():
            old = _GRAD.__get__(self)
            _GRAD.__set__(self, g)
            if g is None:  # (zero_grad, every parameter every step: mirror_grad inline)
                self._local_tensor.grad = None
            else:
                mirror_grad(self, g)
            if old is not None and old is not g:
                _release(old)

    def _del_grad(self):
        with _compat.no_subclass_dispatch():
            old = _GRAD.__get__(self)
            _GRAD.__delete__(self)
            mirror_grad(self, None)
            if old is not None:
                _release(old)

    grad = property(_get_grad, _set_grad, _del_grad, doc=torch.Tensor.grad.__doc__)

    # DTensor's own methods that may gather (plain Python, no __torch_function__):
    # named in the error of a collective they issue on some ranks only
    def full_tensor(self, *args, **kwargs):
        with _calling("full_tensor", self):
            if _has_tail(self._spec):
                self._untracked("full_tensor")
                return self._tp_form().full_tensor(*args, **kwargs)
            return super().full_tensor(*args, **kwargs)

    def redistribute(self, device_mesh=None, placements=None, **kwargs):
        with _calling("redistribute", self):
            if _has_tail(self._spec):
                self._untracked("redistribute")
                mesh = device_mesh if device_mesh is not None else self._spec.mesh
                if placements is not None and tuple(placements) == tuple(self._spec.placements) \
                        and mesh == self._spec.mesh:
                    return self
                if mesh != self._spec.mesh or (placements is not None and any(
                        isinstance(q, RowShard) for q in placements)):
                    raise _refuse("redistribute", [self], "another mesh, or another RowShard, "
                                  "for a tensor-parallel parameter sharded inside a unit")
                return self._tp_form().redistribute(mesh, placements, **kwargs)
            return super().redistribute(device_mesh, placements, **kwargs)

    def _untracked(self, op: str) -> None:
        """A TP parameter's ``op`` (``full_tensor`` / ``redistribute``) raises
        where autograd would track it: ``_tp_form``'s gather is not
        differentiable (loud, rather than a result that silently drops its
        gradient)."""
        if self.requires_grad and torch.is_grad_enabled():
            raise _refuse(op, [self], f"a differentiable {op}() of a tensor-parallel parameter "
                          "sharded inside a unit is not supported; call it under "
                          "torch.no_grad() or on p.detach()")

    def _tp_form(self) -> DTensor:
        """A TP parameter's rows gathered over our mesh dim: the plain DTensor
        of its TP placements (``Replicate`` on ours), on which torch's own
        data movement is right. A collective over our mesh dim."""
        spec = self._spec
        k = _row_index(spec)
        assert k is not None
        with _compat.no_subclass_dispatch():
            local = self._local_tensor.detach()
            rows = spec.placements[k].gather(local, spec.mesh, k)  # type: ignore[attr-defined]
            pls = [Shard(q.dim) if isinstance(q, TPShard) else q for q in spec.placements]
            pls[k] = Replicate()
            return DTensor.from_local(rows, spec.mesh, pls, run_check=False,
                                      shape=spec.shape, stride=spec.stride)

    # DCP reads a DTensor's place in the global tensor from these; DTensor's
    # own would nest our split before a TP one that also cuts dim 0
    def __create_write_items__(self, fqn: str, object: Any):
        with _compat.no_subclass_dispatch():
            empty = self._local_tensor.numel() == 0
        if empty and self.numel() > 0:
            # A rank holding none of the rows writes nothing: its empty chunk
            # starts where the next rank's rows do, and DCP keeps one write
            # item per (key, offset) across ranks, maybe the empty one.
            return []
        if not _has_tail(self._spec):
            return super().__create_write_items__(fqn, object)
        from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata,
                                                           MetadataIndex, TensorProperties)
        from torch.distributed.checkpoint.planner import (TensorWriteData, WriteItem,
                                                          WriteItemType)
        offsets, sizes = self._box()
        with _compat.no_subclass_dispatch():
            local = self._local_tensor
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)),
                          type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                         sizes=torch.Size(sizes)),
                              properties=TensorProperties.create_from_tensor(local),
                              size=self.size()))]

    def __create_chunk_list__(self):
        if not _has_tail(self._spec):
            return super().__create_chunk_list__()
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        offsets, sizes = self._box()
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))]

    def _box(self) -> tuple[list[int], list[int]]:
        mesh = self._spec.mesh
        return local_box(self._spec, mesh.get_coordinate() or [0] * mesh.ndim)

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        with _compat.no_subclass_dispatch():
            new = RowParam(self._local_tensor.clone(), self._spec,
                           requires_grad=self.requires_grad)
        extra = {k: v for k, v in self.__dict__.items() if k != "_is_param"}
        new.__dict__.update(copy.deepcopy(extra, memo))
        memo[id(self)] = new
        if isinstance(self, torch.nn.Parameter):  # (nn.Parameter's own deepcopy re-wraps)
            return new
        return new

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _NO_DISPATCH:  # (per step: zero_grad's p.grad reads and writes)
            out = _compat.call_without_torch_function(func, types, args, kwargs)
            if name == "__set__":
                what = getattr(func, "__self__", None)
                if what is _GRAD:
                    with _compat.no_subclass_dispatch():
                        mirror_grad(*args)
                elif what is _DATA:
                    with _compat.no_subclass_dispatch():
                        _set_data(*args)
            elif (name == "__get__" and isinstance(out, DTensor)
                  and not isinstance(out, RowParam)
                  and getattr(func, "__self__", None) is _DATA):
                # (``p.data`` is a plain DTensor of our spec: DTensor's own
                # ops on it would describe their results with torch.chunk's
                # split, silently, e.g. ``p.data.clone()``)
                with _compat.no_subclass_dispatch():
                    out = _rewrap(out, args, name, check=False)
            return out
        global _doing
        outer = _doing
        if outer is None:
            _doing = (name, args, kwargs)
        try:
            return cls._guarded(func, name, args, kwargs)
        finally:
            _doing = outer
            # (see _compat.clear_dtensor_dispatch_cache: no cached decision
            # carrying our split may outlive this call)
            _compat.clear_dtensor_dispatch_cache()

    @classmethod
    def _guarded(cls, func, name: str, args, kwargs):
        with _compat.no_subclass_dispatch():
            if name in _PASS:
                out = func(*args, **kwargs)
                if name in ("detach", "redistribute") or name.endswith("_"):
                    return _rewrap(out, args, name, check=False)
                return out
            if name == "copy_" and isinstance(args[0], RowParam):
                return copy_into_rows(args[0], args[1])
            if (name in _REORDER and _uneven_operand(args, kwargs)) or (
                    name in _NO_IDENTITY and any(
                        isinstance(t, RowParam) and _may_be_empty(t._spec)
                        for t in tree_leaves((args, kwargs)))):
                return _on_whole(func, args, kwargs)
            if name in _VIEWS and args and isinstance(args[0], RowParam) and args[0].dim() > 0:
                if _uneven(args[0]):
                    out = _meta_result(func, args, kwargs)
                    if out is not None:
                        if not _keeps_rows(args[0], out):
                            raise _refuse(name, [args[0]],
                                          "the result does not keep the rows as its dim 0")
                        if isinstance(out, torch.Tensor):
                            return _row_view(func, name, args, kwargs, out)
            if name.startswith(_FOREACH) and args and isinstance(args[0], (list, tuple)):
                return _foreach(func, name, args, kwargs)
            _precheck(name, args, kwargs)
            try:
                out = func(*args, **kwargs)
            except _StridedRefusal:
                # DTensor wanted to move a TP parameter's rows (a reduction of
                # uneven pieces, say): on the whole tensors instead, alike on
                # every rank (an in-place op must write ours: it raises)
                if name.endswith("_"):
                    raise
                return _on_whole(func, args, kwargs)
            return _rewrap(out, args, name, check=True)


def _refs(t) -> int:
    return sys.getrefcount(t)


class _Holder:
    kept: object = None


def _sole_refs() -> int:
    h = _Holder()
    h.kept = object()
    old = h.kept
    return _refs(old)


# What ``_refs`` counts in ``_release`` for a gradient wrapper that, besides
# the caller's local, only its ParamEntry holds (measured through the same
# calls, not assumed: interpreter-dependent)
_SOLE_REFS = _sole_refs()


def _release(old) -> None:
    """``p.grad`` moved on from ``old``. A gradient wrapper that its
    ParamEntry keeps for reuse (``ParamEntry._wrap_grad`` gave it
    ``_fsdp_empty``, what it holds once released) and that nothing else holds
    lets go of its rows, so that ``zero_grad`` frees the gradient shard as it
    does with plain tensors (the kept wrapper held all of them: +256 MiB of
    RSS on the memory benchmark shape). A wrapper the user kept keeps its rows."""
    empty = getattr(old, "_fsdp_empty", None)
    if empty is not None and _refs(old) <= _SOLE_REFS + 1:  # (+1: this function's argument)
        old._local_tensor = empty


def empty_like_rows(rows: torch.Tensor) -> torch.Tensor:
    """An empty tensor of ``rows``' dtype and device, one per (dtype, device)."""
    key = (rows.dtype, rows.device)
    empty = _EMPTY.get(key)
    if empty is None:
        empty = _EMPTY[key] = torch.empty(0, dtype=rows.dtype, device=rows.device)
    return empty


_EMPTY: dict = {}  # (dtype, device) -> an empty tensor, what a released wrapper holds


_DATA = _compat.TENSOR_DATA  # ``p.data = x`` calls its ``__set__``
_GRAD: Any = _compat.TENSOR_GRAD  # its getter and setter (a descriptor)

# How many times ``p.grad = g`` gave a RowParam a gradient whose local tensor
# cannot be its local tensor's ``.grad`` (another placement, shape or dtype):
# the optimizer's swap then sets every gradient itself (_local_step.py).
grad_unmirrored = 0


def mirror_grad(p, g) -> None:
    """After ``p.grad = g`` on a RowParam: its local tensor's ``.grad`` is
    ``g``'s local tensor (the same rows, no memory of its own), so that the
    optimizer's local-tensor step (_local_step.py) finds it there without a
    per-parameter loop, and ``None`` when ``g`` is (``zero_grad``)."""
    global grad_unmirrored
    if not isinstance(p, RowParam):
        return
    lt = p._local_tensor
    lg = g._local_tensor if isinstance(g, RowParam) else g
    if lg is None or type(lg) is torch.Tensor:
        try:
            lt.grad = lg  # (torch's setter checks shape, dtype and device)
            return
        except RuntimeError:
            pass
    lt.grad = None
    grad_unmirrored += 1


# Bumped whenever ``p.data =`` gives a RowParam another local tensor: the
# optimizer's cached local-tensor swap (_local_step.py) is rebuilt then.
data_epoch = 0


def _set_data(p, x) -> None:
    """``p.data = x`` set the wrapper's metadata only: a DTensor's local
    tensor and spec are Python attributes, taken from ``x`` here (else ``p``
    would silently keep its old rows)."""
    global data_epoch
    if isinstance(p, DTensor) and isinstance(x, DTensor):
        p._local_tensor, p._spec = x._local_tensor, x._spec
        data_epoch += 1


# Views and reshapes: allowed where the result keeps the rows as its dim 0
# (checked on a meta tensor of the global shape), refused otherwise.
_VIEWS = frozenset({
    "view", "reshape", "flatten", "view_as", "reshape_as", "t", "transpose", "permute",
    "unflatten", "squeeze", "unsqueeze", "movedim", "swapaxes", "swapdims", "T", "mT", "H",
    "mH", "unfold", "as_strided", "expand", "expand_as", "split", "chunk", "unbind",
    "narrow", "select", "__getitem__", "diagonal", "tensor_split", "split_with_sizes",
})


# views whose arguments name dim 0's size: re-stated with this rank's rows
_SIZED = frozenset({"view", "reshape", "expand", "view_as", "reshape_as", "expand_as",
                    "unflatten"})


def _meta_result(func, args, kwargs):
    """The op on meta tensors of the global shapes (None: it raises there)."""
    def meta(d):
        return torch.empty(d.shape, device="meta", dtype=d.dtype)
    margs, mkwargs = tree_map_only(DTensor, meta, (args, kwargs))
    try:
        return func(*margs, **mkwargs)
    except Exception:  # noqa: BLE001 - DTensor's own call raises the real error
        return None


def _keeps_rows(p: DTensor, out) -> bool:
    outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
    stride0 = torch.empty(p.shape, device="meta").stride(0)
    return bool(outs) and all(o.dim() > 0 and o.size(0) == p.size(0) and o.stride(0) == stride0
                              for o in outs)


def _row_view(func, op: str, args, kwargs, out_meta):
    """A view that keeps the rows, done on this rank's rows (DTensor would
    compute its local shape with torch.chunk's split)."""
    p: RowParam = args[0]
    if p.requires_grad and torch.is_grad_enabled():
        raise _refuse(op, [p], "a view of it that autograd would track")
    local = p._local_tensor
    if _has_tail(p._spec):
        # a TP parameter: this rank's local shape is not the global one's rows
        if tuple(out_meta.shape) != tuple(p.shape) or out_meta.stride() != p.stride():
            raise _refuse(op, [p], "a view of a tensor-parallel parameter sharded inside a "
                                   "unit that changes its shape")
        return RowParam(local.view(local.shape), p._spec, requires_grad=False)
    if op in _SIZED:
        shape = out_meta.shape
        res = local.reshape((local.size(0),) + tuple(shape[1:])) if op != "expand" \
            and op != "expand_as" else local.expand((local.size(0),) + tuple(shape[1:]))
    else:
        rest = tree_map_only(DTensor, lambda d: d._local_tensor, (args[1:], kwargs))
        res = func(local, *rest[0], **rest[1])
    spec = DTensorSpec(p._spec.mesh, p._spec.placements,
                       tensor_meta=TensorMeta(out_meta.shape, out_meta.stride(), res.dtype))
    return RowParam(res, spec, requires_grad=False)


_ROWS_FIRST = frozenset({"mm", "matmul", "__matmul__", "addmm", "bmm"})


def _precheck(op: str, args, kwargs) -> None:
    ds = [t for t in tree_leaves((args, kwargs)) if isinstance(t, DTensor)]
    splits = {s for s in map(_split_of, ds) if s is not None}
    if len(splits) > 1:
        raise _refuse(op, ds, "its operands split dim 0 differently")
    rows = [d for d in ds if _uneven(d)]
    if not rows:
        return
    # Another DTensor operand that reaches our dim 0: DTensor would cut it by
    # torch.chunk's rows to match ours (silently wrong, or a size error on
    # some ranks only). Allowed: operands that broadcast over trailing dims
    # only, and the right operand of a matmul whose left operand is ours.
    ndim = max(d.dim() for d in rows)
    for d in ds:
        if isinstance(d, RowParam) and _split_of(d) is not None or d.dim() == 0:
            continue
        if d.dim() < ndim:
            continue
        if op in _ROWS_FIRST and args and args[0] is rows[0] and d is not rows[0]:
            continue
        if op.startswith("_foreach_") and d.dim() == 0:
            continue
        raise _refuse(op, rows, f"another DTensor operand ({tuple(d.placements)}, shape "
                                f"{tuple(d.shape)}) would be split by torch.chunk's rows, not ours")


_FOREACH = ("_foreach_", "_amp_foreach_")


def _foreach(func, op: str, args, kwargs):
    """A foreach op (``torch._foreach_mul_(grads, c)``, GradScaler's unscale):
    element-wise per list index, so checked and rewrapped per index; the
    lists' tensors (different parameters) may split dim 0 differently. Lists
    that also hold plain tensors (the grads of 0-d parameters, which stay
    plain), which DTensor refuses, or DTensors of several meshes (a unit's
    and its TP parameters'), run as one call per kind: the plain indices,
    then the DTensors of each mesh (GradScaler's check: DTensor's calls then
    reduce ``found_inf`` over their meshes, the plain call's flags included)."""
    n = len(args[0])
    operands = (*args, *kwargs.values())
    lists = [a for a in operands if isinstance(a, (list, tuple)) and len(a) == n]
    rest = [a for a in operands if not any(a is lst for lst in lists)]
    cols = [[lst[i] for lst in lists] + rest for i in range(n)]
    for col in cols:
        _precheck(op, col, {})
    # one call per kind of operand: plain tensors, then the DTensors of each
    # mesh, the mesh with the most dims last (GradScaler's check reduces
    # found_inf over the mesh of its list's first DTensor only: a TP
    # parameter's (dp, tp) mesh after the unit's dp mesh, so the flag ends
    # reduced over both)
    meshes: dict = {}
    for i in range(n):
        d = next((lst[i] for lst in lists if isinstance(lst[i], DTensor)), None)
        meshes.setdefault(None if d is None else d._spec.mesh, []).append(i)
    if len(meshes) > 1:
        calls = sorted(meshes.items(), key=lambda kv: -1 if kv[0] is None else kv[0].ndim)

        def pick(a, idx):
            return type(a)(a[i] for i in idx) if any(a is lst for lst in lists) else a

        parts = [(idx, func(*[pick(a, idx) for a in args],
                            **{k: pick(v, idx) for k, v in kwargs.items()}))
                 for _, idx in calls]
        if not isinstance(parts[0][1], (list, tuple)):
            return parts[0][1]  # (in place)
        out: Any = [None] * n
        for idx, part in parts:
            for i, o in zip(idx, part):
                out[i] = o
    else:
        out = func(*args, **kwargs)
    if isinstance(out, (list, tuple)) and len(out) == n:
        return type(out)(_rewrap(o, col, op, check=True) for o, col in zip(out, cols))
    return out


def _rewrap(out, args, op: str, check: bool):
    ins = [t for t in tree_leaves(args) if isinstance(t, RowParam)]
    if not ins:
        return out
    ref = ins[0]
    k = _row_index(ref._spec)
    ref_pls = tuple(ref._spec.placements)
    uneven = k is None or _uneven(ref)
    strided = k is not None and ref_pls[k].within > 1  # type: ignore[attr-defined]

    def keeps_split(pls) -> bool:
        # our RowShard's dim stays Shard(0), the dims before it Replicate, and
        # the TP tail unchanged (or, where TP does not split dim 0, without a
        # Shard(0): a TP dim reduced or gathered keeps our rows)
        if k is None or len(pls) != len(ref_pls):
            return False
        pl = pls[k]
        if not (isinstance(pl, Shard) and pl.dim == 0
                and all(q.is_replicate() for q in pls[:k])):
            return False
        tail = tuple(pls[k + 1:])
        return tail == ref_pls[k + 1:] or (not strided and not any(
            isinstance(q, Shard) and q.dim == 0 for q in tail))

    def fix(o: DTensor):
        if isinstance(o, RowParam) or o._spec.mesh != ref._spec.mesh:
            return o
        pls = tuple(o._spec.placements)
        if not any(isinstance(q, Shard) for q in pls):
            return o  # Replicate / Partial: does not depend on the split
        if keeps_split(pls) and o.dim() > 0 and o.shape[0] == ref.shape[0]:
            # (the input's split, never the output's object: a cached decision
            # may carry another tensor's RowShard; the input's TP tail where it
            # is kept: DTensor's own Shard(0) there would let it move rows)
            assert k is not None  # (keeps_split)
            tail = ref_pls[k + 1:] if pls[k + 1:] == ref_pls[k + 1:] else pls[k + 1:]
            spec = DTensorSpec(o._spec.mesh, ref_pls[:k + 1] + tail,
                               tensor_meta=o._spec.tensor_meta)
            return _named(RowParam(o._local_tensor, spec, requires_grad=o.requires_grad), ref)
        if check and uneven:
            raise _refuse(op, ins, f"the result would be placed {pls}, of rows split "
                                   "unevenly (DTensor would describe them with torch.chunk's "
                                   "split)")
        return o

    return tree_map_only(DTensor, fix, out)


def _named(t: RowParam, like: RowParam) -> RowParam:
    name = like.__dict__.get("_fsdp_name")
    if name is not None:
        t._fsdp_name = name
    return t


def copy_into_rows(dst: RowParam, src: Any) -> RowParam:
    """``dst.copy_(src)``: each rank keeps its rows of ``src`` (a full tensor,
    or a DTensor of any placement: torchtitan's and accelerate's inits)."""
    pl = _rows(dst._spec)
    assert pl is not None
    mesh = dst._spec.mesh
    coord = mesh.get_coordinate() or [0] * mesh.ndim
    offsets, sizes = local_box(dst._spec, coord)
    with _compat.no_subclass_dispatch():
        if isinstance(src, DTensor):
            spl = tuple(src._spec.placements)
            if spl == tuple(dst._spec.placements) and _rows(src._spec) == pl \
                    and src._spec.mesh == dst._spec.mesh:
                dst._local_tensor.copy_(src._local_tensor)
                return dst
            if not all(p.is_replicate() for p in spl):
                src = src.redistribute(src.device_mesh, [Replicate()] * src.device_mesh.ndim)
            src = src._local_tensor
        if not isinstance(src, torch.Tensor):
            src = torch.as_tensor(src)
        if tuple(src.shape) != tuple(dst.shape):
            if src.dim() == 0 or tuple(src.shape) == ():
                dst._local_tensor.copy_(src)
                return dst
            try:
                fits = torch.broadcast_shapes(src.shape, dst.shape) == dst.shape
            except RuntimeError:
                fits = False
            if not fits:
                raise RuntimeError(
                    f"fsdp_compose [rank {_rank()}]: copy_ into the sharded parameter "
                    f"{dst._fsdp_name or '?'}: source shape {tuple(src.shape)}, parameter "
                    f"{tuple(dst.shape)}")
            src = src.expand(dst.shape)
        for d, (o, n) in enumerate(zip(offsets, sizes)):
            src = src.narrow(d, o, n)
        dst._local_tensor.copy_(src)
    return dst


def local_box(spec: DTensorSpec, coord: Sequence[int]) -> tuple[list[int], list[int]]:
    """``(offsets, sizes)`` of the local tensor at mesh coordinate ``coord``
    in the global tensor of a RowParam's spec: a TP placement's chunk
    (torch.chunk's, as TP shards it) first, then our rows inside it."""
    shape = list(spec.shape)
    offsets = [0] * len(shape)
    k = _row_index(spec)
    assert k is not None
    for i, pl in enumerate(spec.placements):
        if i == k or not isinstance(pl, Shard):
            continue
        d = pl.dim % len(shape)
        lo, hi = chunk_range(shape[d], spec.mesh.size(i), coord[i])
        offsets[d] += lo
        shape[d] = hi - lo
    a, b = spec.placements[k].rows_of(coord[k])  # type: ignore[attr-defined]
    if shape:
        offsets[0] += a
        shape[0] = b - a
    return offsets, shape


# ------------------------------------------------------------ construction

def row_spec(mesh, cuts: Sequence[int], shape: torch.Size, dtype: torch.dtype,
             tail: Sequence = (), stride: Sequence[int] | None = None) -> DTensorSpec:
    """Rows split by ``cuts`` over the mesh dim before the ``tail``'s (the
    last without one); replicated over the dims before it (HSDP's replica
    dim, as FSDP2 places it: ``(Replicate(), Shard(0))``). ``tail``: a TP
    parameter's own placements on the mesh's last dims, ``shape`` and
    ``stride`` its global ones, ``cuts`` over the rows of its local TP shard
    (see [Note: TP parameters as RowParams])."""
    tail = tuple(tail)
    first = mesh.ndim - len(tail)
    within = 1
    for i, q in enumerate(tail):
        if isinstance(q, Shard) and q.dim == 0:
            within *= mesh.size(first + i)
    if within > 1:  # (TP's Shard(0) there: DTensor may not move data through it)
        tail = tuple(TPShard(0) if type(q) is Shard and q.dim == 0 else q for q in tail)
    if stride is None:
        stride = torch.empty(shape, device="meta").stride()
    return DTensorSpec(mesh, (Replicate(),) * (first - 1) + (RowShard(cuts, within),) + tail,
                       tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype))


def row_param(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool = False) -> RowParam:
    """``local`` (this rank's rows) as a RowParam of ``spec`` (dtype from ``local``)."""
    meta = spec.tensor_meta
    assert meta is not None
    if local.dtype != meta.dtype:
        spec = DTensorSpec(spec.mesh, spec.placements,
                           tensor_meta=TensorMeta(meta.shape, meta.stride, local.dtype))
    with _compat.no_subclass_dispatch():
        return RowParam(local, spec, requires_grad=requires_grad)


@overload
def local_of(t: torch.Tensor) -> torch.Tensor: ...
@overload
def local_of(t: Any) -> Any: ...


def local_of(t):
    """This rank's rows of a RowParam (the object it holds); anything else
    (a plain tensor, None) unchanged."""
    return t._local_tensor if isinstance(t, RowParam) else t


def coord_of(cuts: Sequence[int], row: int) -> int:
    """The mesh coordinate whose rows hold global row ``row``."""
    return bisect_right(cuts, row) - 1


# ``torch.load``'s default (weights_only) unpickles what torch allows: FSDP2's
# DTensors load so, and ours too (their specs are made of torch's allowed classes)
torch.serialization.add_safe_globals([RowShard, TPShard, _rebuild])
