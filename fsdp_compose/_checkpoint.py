"""State dicts and checkpoints: sharded (no communication) and full.

[Note: checkpoint boxes]
While sharded, rank r holds the flat range ``local_range = [a, b)`` of each
parameter's row-major flattening (see ``_param_entry.py``), which is a block
of whole dim-0 rows ([Note: shard layout] in _layout.py): ONE *box* (n-D
rectangle), a ``view`` of the local shard: ``shard[s:s+n].view(box_sizes)``.
(The box code takes any flat range: a flat range of a row-major tensor is a
union of at most ``2·ndim - 1`` boxes, a partial innermost row, partial rows
of the next dimension up, ..., a block of whole rows of dim 0, and the mirror
image at the end; each is contiguous in memory.)

``model.state_dict()`` therefore returns, for each sharded parameter, a
``ShardedTensor`` of the parameter's global shape whose local shards are those
box views, and whose global metadata (every rank's boxes) each rank computes
alone from the layout: rank r's range of an entry is the intersection of
``[offset, offset + numel)`` with ``[r·S, (r+1)·S)`` (every parameter is
contiguous in the unsharded flat). No collective; DCP saves
the boxes and reshards on load (it reads, for each of our boxes, the parts of
the saved chunks that overlap it, directly into the view, i.e. the shard).
Why ShardedTensor and not DCP's tensor-subclass protocol: see docs/design.md.

Optimizer state tensors that have the parameter's (local, row piece) shape get
the same treatment, keyed by the parameter's FQN like
``torch.distributed.checkpoint.state_dict``; they are flattened with
``view(-1)`` first, which is the same piece. An element-wise optimizer keeps
state for a parameter this rank holds no rows of (empty tensors and its
``step``, as every rank does under DDP: [Note: empty pieces] in
_grad_path.py); one that needs whole tensors keeps none there, so the ranks'
optimizer state dicts may hold different FQNs; DCP merges them (tested), and
full state dicts merge them with one object all-gather per flat group
(``_merged_state_info``).
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _collectives, _compat, _torch_hooks
from ._common import TrainingState, rank as _rank
from ._registry import SHARDED, state_dict_slots, units_below


# --------------------------------------------------------------------- boxes
def flat_boxes(shape: Iterable[int], start: int, end: int) -> list[tuple[tuple, tuple]]:
    """``[(offsets, sizes)]``: boxes covering elements ``[start, end)`` of a
    row-major tensor of ``shape``, in flat order (each box is contiguous)."""
    shape = tuple(shape)
    if start >= end:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = shape[1:]
    i0, r0 = divmod(start, inner)
    i1, r1 = divmod(end, inner)
    if i0 == i1:
        return [((i0,) + o, (1,) + s) for o, s in flat_boxes(rest, r0, r1)]
    out = []
    if r0:
        out += [((i0,) + o, (1,) + s) for o, s in flat_boxes(rest, r0, inner)]
        i0 += 1
    if i1 > i0:
        out.append(((i0,) + (0,) * len(rest), (i1 - i0,) + rest))
    if r1:
        out += [((i1,) + o, (1,) + s) for o, s in flat_boxes(rest, 0, r1)]
    return out


def _box_views(shape, local_range, local: torch.Tensor) -> list[tuple[tuple, tuple, torch.Tensor]]:
    """This rank's boxes of a parameter, as views of ``local`` (its piece, flattened)."""
    out, pos = [], 0
    for o, s in flat_boxes(shape, *local_range):
        n = math.prod(s)
        out.append((o, s, local[pos:pos + n].view(s)))
        pos += n
    return out


