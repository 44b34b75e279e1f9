"""One original parameter inside a flat group: where its rows are, and the
tensors that show it (the sharded Parameter, the full-shape view).

``make_entries`` reads a group's layout (_layout.py, [Note: shard layout])
for one rank; ``ParamEntry.piece`` cuts a parameter's piece out of any
shard-sized buffer (the shard, the gradient shard). The flat group
(_flat_group.py) moves the data, for all its entries at once.
"""
from __future__ import annotations

import contextvars
import functools
import sys
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, DTensor, Shard

from .._base import _compat
from .._base._compat import DTensorSpec
from .._plan._layout import Layout, contiguous_stride
from ._row_dtensor import (_GRAD, RowParam, empty_like_rows, local_of, mirror_grad, row_param,
                           row_spec)

# RowParam's __torch_function__ skipped for our own per-step reads and writes
_NO_SUBCLASS_FN = _compat.no_subclass_dispatch

# A DTensor Parameter's own attributes: never copied between Parameter objects
# (the user's attributes are: see user_attrs).
_DTENSOR_OWN = frozenset({"_spec", "_local_tensor", "_is_param", "_fsdp_name"})


def user_attrs(p: torch.Tensor) -> dict:
    """The attributes a user (or a library) set on parameter ``p``."""
    return {k: v for k, v in p.__dict__.items() if k not in _DTENSOR_OWN}


class TPSpec(NamedTuple):
    """How a tensor-parallel (DTensor) parameter is re-exposed while unsharded."""

    mesh: DeviceMesh      # the DTensor's mesh (e.g. mesh["tp"])
    placements: tuple
    shape: torch.Size     # its global shape
    stride: tuple


def _data_name(t: torch.Tensor) -> str | None:
    """The name of the one inner tensor of a wrapper subclass that holds its
    values (same shape and dtype), or None."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None or not hasattr(type(t), "__tensor_unflatten__"):
        return None
    names, _ = flatten()
    found = [n for n in names if isinstance(getattr(t, n, None), torch.Tensor)
             and getattr(t, n).shape == t.shape and getattr(t, n).dtype == t.dtype]
    return found[0] if len(found) == 1 else None


def inner_data(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding a subclass instance's values."""
    return getattr(t, _data_name(t))  # type: ignore[arg-type]


