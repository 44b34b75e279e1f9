"""State dicts in FSDP2's form, converted from and to our row layout.
Decisions and measurements: docs/design.md, "Checkpoints".

[Note: state dicts in FSDP2's form]
Training keeps our row layout ([Note: shard layout] in _layout.py); a state
dict holds what FSDP2's does (what DCP, accelerate, the Trainer, torchtitan
expect): per sharded parameter, and per per-element optimizer state of it, a
``DTensor`` of the global shape placed ``Shard(0)`` over the shard mesh
(``(Replicate(), Shard(0))`` for HSDP), rank r holding torch.chunk's rows
``[r·c, (r+1)·c)``, ``c = ceil(rows / world)``: a copy, made by one
all-to-all per tensor (``redistribute``). Loading converts back: our own form
by the all-to-all, any other DTensor by ``full_tensor()``, a full tensor by
copying this rank's rows. So ``state_dict()`` and ``load_state_dict()`` (model
and optimizer) are collectives: every rank calls them, for the same keys, in
the same order. A TP parameter is its TP DTensor (each dp rank holding the
whole TP shard); a 0-d one a ``Replicate`` DTensor; on meta (before
``to_empty``) meta DTensors and no collective; ``load_state_dict(...,
assign=True)`` into a model on meta gives it storage first.

Optimizer state: ``optimizer.state_dict()`` / ``load_state_dict()`` get a
post-hook / pre-hook, attached at the optimizer's first step by the optimizer
check in _torch_hooks.py (state loaded before it stays DTensors until that
step). Which parameters and keys exist is merged over the ranks (one object
all-gather): a rank may hold no state for a parameter whose chunk is not
empty there ([Note: empty pieces] in _grad_path.py).
"""
from __future__ import annotations

import contextlib
import math
import weakref
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._comm import _collectives

from .._plan import _layout
from .._base._common import TrainingState, rank as _rank
from .._base._job import job
from .._base._optim_kinds import steps_empty_pieces
from .._base._registry import ORIGINAL_ENTRY, REPLACED, SHARDED, state_dict_slots, units_below
from .._group._row_dtensor import RowParam, RowShard, local_of, row_param


# ------------------------------------------------------------ rows <-> chunks
def _entry_index(g, e) -> int:
    for i, x in enumerate(g.entries):
        if x is e:
            return i
    raise KeyError(e.fqn)


def rank_rows(g, e) -> list[tuple[int, int]]:
    """Per rank of ``g``'s shard group: the dim-0 rows of ``e`` it holds
    (of a 0-d parameter: its one element)."""
    i = _entry_index(g, e)
    return [g.layout.rows_on(i, r) for r in range(g.world)]


def gather_entry(g, e, piece: torch.Tensor) -> torch.Tensor:
    """Entry ``e`` whole (``e.shape``: for a TP parameter its local TP shard),
    from every rank's row piece (``piece`` is this rank's, shaped like
    ``e.sharded``, any dtype). A collective over ``g``'s shard group, unless
    the group does not shard."""
    if g.world == 1:
        return piece.reshape(e.shape)
    rows = rank_rows(g, e)
    inner = math.prod(e.shape[1:]) if e.shape else 1
    most = max(b - a for a, b in rows) * inner
    if most == 0:
        return piece.new_empty(e.shape)
    dev = g.device if g.device.type != "meta" else piece.device
    send = torch.zeros(most, dtype=piece.dtype, device=dev)
    mine = piece.reshape(-1)
    send[:mine.numel()].copy_(mine)
    out = torch.empty(g.world * most, dtype=piece.dtype, device=dev)
    _collectives.all_gather(out, send, g.pg).wait()
    parts = [out[r * most:r * most + (b - a) * inner] for r, (a, b) in enumerate(rows)]
    full = torch.cat(parts) if len(parts) > 1 else parts[0]
    return full.view(e.shape).to(piece.device)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def _empty_as_none(r: tuple[int, int]) -> tuple[int, int] | None:
    return r if r[1] > r[0] else None