def _rank_ranges(g, e) -> list[tuple[int, int, int]]:
    """``[(group rank, a, b)]``: which ranks hold which flat range of entry ``e``."""
    S, lo, hi = g.shard_numel, e.offset, e.offset + e.numel
    return [(r, max(lo, r * S) - lo, min(hi, (r + 1) * S) - lo)
            for r in range(lo // S, (hi - 1) // S + 1)]


# ------------------------------------------------------- tensor parallel
# [Note: TP boxes] A DTensor parameter's entry holds its local TP shard
# (``e.shape``); the flat boxes of that shard are offset by where the shard
# sits in the global tensor (``e.tp.shape``), which DTensor fixes for plain
# ``Shard(d)``: an even chunking, chunk ceil(n / T), mesh dims left to right.
def _tp_chunk(tp, coord) -> tuple[list, list]:
    """``(offsets, sizes)`` of the TP shard at mesh coordinate ``coord``."""
    from torch.distributed.tensor import Replicate, Shard
    off, size = [0] * len(tp.shape), list(tp.shape)
    for k, pl in enumerate(tp.placements):
        if type(pl) is Shard:
            d = pl.dim % len(size)
            n = tp.mesh.size(k)
            chunk = -(-size[d] // n)
            lo = min(coord[k] * chunk, size[d])
            hi = min(lo + chunk, size[d])
            off[d] += lo
            size[d] = hi - lo
        elif not isinstance(pl, Replicate):
            raise NotImplementedError(
                f"fsdp_compose: state dicts of a DTensor parameter with placement {pl} are not "
                "supported (only Shard(d) and Replicate).")
    return off, size


def _tp_even(tp) -> bool:
    """Every TP rank's shard has the same shape (so the same flat layout)."""
    from torch.distributed.tensor import Shard
    size = list(tp.shape)
    for k, pl in enumerate(tp.placements):
        if type(pl) is Shard:
            d, n = pl.dim % len(size), tp.mesh.size(k)
            if size[d] % n:
                return False
            size[d] //= n
    return True


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


def _shift(boxes, origin):
    if origin is None:
        return boxes
    return [(tuple(o + x for o, x in zip(b[0], origin)),) + tuple(b[1:]) for b in boxes]


def _tp_peers(g, e) -> list[tuple[int, tuple, tuple]]:
    """``[(dp group rank, TP chunk offsets, global rank)]`` for every rank whose
    boxes of ``e`` belong in this rank's ShardedTensor metadata.

    Along ``Shard`` TP mesh dims that is every coordinate; along ``Replicate``
    dims only this rank's own (its replicas hold the same boxes; each rank lists
    its own replica set, so the metadata never overlaps and DCP, which dedups
    identical write items across ranks, saves a replicated box once and loads it
    on every rank).

    Global ranks, without a collective: the rank at (dp index r, TP coordinate
    c) is ``dp_ranks[r] + tp_mesh[c] - me``. This assumes the ranks of the
    (dp, tp) mesh form an affine grid (rank = base + Σ coordinate·stride), true
    of ``init_device_mesh`` and of any mesh made by reshaping/transposing an
    ``arange`` of ranks. (A submesh does not expose its parent's rank grid
    through a public API.) The metadata's ranks are labels: DCP plans from each
    rank's local shards, and torch only checks that the label of each of our
    own boxes is us and that every label is in the process group (the world).
    """
    import itertools

    from torch.distributed.tensor import Shard
    tp = e.tp
    me = dist.get_rank()
    dp_ranks = dist.get_process_group_ranks(g.pg)
    mine = tuple(tp.mesh.get_coordinate())
    grid = tp.mesh.mesh
    axes = [range(tp.mesh.size(k)) if type(pl) is Shard else (mine[k],)
            for k, pl in enumerate(tp.placements)]
    out = []
    for r in range(len(dp_ranks)):
        for c in itertools.product(*axes):
            off, _ = _tp_chunk(tp, c)
            out.append((r, tuple(off), dp_ranks[r] + int(grid[c]) - me))
    return out


def sharded_value(g, e, local: torch.Tensor) -> torch.Tensor:
    """What a state dict holds for parameter ``e`` (or a state tensor of it):
    a ShardedTensor of the global shape whose local shards view ``local``.
    For a TP (DTensor) parameter the boxes are those of its local TP shard,
    offset into its global shape (see [Note: TP boxes])."""
    gshape = tuple(e.tp.shape) if e.tp is not None else tuple(e.shape)
    if math.prod(gshape) == 0 or (e.tp is None and e.numel == 0):
        return local.new_empty(gshape)  # nobody holds a box of it: a (replicated) empty tensor
    if e.tp is None:
        ranks = dist.get_process_group_ranks(g.pg)
        everyone = [(o, s, ranks[r]) for r, a, b in _rank_ranges(g, e)
                    for o, s in flat_boxes(e.shape, a, b)]
        pg, me = g.pg, ranks[g.rank]
    else:
        if not _tp_even(e.tp):
            # Other TP ranks' flat layouts would differ from ours (their shards'
            # shapes do): not computable from this rank's layout alone.
            raise NotImplementedError(_msg(e.fqn, f"sharded state dict of a DTensor parameter "
                                           f"whose shape {tuple(e.tp.shape)} does not divide "
                                           f"evenly over {e.tp.placements}; use "
                                           "full_state_dict=True."))
        ranges = {r: (a, b) for r, a, b in _rank_ranges(g, e)}
        everyone = [(tuple(o + x for o, x in zip(bo, origin)), s, grank)
                    for r, origin, grank in _tp_peers(g, e) if r in ranges
                    for bo, s in flat_boxes(e.shape, *ranges[r])]
        pg, me = None, dist.get_rank()  # the world: the metadata names dp and TP ranks
    mine = _shift(_box_views(e.shape, e.local_range, local), _tp_origin(e))
    if not mine and gshape:
        # This rank holds none of it. DCP's planners drop a ShardedTensor with no
        # local shard from the rank's state dict, and a key missing on one rank
        # sends DCP's load down its pre-2.4 key path (then it fails on nested
        # keys). So hold an empty box just past the end of dim 0.
        o, s = (gshape[0],) + (0,) * (len(gshape) - 1), (0,) + tuple(gshape[1:])
        mine = [(o, s, local[:0].view(s))]
        everyone.append((o, s, me))
    st = _compat.sharded_tensor(gshape, local.dtype, mine, everyone, pg)
    st._fsdp_compose_local = (e, local)  # set_state_dict adopts ``local`` (DCP loaded into it)
    return st


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def load_into(shape, local_range, value: Any, dst: torch.Tensor, *,
              tp: tuple | None = None) -> str | None:
    """Copy this rank's piece (``local_range`` of the flattened tensor) of
    ``value`` into ``dst``. ``value``: a ShardedTensor, a replicated DTensor or
    a full tensor of ``shape``. Returns what is wrong, or None.

    ``tp=(global_shape, origin)``: ``shape`` is a local TP shard that starts at
    ``origin`` in a tensor of ``global_shape``, which is what ``value`` holds."""
    shape = tuple(shape)
    gshape, origin = (tuple(tp[0]), tuple(tp[1])) if tp is not None else (shape, None)
    a, b = local_range
    if _compat.is_sharded_tensor(value):
        theirs_shape = _compat.sharded_tensor_global_shape(value)
        if theirs_shape != gshape:
            return f"the checkpoint's tensor has shape {theirs_shape}, the model's is {gshape}."
        theirs = _compat.sharded_tensor_local_boxes(value)
        covered = 0
        for o, s, d in _shift(_box_views(shape, local_range, dst), origin):
            for so, t in theirs:
                lo = [max(x, y) for x, y in zip(o, so)]
                hi = [min(x + n, y + m) for x, n, y, m in zip(o, s, so, t.shape)]
                if any(l_ >= h for l_, h in zip(lo, hi)):
                    continue
                dv, sv = d, t
                for dim, (l_, h) in enumerate(zip(lo, hi)):
                    dv = dv.narrow(dim, l_ - o[dim], h - l_)
                    sv = sv.narrow(dim, l_ - so[dim], h - l_)
                if not _same_memory(dv, sv):  # DCP already loaded into our views
                    dv.copy_(sv)
                covered += math.prod(h - l_ for l_, h in zip(lo, hi))
        if covered != b - a:
            return ("this ShardedTensor's shards on this rank do not hold this rank's piece "
                    f"(elements [{a}, {b}) of the flattened tensor; it was made for another "
                    "layout). Load it with torch.distributed.checkpoint, which reshards, or "
                    "pass a full tensor.")
        return None
    if isinstance(value, torch.distributed.tensor.DTensor):
        if not all(p.is_replicate() for p in value.placements):
            return (f"a sharded DTensor (placements {value.placements}) holds other ranks' "
                    "pieces. Load it with torch.distributed.checkpoint, which reshards, or pass "
                    "value.full_tensor().")
        value = value.to_local()
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


def _load_entry(e, value: Any, dst: torch.Tensor) -> str | None:
    tp = (e.tp.shape, _tp_origin(e)) if e.tp is not None else None
    return load_into(e.shape, e.local_range, value, dst, tp=tp)


# ------------------------------------------------------------ module hooks
_FULL: dict | None = None  # id(entry) -> full tensor, while get_state_dict(full) runs


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
                slots[name] = (unit, g, e)


def _state_dict_hook(module, sd, prefix, local_metadata) -> None:
    for name, (_, g, e) in state_dict_slots(module).items():
        key = prefix + name
        if key not in sd:
            continue
        if _FULL is not None:
            if id(e) in _FULL:
                sd[key] = _FULL[id(e)]
        else:
            sd[key] = sharded_value(g, e, e.sharded.detach().view(-1))


def _load_pre_hook(module, sd, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                   error_msgs) -> None:
    for name, (unit, g, e) in state_dict_slots(module).items():
        key = prefix + name
        if key not in sd:
            continue
        if g.device.type == "meta":
            error_msgs.append(_msg(key, "the model's parameters are on the meta device; call "
                                   "model.to_empty(device=...) (or fsdp_compose.materialize("
                                   "model)) before loading."))
            sd[key] = e.sharded
            continue
        if module._parameters.get(name) is not e.sharded:  # full-shape views installed
            if unit.state is not TrainingState.IDLE:
                error_msgs.append(_msg(key, f"load_state_dict inside forward/backward (unit "
                                       f"'{unit.fqn}' is {unit.state.name}); load between steps."))
                continue
            unit.modules[0].reshard()  # the shard is what we load; views re-gathered on use
        with torch.no_grad():
            err = _load_entry(e, sd[key], e.sharded.detach().view(-1))
        if err:
            error_msgs.append(_msg(key, err))
        sd[key] = e.sharded  # the default load then copies the Parameter onto itself: no-op


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
    out = torch.empty(g.world * g.shard_numel, dtype=src.dtype, device=g.device)
    _collectives.all_gather(out, src, g.pg).wait()
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
    return (isinstance(v, torch.Tensor) and not _compat.is_sharded_tensor(v) and v.dim() >= 1
            and v.shape == p.shape)


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
    every = [None] * g.world
    dist.all_gather_object(every, [_portable(i) for i in mine], group=g.pg)
    merged = [dict() for _ in ents]
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
            full = [dict() for _ in ents]
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
                        buf[slice(*e.shard_range)].copy_(v.reshape(-1))
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
    osd = optim.state_dict()
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
            # every rank's state, also where this rank keeps none (empty piece)
            if id(hit[1]) in full:
                state[fqns[p]] = full[id(hit[1])]
            continue
        st = osd["state"].get(pid)
        if st is None:
            continue
        new = {}
        for k, v in st.items():
            if hit is not None and _is_sharded_state(v, p):
                g, e = hit
                new[k] = sharded_value(g, e, v.reshape(-1))
            elif full is not None and isinstance(v, torch.Tensor):
                new[k] = v.clone()  # a full state dict is a snapshot (step is updated in place)
            else:
                new[k] = v
        state[fqns[p]] = new
    groups = [{**{k: v for k, v in grp.items() if k != "params"},
               "params": [fqns[params[i]] for i in grp["params"]]} for grp in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def get_state_dict(model: nn.Module, optimizers, *, full_state_dict: bool = False,
                   cpu_offload: bool = False) -> tuple[dict, dict]:
    """``(model_state_dict, optim_state_dict)`` of a sharded model, like
    ``torch.distributed.checkpoint.state_dict.get_state_dict``.

    Default (sharded): every parameter is a ``ShardedTensor`` of its global
    shape whose local shards are views of this rank's shard; optimizer state
    is keyed by parameter FQN, and its per-element tensors (``exp_avg`` ...)
    are ShardedTensors of the parameter's shape (views of the live state);
    scalars such as ``step`` are as they are. No collective: pass both to
    ``torch.distributed.checkpoint.save``, or to ``.load`` and then
    ``set_state_dict`` (it loads in place).

    ``full_state_dict=True``: plain full tensors (one all-gather per flat
    group and state key, every rank in the same order). With
    ``cpu_offload=True`` they are copied to CPU and only rank 0 keeps them
    (other ranks get empty dicts); peak device memory is one flat group.

    ``optimizers``: an optimizer, a list of them, or ``[]``. An optimizer
    with no state yet gets it (a zero-gradient step with lr 0), so that a
    checkpoint can be loaded into it.
    """
    global _FULL
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
    _FULL = values
    try:
        msd = model.state_dict()
    finally:
        _FULL = None
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
    out = {"state": {}, "param_groups": []}
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
    optim.load_state_dict(_optim_load_dict(optim, osd, fqns))


def _optim_load_dict(optim, osd: dict, fqns: dict) -> dict:
    """What ``optim.load_state_dict`` takes, from ``osd`` (keyed by FQN); checks
    and builds without touching ``optim``."""
    if "state" not in osd or "param_groups" not in osd:
        raise ValueError("fsdp_compose.set_state_dict: optim_state_dict must have 'state' and "
                         "'param_groups' (as returned by get_state_dict).")
    loaded_state, loaded_groups = osd["state"], osd["param_groups"]
    where = {fqn: grp for grp in loaded_groups for fqn in grp["params"]}
    empty_pieces = _torch_hooks.steps_empty_pieces(optim)
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
            hit = SHARDED.get(p)
            # where this rank holds none of it, state as in training: empty tensors
            # for an element-wise optimizer, none for a whole-tensor one
            # ([Note: optimizers on sharded parameters] in _torch_hooks.py)
            if fqn in loaded_state and (empty_pieces or hit is None
                                        or not hit[1].held_elsewhere()):
                new_state[pid] = {k: _local_state(fqn, k, v, p, hit)
                                  for k, v in loaded_state[fqn].items()}
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


def _local_state(fqn: str, key: str, v: Any, p: torch.Tensor, hit) -> Any:
    if hit is None:
        return v
    g, e = hit
    sharded = _compat.is_sharded_tensor(v)
    gshape = tuple(e.tp.shape) if e.tp is not None else tuple(e.shape)
    full = isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == gshape
    if not (sharded or full):
        return v
    src = getattr(v, "_fsdp_compose_local", None) if sharded else None
    if src is not None and src[0] is e and src[1].numel() == p.numel():
        return src[1].view(p.shape)  # our own get_state_dict's tensor, filled in place by DCP
    dst = torch.empty(p.shape, dtype=v.dtype, device=p.device)
    err = _load_entry(e, v, dst.view(-1))
    if err:
        raise ValueError(_msg(f"{fqn}' optimizer state '{key}", err))
    return dst