class ExtSpec(NamedTuple):
    """A parameter whose class defines FSDP2's all-gather extension
    (_extension.py): while sharded it is shown as FSDP2 shows it, a DTensor
    ``Shard(0)`` over the unit's mesh, of its global shape, wrapping the
    subclass around this rank's rows."""

    mesh: DeviceMesh      # the unit's (1-D)
    shape: torch.Size     # the global shape
    stride: tuple

    def wrap(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's rows) as the DTensor FSDP2 would show."""
        return DTensor.from_local(local, self.mesh, (Shard(0),), run_check=False,
                                  shape=self.shape, stride=self.stride)


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
    # view of the local shard, shaped ``piece_shape``
    sharded: nn.Parameter = None    # type: ignore[assignment]
    # full-shape view of the unsharded flat buffer
    unsharded: torch.Tensor = None  # type: ignore[assignment]
    tp: TPSpec | None = None        # a DTensor parameter: ``shape`` is its local TP shard's
    ext: ExtSpec | None = None      # its class defines the all-gather extension (_extension.py)
    # the sharded Parameter is a RowParam DTensor of this spec (_row_dtensor.py);
    # None: a plain tensor (one rank, 0-d; docs/design.md)
    row: DTensorSpec | None = None
    # the RowParam last given as p.grad, reused when nothing else holds it
    _grad_wrapper: object = field(default=None, repr=False, compare=False)

    def new_sharded(self, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """The sharded Parameter over ``local`` (this rank's rows, a view of the shard)."""
        if self.row is None:
            return nn.Parameter(local, requires_grad=requires_grad)
        p = nn.Parameter(row_param(local, self.row), requires_grad=requires_grad)
        # nn.Parameter detached the DTensor: its local tensor became a new alias of
        # the rows with a version counter of its own. Keep ``local`` itself, so that
        # writes to the rows (the optimizer step) bump the shard's version, which
        # marks a kept unsharded flat stale (Unit: shard._version).
        p._local_tensor = local  # type: ignore[attr-defined]
        p._fsdp_name = self.fqn  # type: ignore[attr-defined]
        return p

    def set_data(self, p: torch.Tensor, local: torch.Tensor) -> None:
        """Parameter ``p`` (kept as the object) becomes a view of ``local``
        (on a RowParam, ``p.data =`` also takes the new local tensor and spec:
        ``_row_dtensor._set_data``)."""
        p.data = local if self.row is None or not isinstance(p, RowParam) \
            else row_param(local, self.row)

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @functools.cached_property
    def piece_shape(self) -> torch.Size:
        """``(rows_r, *shape[1:])``; a 0-d parameter's piece is 1-D (1 or 0
        elements: a 0-d tensor cannot be empty), see docs/design.md."""
        if not self.shape:
            return torch.Size((self.local_range[1] - self.local_range[0],))
        return torch.Size((self.rows[1] - self.rows[0],) + tuple(self.shape[1:]))

    @functools.cached_property
    def _piece_stride(self) -> tuple[int, ...]:
        """The contiguous strides of ``piece_shape``."""
        return contiguous_stride(self.piece_shape)

    def piece(self, buf: torch.Tensor) -> torch.Tensor:
        """Its part of a shard-sized ``buf``, shaped like ``sharded``: the
        same view as ``buf[a:b].view(piece_shape)``, made by one
        ``as_strided`` where ``buf`` is a contiguous 1-D tensor (per parameter
        per step, for the gradient shard: the slice and view took ~3x as long)."""
        if buf.dim() == 1 and buf.is_contiguous() and self.shard_range[1] <= buf.numel():
            return buf.as_strided(self.piece_shape, self._piece_stride,
                                  buf.storage_offset() + self.shard_range[0])
        return buf[slice(*self.shard_range)].view(self.piece_shape)

    def holds_whole(self) -> bool:
        """This rank's piece is the whole parameter, or the group does not
        shard (world size 1). Never for a DTensor parameter whose placements
        are not all ``Replicate``: the flat group holds its local TP shard."""
        return self.whole

    def set_grad(self, grad: torch.Tensor | None) -> None:
        """``p.grad`` of the sharded Parameter: ``grad`` (this rank's rows), as
        a DTensor where the Parameter is one (``row``, ``ext``). Per step, per
        parameter: no RowParam ``__torch_function__`` on the way."""
        with _NO_SUBCLASS_FN():
            if grad is not None:
                if self.row is not None:
                    grad = self._wrap_grad(grad)
                elif self.ext is not None:
                    grad = self.ext.wrap(grad)
            self.sharded.grad = grad  # (a RowParam's setter mirrors it: RowParam.grad)

    def adopt_grad(self, rows: torch.Tensor) -> None:
        """``set_grad(rows)`` where ``p.grad`` is None (the common case: the
        gradient shard after ``zero_grad``), called with RowParam's
        ``__torch_function__`` already off (``adopt_grads``): torch's own
        descriptor and the mirror inline, not the ``grad`` property (nothing
        to release: there was no gradient)."""
        p = self.sharded
        if self.row is None or not isinstance(p, RowParam):
            self.set_grad(rows)
            return
        w = self._wrap_grad(rows)
        _GRAD.__set__(p, w)
        try:  # (RowParam.grad's mirror, inline: _row_dtensor.mirror_grad)
            if type(rows) is torch.Tensor and rows.dtype == p.dtype:
                p._local_tensor.grad = rows
                return
        except RuntimeError:
            pass
        mirror_grad(p, w)

    def _wrap_grad(self, rows: torch.Tensor) -> RowParam:
        """``rows`` as a RowParam gradient. The wrapper given last time is
        reused (its local tensor replaced) when nothing but this entry holds
        it any more (``zero_grad`` dropped it and no user kept it): a new
        DTensor per parameter per step costs ~20 us, a third of the step's
        Python time on the benchmarks' overhead shape."""
        if _held_only_by(self, "_grad_wrapper"):
            w = self._grad_wrapper
            if w.dtype == rows.dtype and w.device == rows.device:  # type: ignore[attr-defined]
                w._local_tensor = rows  # type: ignore[attr-defined]
                return w  # type: ignore[return-value]
        w = (RowParam(rows, self.row, requires_grad=False)  # type: ignore[arg-type]
             if rows.dtype == self.sharded.dtype else row_param(rows, self.row))  # type: ignore[arg-type]
        w._fsdp_name = self.fqn  # (for messages)
        # (lets go of its rows, holding this instead, when p.grad moves on: _row_dtensor._release)
        w._fsdp_empty = empty_like_rows(rows)  # type: ignore[attr-defined]
        self._grad_wrapper = w
        return w

    def grad_rows(self) -> torch.Tensor | None:
        """``p.grad`` as this rank's rows (a plain tensor)."""
        with _NO_SUBCLASS_FN():
            g = self.sharded.grad
            if g is None:
                return None
            if self.row is not None:
                return local_of(g)
        return g.to_local() if isinstance(g, DTensor) else g

    def storage_ptr(self) -> int:
        """Where the sharded Parameter's data lives (its piece of the shard)."""
        t: torch.Tensor = local_of(self.sharded)
        if self.ext is not None:  # DTensor(subclass(rows)): the rows' own storage
            t = inner_data(_compat.dtensor_local(t))
        return t.untyped_storage().data_ptr()

    def is_empty(self) -> bool:
        """This rank's piece has 0 rows."""
        return self.rows[1] == self.rows[0]

    def held_elsewhere(self) -> bool:
        """This rank holds none of it and another rank holds it: ``p.grad``
        is empty here (see [Note: empty pieces] in _grad_path.py)."""
        return self.is_empty() and not self.whole


def _refs_of(holder, name: str) -> int:
    return sys.getrefcount(getattr(holder, name))


class _Probe:
    obj: object = None


_p = _Probe()
_p.obj = object()
# what _refs_of counts for an object held by one attribute alone (interpreter-
# dependent: measured through the same code, not assumed)
_SOLE = _refs_of(_p, "obj")
del _p


def adopt_grads(entries, grads) -> None:
    """``e.adopt_grad(g)`` for each entry and its gradient rows, in one block
    without RowParam's ``__torch_function__`` (every ``p.grad`` is None)."""
    with _NO_SUBCLASS_FN():
        for e, g in zip(entries, grads):
            e.adopt_grad(g)


def _held_only_by(holder, name: str) -> bool:
    """``holder.name`` is set and referenced by nothing else."""
    return getattr(holder, name) is not None and _refs_of(holder, name) <= _SOLE


def _cuts(layout: Layout, i: int) -> tuple:
    """Parameter ``i``'s rows per rank as cumulative boundaries (``W + 1``)."""
    cuts = [0] * (layout.world + 1)
    for r, a, b in layout.ranks_of(i):
        cuts[r] = a
        cuts[r + 1] = b
    for r in range(1, layout.world + 1):  # ranks holding none: an empty range
        cuts[r] = max(cuts[r], cuts[r - 1])
    return tuple(cuts)


# (unit mesh, TP mesh) -> their joined mesh, or None: made once per pair (a
# process holds a handful of meshes, alive as long as its model anyway)
_JOINED: dict = {}

# Set while FSDP2's name calls ours (``use_as_fsdp2``, _drop_in.py): sharded
# Parameters are DTensors at shard world size 1 too, as FSDP2 shows them
# (a stack such as Lightning looks for DTensor parameters to find the
# model); fsdp_compose's own ``fully_shard`` keeps plain full-shape ones
# there (docs/design.md, "World size 1: parameters keep their shape").
DTENSORS_AT_ONE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fsdp_compose_dtensors_at_one", default=False)


def _joined(mesh, tp: TPSpec):
    """The unit's mesh joined with a TP parameter's mesh (its dims then TP's),
    over which that parameter is a RowParam; None (a plain piece, as before)
    where torch cannot join them or a TP placement is neither ``Shard`` nor
    ``Replicate`` (see [Note: TP parameters as RowParams] in _row_dtensor.py)."""
    if not all(type(q) is Shard or q.is_replicate() for q in tp.placements):
        return None
    key = (mesh, tp.mesh)
    if key not in _JOINED:
        _JOINED[key] = _compat.concat_meshes([mesh, tp.mesh])
    return _JOINED[key]


def make_entries(params: list, locals_: list, layout: Layout, rank: int,
                 mesh=None) -> list[ParamEntry]:
    """This rank's ParamEntry of every parameter, from the group's layout.
    With ``mesh`` (1-D, or HSDP's 2-D; more than one rank on its shard dim,
    or any under ``DTENSORS_AT_ONE``), sharded Parameters that have a
    dimension become RowParam DTensors on it (a TP parameter on it joined
    with its TP mesh)."""
    rows_as_dtensors = (mesh is not None and mesh.ndim in (1, 2)
                        and (layout.world > 1 or DTENSORS_AT_ONE.get()))
    entries = []
    for i, ((p, slots, fqn), local) in enumerate(zip(params, locals_)):
        a, b = layout.rows_on(i, rank)
        k, off = layout.slots[i].row_numel, layout.offsets[i]
        start = layout.shard_start(i, rank)  # in the shard
        tp = (TPSpec(p.device_mesh, tuple(p.placements), p.shape, p.stride())
              if isinstance(p, DTensor) else None)
        # (a DTensor that TP does not replicate is never whole here: its piece
        # is at most its local TP shard)
        whole = ((layout.world == 1 or b - a == layout.slots[i].rows)
                 and (tp is None or all(pl.is_replicate() for pl in tp.placements)))
        row = None
        if rows_as_dtensors and len(local.shape) > 0:
            if tp is None:
                row = row_spec(mesh, _cuts(layout, i), local.shape, local.dtype)
            elif (joined := _joined(mesh, tp)) is not None:
                row = row_spec(joined, _cuts(layout, i), tp.shape, local.dtype,
                               tail=tp.placements, stride=tp.stride)
        entries.append(ParamEntry(fqn, local.shape, off, slots, (a, b), (a * k, b * k),
                                  (start, start + (b - a) * k) if b > a else (0, 0), whole,
                                  tp=tp, row=row))
    return entries