def redistribute(g, e, src: torch.Tensor, src_rows: list, dst_rows: list,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's rows ``dst_rows[me]`` of entry ``e``, from every rank's rows
    ``src_rows[r]`` (``src`` is this rank's): one all-to-all over the shard
    group. Both lists partition the rows in rank order (ours: the flat buffer
    is the ranks' chunks end to end; ``Shard(0)``: torch.chunk's split), so each
    rank's outgoing and incoming segments are contiguous and in rank order: no
    copy on either side. Where both are the same partition (a function of the
    layout, the same answer on every rank), no collective. ``out``: a
    contiguous tensor to write the rows into (else a new one)."""
    me, inner = g.rank, math.prod(e.shape[1:])
    lo, hi = dst_rows[me]
    shape = (hi - lo,) + tuple(e.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=src.dtype, device=src.device)
    if all(_empty_as_none(a) == _empty_as_none(b) for a, b in zip(src_rows, dst_rows)):
        out.view(shape).copy_(src.reshape(shape))
        return out
    _collectives.all_to_all(out.view(-1), src.detach().reshape(-1).contiguous(),
                            [_overlap(src_rows[r], dst_rows[me]) * inner for r in range(g.world)],
                            [_overlap(src_rows[me], dst_rows[r]) * inner for r in range(g.world)],
                            g.pg)
    return out


def _chunks(g, e) -> list[tuple[int, int]]:
    return [_layout.chunk_range(e.shape[0], g.world, r) for r in range(g.world)]


def _placements(g) -> tuple:
    return (Replicate(),) * (g.mesh.ndim - 1) + (Shard(0),)


@contextlib.contextmanager
def shapes_only():
    """Inside: ``to_dtensor`` gives meta DTensors (the global shape, dtype,
    mesh and placements, no values) and runs no collective, so a state dict
    taken there describes what a load reads without a copy of the state
    (``load_checkpoint``'s verification). The optimizer hook's one object
    all-gather still runs (it decides which keys exist)."""
    j = job()
    old, j.shapes_only = j.shapes_only, True
    try:
        yield
    finally:
        j.shapes_only = old


def to_dtensor(g, e, piece: torch.Tensor) -> DTensor:
    """What a state dict holds for entry ``e`` (or a per-element state tensor of
    it, ``piece`` shaped like ``e.sharded``): see [Note: state dicts in FSDP2's
    form]. A collective over the shard group (none on meta, nor inside
    ``shapes_only()``, which gives meta DTensors)."""
    meta = piece.is_meta or job().shapes_only
    if e.row is not None:  # our rows as they are: no collective, no copy
        local = local_of(piece)
        if meta and not local.is_meta:
            local = torch.empty(local.shape, dtype=local.dtype, device="meta")
        return row_param(local, e.row)
    if e.tp is not None:
        local = (torch.empty(e.shape, dtype=piece.dtype, device="meta") if meta
                 else gather_entry(g, e, piece).clone())
        return DTensor.from_local(local, e.tp.mesh, e.tp.placements, run_check=False,
                                  shape=e.tp.shape, stride=e.tp.stride)
    if not e.shape:  # a 0-d parameter: replicated
        local = (torch.empty((), dtype=piece.dtype, device="meta") if meta
                 else gather_entry(g, e, piece).clone())
        return DTensor.from_local(local, g.mesh, (Replicate(),) * g.mesh.ndim, run_check=False,
                                  shape=e.shape, stride=())
    lo, hi = _layout.chunk_range(e.shape[0], g.world, g.rank)
    if meta:
        local = torch.empty((hi - lo,) + tuple(e.shape[1:]), dtype=piece.dtype, device="meta")
    else:
        local = redistribute(g, e, piece, rank_rows(g, e), _chunks(g, e))
    return DTensor.from_local(local, g.mesh, _placements(g), run_check=False,
                              shape=e.shape, stride=_layout.contiguous_stride(e.shape))


# ------------------------------------------------------- tensor parallel
# [Note: TP origin] A DTensor parameter's entry holds its local TP shard
# (``e.shape``), which sits in the global tensor (``e.tp.shape``) where
# DTensor's even chunking puts it: chunk ceil(n / T), mesh dims left to right.
def _tp_chunk(tp, coord) -> tuple[list, list]:
    """``(offsets, sizes)`` of the TP shard at mesh coordinate ``coord``."""
    off, size = [0] * len(tp.shape), list(tp.shape)
    for k, pl in enumerate(tp.placements):
        if type(pl) is Shard:
            d = pl.dim % len(size)
            lo, hi = _layout.chunk_range(size[d], tp.mesh.size(k), coord[k])
            off[d] += lo
            size[d] = hi - lo
        elif not isinstance(pl, Replicate):
            raise NotImplementedError(
                f"fsdp_compose: state dicts of a DTensor parameter with placement {pl} are not "
                "supported (only Shard(d) and Replicate).")
    return off, size


def _tp_origin(e) -> tuple | None:
    """Where this rank's local TP shard of entry ``e`` starts in the global tensor."""
    if e.tp is None:
        return None
    off, size = _tp_chunk(e.tp, e.tp.mesh.get_coordinate())
    if tuple(size) != tuple(e.shape):
        raise RuntimeError(_msg(e.fqn, f"the local TP shard has shape {tuple(e.shape)}, but "
                                f"DTensor's even chunking of {tuple(e.tp.shape)} over "
                                f"{e.tp.placements} gives {tuple(size)}."))
    return tuple(off)


def load_into(shape, local_range, value: Any, dst: torch.Tensor, *,
              tp: tuple | None = None) -> str | None:
    """Copy this rank's piece (``local_range`` of the flattened tensor) of the
    full tensor ``value`` (of ``shape``) into ``dst``. Returns what is wrong,
    or None.

    ``tp=(global_shape, origin)``: ``shape`` is a local TP shard that starts at
    ``origin`` in a tensor of ``global_shape``, which is what ``value`` holds."""
    shape = tuple(shape)
    gshape, origin = (tuple(tp[0]), tuple(tp[1])) if tp is not None else (shape, None)
    a, b = local_range
    if not isinstance(value, torch.Tensor):
        return f"expected a tensor, got {type(value).__name__}."
    if tuple(value.shape) != gshape:
        return (f"the checkpoint's tensor has shape {tuple(value.shape)}, the model's is {gshape} "
                "(pass full tensors of the global shape, or this model's state_dict()).")
    if origin is not None:  # this rank's TP shard of the full tensor
        for dim, (o, n) in enumerate(zip(origin, shape)):
            value = value.narrow(dim, o, n)
    if b > a:
        dst.copy_(value.reshape(-1)[a:b])
    return None


def _load_entry(g, e, value: Any, dst: torch.Tensor) -> str | None:
    """Copy this rank's piece of ``value`` into ``dst`` (``e``'s piece,
    flattened). ``value``: a DTensor in the form ``to_dtensor`` gives (one
    all-to-all), of other placements (``full_tensor()``, a collective over its
    mesh), ``e``'s own TP DTensor, or a full tensor of the global shape."""
    gshape = tuple(e.tp.shape) if e.tp is not None else tuple(e.shape)
    if isinstance(value, DTensor):
        if tuple(value.shape) != gshape:
            return (f"the checkpoint's tensor has shape {tuple(value.shape)}, the model's is "
                    f"{gshape}.")
        placed = tuple(value.placements)
        if any(isinstance(pl, RowShard) for pl in placed):  # (== Shard(0): tested first)
            if e.row is not None and placed == tuple(e.row.placements) \
                    and value.device_mesh == e.row.mesh:
                dst.copy_(value._local_tensor.reshape(-1))
                return None
            # another split: through the whole tensor, below
        elif (e.tp is not None and value.device_mesh == e.tp.mesh
                and placed == tuple(e.tp.placements)):
            return load_into(e.shape, e.local_range, value.to_local(), dst)
        elif (e.tp is None and e.shape and value.device_mesh == g.mesh
                and placed == _placements(g)):
            local = value.to_local()
            if local.dtype == dst.dtype and local.device == dst.device and dst.is_contiguous():
                redistribute(g, e, local, _chunks(g, e), rank_rows(g, e), out=dst)
            else:
                dst.copy_(redistribute(g, e, local, _chunks(g, e), rank_rows(g, e)).reshape(-1))
            return None
        value = value.full_tensor()
    tp = (e.tp.shape, _tp_origin(e)) if e.tp is not None else None
    return load_into(e.shape, e.local_range, value, dst, tp=tp)


# ------------------------------------------------------------ module hooks
_FULL_ATTR = "_fsdp_full"  # on get_state_dict(full)'s destination: id(entry) -> full tensor


def register_hooks(unit) -> None:
    """Called by ``fully_shard``: state-dict hooks on every module holding a
    parameter of ``unit`` (so ``state_dict()`` of any submodule works too)."""
    for g in unit.groups:
        for e in g.entries:
            for m, name in e.slots:
                slots = state_dict_slots(m)
                if slots is None:
                    slots = state_dict_slots(m, create=True)
                    m.register_state_dict_post_hook(_state_dict_hook)
                    m.register_load_state_dict_pre_hook(_load_pre_hook)
                slots[name] = (unit, g, e)  # type: ignore[index]


def _state_dict_hook(module, sd, prefix, local_metadata) -> None:
    for name, (_, g, e) in state_dict_slots(module).items():  # type: ignore[union-attr]
        key = prefix + name
        if key not in sd:
            continue
        full = getattr(sd, _FULL_ATTR, None)
        if full is not None:
            if id(e) in full:
                sd[key] = full[id(e)]
        elif e.row is None:  # (a RowParam is its own state-dict value)
            sd[key] = to_dtensor(g, e, e.sharded.detach())


def _load_pre_hook(module, sd, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                   error_msgs) -> None:
    assign = bool(local_metadata.get("assign_to_params_buffers", False))
    for name, (unit, g, e) in state_dict_slots(module).items():  # type: ignore[union-attr]
        key = prefix + name
        if key not in sd:
            continue
        if g.device.type == "meta":
            if not assign or _is_meta(sd[key]):
                error_msgs.append(_msg(key, "the model's parameters are on the meta device; call "
                                       "model.to_empty(device=...) (or fsdp_compose.materialize("
                                       "model)) before loading, or load with assign=True."))
                sd[key] = e.sharded
                continue
            old = [x.sharded for x in g.entries]
            g.materialize_(g.mesh_device)  # assign=True: storage first, then this rank's rows
            SHARDED.add_groups([g])
            for o, x in zip(old, g.entries):  # (refused if an optimizer built before holds them)
                REPLACED[o] = unit
                ORIGINAL_ENTRY[o] = weakref.ref(x)
        if module._parameters.get(name) is not e.sharded:  # full-shape views installed
            if unit.state is not TrainingState.IDLE:
                error_msgs.append(_msg(key, f"load_state_dict inside forward/backward (unit "
                                       f"'{unit.fqn}' is {unit.state.name}); load between steps."))
                continue
            unit.modules[0].reshard()  # the shard is what we load; views re-gathered on use
        with torch.no_grad():
            err = _load_entry(g, e, sd[key], local_of(e.sharded).detach().view(-1))
        if err:
            error_msgs.append(_msg(key, err))
        sd[key] = e.sharded  # the default load then copies the Parameter onto itself: no-op


def _is_meta(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.is_meta


def _msg(fqn: str, what: str) -> str:
    return f"fsdp_compose [rank {_rank()}] '{fqn}': {what}"


# ------------------------------------------------------- full state dicts
def _units(model: nn.Module) -> list:
    return [u for _, u in units_below(model)]


def _gather(g, local: torch.Tensor) -> torch.Tensor:
    """All-gather a shard-shaped tensor of group ``g`` into the padded flat layout."""
    if g.device.type == "meta":
        raise RuntimeError(_msg(g.entries[0].fqn, "parameters are on the meta device; call "
                                "fsdp_compose.materialize(model) (or model.to_empty(device=...) "
                                "and load them) first."))
    if g.world == 1:
        return local
    src = local if local.device == g.device else local.to(g.device)
    out = torch.empty(g.padded_numel, dtype=src.dtype, device=g.device)
    _collectives.all_gather(out, src, g.pg, bounds=g.gather_bounds, padded=g.padded()).wait()
    return out


def _tp_full(e, t: torch.Tensor) -> torch.Tensor:
    """The global tensor of a TP entry from its local TP shard ``t`` (a collective
    over the TP mesh; every rank of it calls this for the same entries in order)."""
    if e.tp is None:
        return t
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(t, e.tp.mesh, e.tp.placements, run_check=False,
                              shape=e.tp.shape, stride=e.tp.stride).full_tensor()


def _keep_full(t: torch.Tensor, cpu_offload: bool) -> torch.Tensor:
    return t.cpu() if cpu_offload else t


def _full_param_values(model: nn.Module, keep: bool, cpu_offload: bool) -> dict:
    """id(entry) -> full parameter, one flat group gathered at a time."""
    out = {}
    for unit in _units(model):
        for g in unit.groups:
            flat = _gather(g, g.shard.detach())
            if g.world == 1:  # not views of the live shard: a snapshot, as at any world size
                flat = flat.clone()
            for e in g.entries:
                t = _tp_full(e, flat[e.offset:e.offset + e.numel].view(e.shape))
                if keep:
                    out[id(e)] = _keep_full(t, cpu_offload)
            del flat
    return out


def _is_sharded_state(v: Any, p: torch.Tensor) -> bool:
    """An optimizer state tensor with the sharded parameter's shape is per-element
    state (exp_avg ...); anything else (step, scalars) is taken as replicated.
    (A sharded parameter is a row piece (the full shape at world size 1); a 0-d
    parameter's piece is 1-D, so its 0-d ``step`` is not mistaken for it.)"""
    if isinstance(v, RowParam):  # per-element state of a RowParam parameter
        return v.shape == p.shape
    return (isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim() >= 1
            and v.shape == local_of(p).shape)


def _state_info(optim, ents) -> list[dict]:
    """Per entry, this rank's optimizer state as ``{key: ("sharded", dtype)}``
    for per-element tensors and ``{key: ("value", v)}`` for the rest (``step``,
    Adafactor's factored statistics of a whole parameter ...)."""
    out = []
    for e in ents:
        info = {}
        for k, v in optim.state.get(e.sharded, {}).items():
            if _is_sharded_state(v, e.sharded):
                info[k] = ("sharded", v.dtype)
            else:
                info[k] = ("value", v)
        out.append(info)
    return out


def _portable(info: dict) -> dict:
    """``info`` with its tensors copied to CPU (to send to other ranks)."""
    return {k: (kind, v.detach().cpu() if isinstance(v, torch.Tensor) else v)
            for k, (kind, v) in info.items()}


def _merged_state_info(g, optim, ents) -> list[dict]:
    """``_state_info`` merged over the group's ranks (one object all-gather).

    An optimizer that needs whole tensors keeps no state for a parameter on a
    rank that holds no rows of it (see [Note: optimizers on sharded
    parameters] in _torch_hooks.py), so which keys exist, and the scalar
    values, come from the ranks that do; the key order is the first such
    rank's."""
    mine = _state_info(optim, ents)
    if g.world == 1:
        return mine
    every: list = [None] * g.world
    dist.all_gather_object(every, [_portable(i) for i in mine], group=g.pg)
    merged: list[dict] = [dict() for _ in ents]
    for r in range(g.world):  # rank order: the same merge on every rank
        for m, info in zip(merged, every[r]):
            for k, v in info.items():
                m.setdefault(k, v)
    for m, info in zip(merged, mine):  # this rank's own values where it has them
        m.update({k: v for k, v in info.items() if v[0] == "value"})
    return merged


def _full_optim_values(model: nn.Module, optim, keep: bool, cpu_offload: bool) -> dict:
    """id(entry) -> its full optimizer state ``{key: value}``, one flat group and
    per-element key gathered at a time (every rank of the group, in the same
    order: keys and their order come from the merged state of all ranks)."""
    in_optim = {p for grp in optim.param_groups for p in grp["params"]}
    out = {}
    for unit in _units(model):
        for g in unit.groups:
            ents = [e for e in g.entries if e.sharded in in_optim]
            infos = _merged_state_info(g, optim, ents)
            full: list[dict] = [dict() for _ in ents]
            keys: dict[str, torch.dtype] = {}
            for info in infos:
                for k, (kind, v) in info.items():
                    if kind == "sharded":
                        keys.setdefault(k, v)
            for k, dtype in keys.items():
                buf = torch.zeros(g.shard_numel, dtype=dtype, device=g.shard_device)
                for e in ents:
                    v = optim.state.get(e.sharded, {}).get(k)
                    if v is not None:
                        buf[slice(*e.shard_range)].copy_(local_of(v).reshape(-1))
                flat = _gather(g, buf)
                for e, info, f in zip(ents, infos, full):
                    if k in info:
                        f[k] = _tp_full(e, flat[e.offset:e.offset + e.numel].view(e.shape))
                del flat, buf
            for e, info, f in zip(ents, infos, full):
                if info and keep:
                    out[id(e)] = {k: (_keep_full(f[k], cpu_offload) if kind == "sharded"
                                      else (v.clone() if isinstance(v, torch.Tensor) else v))
                                  for k, (kind, v) in info.items()}
    return out


# ---------------------------------------------------- optimizer state dicts
def _world_group_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def optim_state_to_dtensors(optim, osd: dict) -> dict:
    """``osd`` (``optim.state_dict()``, keyed by parameter index) with the
    per-element state of every sharded parameter as DTensors in FSDP2's form
    (see [Note: state dicts in FSDP2's form]); a collective (every rank of the
    default group). Values already DTensors are left alone; the live state is
    never modified (its dicts are replaced, not written)."""
    keyed = _keyed_params(optim, osd)
    if steps_empty_pieces(optim) and all(
            (hit := SHARDED.get(p)) is None or hit[1].row is not None for _, p in keyed):
        # every sharded parameter's state is RowParams already, held on every
        # rank (an element-wise optimizer steps empty pieces too): nothing to do
        return osd
    mine: dict = {}
    for pid, p in keyed:
        hit = SHARDED.get(p)
        st = osd["state"].get(pid)
        if hit is None or st is None:
            continue
        mine[pid] = {k: (("piece", v.dtype) if _is_sharded_state(v, p)
                         else ("value", v.detach().cpu() if isinstance(v, torch.Tensor) else v))
                     for k, v in st.items()
                     if not isinstance(v, DTensor) or isinstance(v, RowParam)}
    merged = {pid: dict(info) for pid, info in mine.items()}
    if _world_group_size() > 1:
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        for theirs in every:  # rank order: the same merge on every rank
            for pid, info in theirs.items():
                m = merged.setdefault(pid, {})
                for k, v in info.items():
                    m.setdefault(k, v)
    # the same keys in the same order on every rank (parameter order, then each
    # parameter's keys in merged order): whoever walks it next (DCP, torch's
    # full state dict) issues one collective per tensor
    state = {}
    for pid, p in keyed:
        old = osd["state"].get(pid)
        if pid not in merged:
            if old is not None:
                state[pid] = old
            continue
        g, e = SHARDED.get(p)
        old = old or {}
        new: dict = {}
        for k, (kind, v) in merged[pid].items():
            if kind == "piece":
                piece = old.get(k)
                if piece is None:  # none here (a whole-tensor optimizer, 0 rows held)
                    piece = torch.zeros(e.piece_shape, dtype=v, device=p.device)
                new[k] = to_dtensor(g, e, piece.detach())
            else:
                new[k] = old[k] if k in old else (v.clone() if isinstance(v, torch.Tensor) else v)
        new.update((k, v) for k, v in old.items() if k not in new)  # (DTensors already)
        state[pid] = new
    state.update((k, v) for k, v in osd["state"].items() if k not in state)
    return {**osd, "state": state}


def optim_state_from_dtensors(optim, osd: dict) -> dict:
    """``osd`` with every DTensor (or full-shape tensor) of a sharded
    parameter's state replaced by this rank's rows; a collective where values
    are sharded DTensors (every rank, same order: by parameter index). Where
    this rank holds none of a parameter the state is as in training: empty
    for an element-wise optimizer, none for one that needs whole tensors
    (see [Note: optimizers on sharded parameters] in _torch_hooks.py).
    Values are converted into the optimizer's own tensors where they fit, so
    only a state dict whose param groups match the optimizer's (what
    ``Optimizer.load_state_dict`` checks after this hook) is converted: any
    other is left for torch to refuse, with nothing changed."""
    saved = osd.get("param_groups", [])
    if [len(gr["params"]) for gr in saved] != [len(gr["params"]) for gr in optim.param_groups]:
        return osd
    state = dict(osd.get("state", {}))
    keyed = [(pid, p, SHARDED.get(p)) for pid, p in _keyed_params(optim, osd) if pid in state]
    for pid, _p, hit in keyed:  # every shape first: nothing is written if one is wrong
        if hit is None:
            continue
        e = hit[1]
        gshape = tuple(e.tp.shape) if e.tp is not None else tuple(e.shape)
        for k, v in state[pid].items():
            if isinstance(v, DTensor) and tuple(v.shape) != gshape:
                raise ValueError(_msg(f"{e.fqn}' optimizer state '{k}", f"the checkpoint's "
                                      f"tensor has shape {tuple(v.shape)}, the model's is "
                                      f"{gshape}."))
    for pid, p, hit in keyed:
        if hit is None:
            continue
        g, e = hit
        live = optim.state.get(p, {})  # converted into where they can go (no second copy)
        new = {k: _local_state(e.fqn, k, v, p, hit, live.get(k)) for k, v in state[pid].items()}
        if e.held_elsewhere() and not steps_empty_pieces(optim):
            del state[pid]
        else:
            state[pid] = new
    return {**osd, "state": state}


def _keyed_params(optim, osd: dict) -> list:
    """``[(key in osd["state"], parameter)]`` in parameter order: the keys are
    what ``osd``'s param_groups list (indices, or FQNs from torch's
    ``set_optimizer_state_dict``), matched by position as
    ``Optimizer.load_state_dict`` does."""
    params = [p for grp in optim.param_groups for p in grp["params"]]
    keys = [k for grp in osd.get("param_groups", []) for k in grp["params"]]
    if len(keys) != len(params):
        keys = list(range(len(params)))  # (torch's load raises on the mismatch itself)
    return list(zip(keys, params))


# optimizers given the hooks: a mark on each optimizer (weak), process-wide as the object is
_ATTACHED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def attach_optimizer(optim) -> None:
    """Give ``optim`` the state-dict hooks of [Note: state dicts in FSDP2's
    form] (once), and convert state loaded before its first step."""
    if optim in _ATTACHED:
        return
    _ATTACHED.add(optim)
    optim.register_state_dict_post_hook(lambda o, sd: optim_state_to_dtensors(o, sd))
    optim.register_load_state_dict_pre_hook(lambda o, sd: optim_state_from_dtensors(o, sd))
    loaded = any(isinstance(v, DTensor) for st in optim.state.values() for v in st.values())
    if loaded:
        fixed = optim_state_from_dtensors(optim, _state_dict_unhooked(optim))
        params = [p for grp in optim.param_groups for p in grp["params"]]
        optim.state.clear()
        for pid, st in fixed["state"].items():
            optim.state[params[pid]] = st


# ------------------------------------------------- get / set state dict
def _as_list(optimizers) -> list:
    if optimizers is None:
        return []
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    optims = list(optimizers)
    for o in optims:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError("fsdp_compose: optimizers must be a torch.optim.Optimizer, a list of "
                            f"them, or [], got an element of type {type(o).__name__}.")
    return optims


def _param_fqns(model: nn.Module) -> dict:
    """Sharded (or plain) Parameter -> FQN; a tied parameter gets its first name,
    as in ``model.named_parameters()`` (and torch's DCP state_dict helpers)."""
    out: dict = {}
    for mname, m in model.named_modules():
        slots = state_dict_slots(m) or {}
        for pname, p in m._parameters.items():
            if p is None:
                continue
            if pname in slots:
                p = slots[pname][2].sharded
            if p not in out:
                out[p] = f"{mname}.{pname}" if mname else pname
    return out


def _ensure_optim_state(optim) -> None:
    """Create the optimizer's state if it has none yet (a zero-gradient step with
    lr 0), so that a checkpoint can be loaded into it in place. Parameters this
    rank holds no rows of get an empty zero gradient, as in training (see
    [Note: empty pieces] in _grad_path.py)."""
    if optim.state:
        return
    params = [p for grp in optim.param_groups for p in grp["params"]]
    if any(p.grad is not None for p in params):
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    saved = []
    for grp in optim.param_groups:
        if "lr" in grp:
            saved.append(grp["lr"])
            grp["lr"] = torch.zeros_like(grp["lr"]) if isinstance(grp["lr"], torch.Tensor) else 0.0
    try:
        optim.step()
    finally:
        for grp in optim.param_groups:
            if "lr" in grp:
                grp["lr"] = saved.pop(0)
        optim.zero_grad(set_to_none=True)


def _optim_state_dict(model, optim, fqns: dict, full: dict | None) -> dict:
    attach_optimizer(optim)
    osd = optim.state_dict() if full is None else _state_dict_unhooked(optim)
    params = [p for grp in optim.param_groups for p in grp["params"]]
    missing = [i for i, p in enumerate(params) if p not in fqns]
    if missing:
        raise ValueError(f"fsdp_compose [rank {_rank()}]: the optimizer holds "
                         f"{len(missing)} tensor(s) that are not parameters of this model "
                         f"(positions {missing[:8]} in its param_groups). Pass the model the "
                         "optimizer was built for (built after fully_shard / materialize).")
    state = {}
    for pid, p in enumerate(params):
        hit = SHARDED.get(p)
        if full is not None and hit is not None:
            # every rank's state, also where this rank keeps none (0 rows held)
            if id(hit[1]) in full:
                state[fqns[p]] = full[id(hit[1])]
            continue
        st = osd["state"].get(pid)
        if st is None:
            continue
        state[fqns[p]] = {k: (v.clone() if full is not None and isinstance(v, torch.Tensor)
                              else v)  # a full state dict is a snapshot (step is updated in place)
                          for k, v in st.items()}
    groups = [{**{k: v for k, v in grp.items() if k != "params"},
               "params": [fqns[params[i]] for i in grp["params"]]} for grp in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def _state_dict_unhooked(optim) -> dict:
    """``optim.state_dict()`` without our conversion (the full path gathers
    itself; state loaded before the first step is converted from it), its
    param_groups the optimizer's own sizes."""
    params = [p for grp in optim.param_groups for p in grp["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    groups, at = [], 0
    for grp in optim.param_groups:
        groups.append({**{k: v for k, v in grp.items() if k != "params"},
                       "params": list(range(at, at + len(grp["params"])))})
        at += len(grp["params"])
    return {"state": {index[id(p)]: st for p, st in optim.state.items() if id(p) in index},
            "param_groups": groups}


def get_state_dict(model: nn.Module, optimizers, *, full_state_dict: bool = False,
                   cpu_offload: bool = False) -> tuple[dict, dict]:
    """``(model_state_dict, optim_state_dict)`` of a sharded model, like
    ``torch.distributed.checkpoint.state_dict.get_state_dict``.

    Default (sharded): FSDP2's form (see [Note: state dicts in FSDP2's
    form]): every sharded parameter is a DTensor of its global shape placed
    ``Shard(0)`` over its shard mesh, a copy of this rank's chunk; optimizer
    state is keyed by parameter FQN, its per-element tensors (``exp_avg`` ...)
    DTensors like their parameter's, scalars such as ``step`` as they are. A
    collective (every rank calls it): pass both to
    ``torch.distributed.checkpoint.save``, or to ``.load`` and then
    ``set_state_dict``.

    ``full_state_dict=True``: plain full tensors (one all-gather per flat
    group and state key, every rank in the same order). With
    ``cpu_offload=True`` they are copied to CPU and only rank 0 keeps them
    (other ranks get empty dicts); peak device memory is one flat group.

    ``optimizers``: an optimizer, a list of them, or ``[]``. An optimizer
    with no state yet gets it (a zero-gradient step with lr 0), so that a
    checkpoint can be loaded into it.
    """
    optims = _as_list(optimizers)
    for o in optims:
        _ensure_optim_state(o)
    fqns = _param_fqns(model)
    if not full_state_dict:
        if cpu_offload:
            raise ValueError("fsdp_compose.get_state_dict: cpu_offload=True needs "
                             "full_state_dict=True (a sharded state dict is views of the shards).")
        msd = model.state_dict()
        osd = _merge([_optim_state_dict(model, o, fqns, None) for o in optims])
        return msd, osd
    keep = not cpu_offload or _rank() == 0
    values = _full_param_values(model, keep, cpu_offload)
    optim_values = [_full_optim_values(model, o, keep, cpu_offload) for o in optims]
    if not keep:
        return {}, {}
    # as state_dict() makes it, carrying the full tensors to the hook
    dest: OrderedDict = OrderedDict()
    dest._metadata = OrderedDict()  # type: ignore[attr-defined]
    setattr(dest, _FULL_ATTR, values)
    try:
        msd = model.state_dict(destination=dest)
    finally:
        delattr(dest, _FULL_ATTR)
    if cpu_offload:
        msd = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in msd.items()}
    osd = _merge([_optim_state_dict(model, o, fqns, ov) for o, ov in zip(optims, optim_values)])
    if cpu_offload:  # (no optimizers: osd is {})
        for st in osd.get("state", {}).values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    st[k] = v.cpu()
    return msd, osd


def _merge(osds: list[dict]) -> dict:
    out: dict[str, Any] = {"state": {}, "param_groups": []}
    for osd in osds:
        out["state"].update(osd["state"])
        out["param_groups"].extend(osd["param_groups"])
    return out if osds else {}


def set_state_dict(model: nn.Module, optimizers, *, model_state_dict: dict,
                   optim_state_dict: dict, strict: bool = True):
    """Load what ``get_state_dict`` returned (after ``torch.distributed.checkpoint.load``
    filled it), or full tensors (each rank copies its piece), into ``model`` and
    ``optimizers``. Like ``torch.distributed.checkpoint.state_dict.set_state_dict``.

    Returns the model's ``load_state_dict`` result (missing / unexpected keys).
    An empty ``model_state_dict`` or ``optim_state_dict`` is skipped.
    """
    optims = _as_list(optimizers)
    result = (model.load_state_dict(model_state_dict, strict=strict) if model_state_dict
              else nn.modules.module._IncompatibleKeys([], []))
    if optim_state_dict:
        fqns = _param_fqns(model)
        for o in optims:
            _load_optim(o, optim_state_dict, fqns)
    return result


def _load_optim(optim, osd: dict, fqns: dict) -> None:
    optim.load_state_dict(optim_state_from_dtensors(optim, _optim_load_dict(optim, osd, fqns)))


def _optim_load_dict(optim, osd: dict, fqns: dict) -> dict:
    """What ``optim.load_state_dict`` takes, from ``osd`` (keyed by FQN), its
    values as given (``optim_state_from_dtensors`` makes them this rank's
    rows); checks and builds without touching ``optim``, no collective."""
    if "state" not in osd or "param_groups" not in osd:
        raise ValueError("fsdp_compose.set_state_dict: optim_state_dict must have 'state' and "
                         "'param_groups' (as returned by get_state_dict).")
    loaded_state, loaded_groups = osd["state"], osd["param_groups"]
    where = {fqn: grp for grp in loaded_groups for fqn in grp["params"]}
    new_state, new_groups, pid = {}, [], 0
    for i, grp in enumerate(optim.param_groups):
        ids, src = [], None
        for p in grp["params"]:
            fqn = fqns.get(p)
            if fqn is None:
                raise ValueError(f"fsdp_compose [rank {_rank()}]: the optimizer holds a tensor "
                                 f"of shape {tuple(p.shape)} that is not a parameter of this "
                                 "model. Pass the model the optimizer was built for.")
            src = src or where.get(fqn)
            if fqn in loaded_state:  # as loaded: optim_state_from_dtensors converts
                new_state[pid] = dict(loaded_state[fqn])
            ids.append(pid)
            pid += 1
        if src is None:
            if grp["params"]:
                raise ValueError(
                    f"fsdp_compose [rank {_rank()}]: no param group of optim_state_dict holds "
                    f"'{fqns[grp['params'][0]]}' (param group {i}). The checkpoint was saved "
                    "for another model or optimizer.")
            src = loaded_groups[i] if i < len(loaded_groups) else grp
        new_groups.append({**{k: v for k, v in src.items() if k != "params"}, "params": ids})
    return {"state": new_state, "param_groups": new_groups}


def _local_state(fqn: str, key: str, v: Any, p: torch.Tensor, hit,
                 live: Any = None) -> Any:
    """This rank's piece of optimizer state ``v`` of sharded parameter ``p``:
    ``v`` itself unless it is a DTensor or a full tensor of the global shape,
    then written into ``live`` (the optimizer's current tensor for it) where
    that has the piece's shape, dtype and device, else into a new tensor."""
    if hit is None:
        return v
    g, e = hit
    gshape = tuple(e.tp.shape) if e.tp is not None else tuple(e.shape)
    shape = tuple(local_of(p).shape)  # this rank's piece
    full = (isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim() > 0
            and tuple(v.shape) == gshape and tuple(v.shape) != shape)
    if not (isinstance(v, DTensor) or full):
        return v
    dtype = v.dtype
    live = local_of(live)
    if (isinstance(live, torch.Tensor) and not isinstance(live, DTensor)
            and tuple(live.shape) == shape and live.dtype == dtype and live.device == p.device
            and live.is_contiguous()):
        dst = live
    else:
        dst = torch.empty(shape, dtype=dtype, device=p.device)
    err = _load_entry(g, e, v, dst.view(-1))
    if err:
        raise ValueError(_msg(f"{fqn}' optimizer state '{key}", err))
    return dst if e.row is None else row_param(dst, e.row)
