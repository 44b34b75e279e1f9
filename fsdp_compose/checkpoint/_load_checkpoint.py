"""Loading a DCP checkpoint so that a failed load changes nothing.
Decisions, tests and measurements: docs/design.md, "Checkpoints".

[Note: verified load]
``dcp.load`` writes item by item into the tensors it is given, so with the plain
recipe a read failing half way has overwritten part of the state on every rank
that read (and raises ``CheckpointException``, a BaseException). ``load_checkpoint``
(default) first agrees the local checks (one object all-gather), then (``_InPlace``):
1. *Describe*: ``get_state_dict`` under ``shapes_only()``, meta tensors: DCP
   plans the same reads (a reshard from any world size included), no copy.
2. *Verify* (local): ``dcp.load(no_dist=True)`` into it with the dtype-checking
   planner and the CRC-checking reader: every read of the real load, nothing kept.
3. *Agree*: every rank's error and its description's fingerprint (the batches
   and their collectives follow it); any error: every rank raises, nothing changed.
4. *Load* in batches of at most ``buffer_bytes`` (each tensor's largest chunk on
   any rank: the same batches everywhere): read, agree, write into live tensors.
A fault after verification is still found (CRC) and raised on every rank, with
``partial=True`` once a batch was written (the same tensors on every rank).

[Note: staged load]
``load_checkpoint(..., staged=True)`` has no such window, at the price of one
more copy of this rank's parameter shards, buffers and optimizer state on
``staging_device`` (CPU by default), held until the commit:
1. *Stage* (local): a state dict of the live one's structure (same placements:
   DCP still reshards) over fresh tensors on ``staging_device``.
2. *Read*: ``dcp.load`` into it (dtype-checking planner, CRC-checking reader).
3. *Check* (local): every staged tensor is still ours; the optimizer dicts build
   (``_optim_load_dict``) without touching the optimizers.
4. *Agree, then commit*: after 1 and after 2-3, one object all-gather of each
   rank's error; any: every rank raises ``CheckpointLoadError``, nothing changed.
   Else every rank converts to its rows into the shards and the live optimizer
   tensors (``_into_live``, ``_copy_into_live``), then ``load_state_dict``: only
   checked keys, shapes and dtypes are written, so no rank half-applies.

In both modes an optimizer with no state yet gets it from ``get_state_dict``'s
zero-gradient lr-0 step (so that its structure is known); on a failure that
changed nothing that state is removed again.
"""
from __future__ import annotations

import hashlib
import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from .._base import _compat
from ._checkpoint import (_as_list, _keyed_params, _load_entry, _optim_load_dict, _param_fqns,
                          _units, get_state_dict, optim_state_from_dtensors, shapes_only)
from .._base._common import META_FIX, TrainingState, rank as _rank, unit_error
from .._base._registry import SHARDED, state_dict_slots
from .._group._row_dtensor import local_of, row_param

DEFAULT_BUFFER_BYTES = 64 * 2**20


class CheckpointLoadError(RuntimeError):
    """``load_checkpoint`` failed on at least one rank; raised on every rank.

    ``failures``: ``{rank: what failed there}``; this rank's own exception
    (DCP's ``CheckpointException``, or ours) is the ``__cause__``.
    ``partial``: False (every failure that verification or staging finds):
    nothing changed on any rank. True only for a fault after verification
    (the checkpoint or its storage changed or failed in between, default
    ``staged=False`` mode) once some tensors were written: the same tensors
    on every rank hold the checkpoint's values, the rest their previous
    ones; load a checkpoint again before training on."""

    def __init__(self, msg: str, failures: dict[int, str], partial: bool = False):
        super().__init__(msg)
        self.failures = failures
        self.partial = partial


def load_checkpoint(model: nn.Module, optimizers, checkpoint_id=None, *, storage_reader=None,
                    staged: bool = False, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                    staging_device: str | torch.device = "cpu", model_key: str = "model",
                    optim_key: str = "optim") -> None:
    """Load a DCP checkpoint saved as ``{model_key: model_sd, optim_key: optim_sd}``
    (from ``get_state_dict``, at any world size) into ``model`` and
    ``optimizers``; a checkpoint that cannot be loaded changes nothing anywhere.

    Default (``staged=False``, [Note: verified load]): every rank first reads
    every item it will load (each item's CRC-32 checked), checks keys, shapes
    and dtypes, and the ranks agree; then the state is loaded in place, batch
    by batch, holding at most about ``buffer_bytes`` (plus one checkpoint item
    being decoded) besides the model and optimizer. On any error found before
    the first write (a truncated, corrupted or missing file, a missing key,
    another shape or dtype, missing optimizer state), on any rank, every rank
    raises :class:`CheckpointLoadError` (a ``RuntimeError``) and the
    parameters, buffers and optimizer state (tensors, ``step``,
    param_groups) of every rank are bit-identical to before. Not covered: the
    checkpoint or its storage changing or failing *after* verification; such
    a fault is still detected (the read is CRC-checked again) and raises
    ``CheckpointLoadError`` on every rank, with ``partial=True`` if some
    tensors were already written (the same ones on every rank); then load a
    checkpoint again. The checkpoint is read twice.

    ``staged=True`` ([Note: staged load]): read everything into one more copy
    of this rank's state on ``staging_device`` first, commit only when every
    rank read and checked it: nothing changes on any failure, also in that
    window; costs that copy for the duration of the call.

    ``optimizers``: an optimizer, a list of them, or ``[]`` (then only
    ``model_key`` is read). ``storage_reader``: a DCP ``StorageReader``; by
    default a ``FileSystemReader`` of ``checkpoint_id`` that also checks each
    item's CRC-32 (another reader is used as it is: what it does not check,
    such as flipped bytes, is not found). Every rank must call it (it runs
    collectives on the default process group and on the shard groups).
    """
    if checkpoint_id is None and storage_reader is None:
        raise ValueError("fsdp_compose.load_checkpoint: pass checkpoint_id (a path) or "
                         "storage_reader.")
    if not staged and not (isinstance(buffer_bytes, int) and buffer_bytes > 0):
        raise ValueError(f"fsdp_compose.load_checkpoint: buffer_bytes must be a positive int, "
                         f"got {buffer_bytes!r}.")
    optims = _as_list(optimizers)
    where = str(checkpoint_id) if checkpoint_id is not None else type(storage_reader).__name__
    fresh = [o for o in optims if not o.state]  # get_state_dict gives them state: undone on failure
    err: BaseException | None = None
    try:  # local, then agreed: a rank that cannot load never enters get_state_dict's collective
        _check_loadable(model)
        _check_optims_loadable(optims)
    except Exception as e:  # noqa: BLE001 - reported on every rank by _agree
        err = e
    _agree(err, where, "checking the model and optimizers")
    if staged:
        _load_staged(model, optims, checkpoint_id, storage_reader, where, fresh, staging_device,
                     model_key, optim_key)
        return
    plan: Any = None  # an _InPlace once _agree passed
    try:
        err = None
        try:
            plan = _InPlace(model, optims, model_key, optim_key, buffer_bytes)
        except Exception as e:  # noqa: BLE001 - reported on every rank by _agree
            err = e
        _agree(err, where, "preparing the load")
        err = None
        import torch.distributed.checkpoint as dcp
        try:
            plan.verify(checkpoint_id, storage_reader)
        except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - see _agree
            err = e
        _agree(err, where, "verifying the checkpoint", local=True, token=plan.fingerprint)
        plan.load(where)
    except CheckpointLoadError as e:
        if not e.partial:
            for o in fresh:
                o.state.clear()
        raise


def _reader(checkpoint_id, storage_reader):
    return (storage_reader if storage_reader is not None
            else _compat.crc_checked_reader(checkpoint_id))


def _load_staged(model, optims, checkpoint_id, storage_reader, where, fresh, staging_device,
                 model_key, optim_key) -> None:
    import torch.distributed.checkpoint as dcp
    stage: Any = None  # a _Stage once _agree passed
    commit: Any = None
    err: BaseException | None = None
    try:
        try:
            stage = _Stage(model, optims, staging_device, model_key, optim_key)
        except Exception as e:  # noqa: BLE001 - reported on every rank by _agree
            err = e
        _agree(err, where, "preparing the staging copy")
        step = "reading the checkpoint"
        try:
            dcp.load(stage.sd, checkpoint_id=checkpoint_id,
                     storage_reader=_reader(checkpoint_id, storage_reader),
                     planner=_dtype_checked_planner())
            step = "checking what was read"
            commit = stage.prepare()
        except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - see _agree
            err = e
        _agree(err, where, step)
    except CheckpointLoadError:
        for o in fresh:
            o.state.clear()
        raise
    commit()


def _check_optims_loadable(optims) -> None:
    for i, o in enumerate(optims):
        params = [p for grp in o.param_groups for p in grp["params"]]
        if not o.state and any(p.grad is not None for p in params):
            raise ValueError(
                f"fsdp_compose [rank {_rank()}]: optimizer {i} has no state yet and its "
                "parameters hold gradients, so its state cannot be created to load into. "
                "Call optimizer.zero_grad(set_to_none=True) before loading.")


# ------------------------------------------------------------ verified load
class _Leaf:
    """One tensor of the described state dict: where it sits (``container[key]``,
    ``path`` from the top), its meta description, and where its values go."""
    __slots__ = ("container", "key", "path", "meta", "live", "device", "kind", "nbytes")

    def __init__(self, container, key, path, meta, live, device, kind):
        self.container, self.key, self.path, self.meta = container, key, path, meta
        self.live, self.device, self.kind = live, device, kind
        self.nbytes = _most_local_bytes(meta)


def _most_local_bytes(t: torch.Tensor) -> int:
    """The largest local piece of ``t`` on any rank (a function of its global
    shape and placements: the same on every rank)."""
    if not isinstance(t, DTensor):
        return t.numel() * t.element_size()
    size = list(t.shape)
    for k, pl in enumerate(t.placements):
        if isinstance(pl, Shard) and size:
            d = pl.dim % len(size)
            size[d] = -(-size[d] // t.device_mesh.size(k))
    return math.prod(size) * t.element_size()


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        local = t.to_local()
        return DTensor.from_local(torch.empty(local.shape, dtype=local.dtype, device="meta"),
                                  t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _fresh_like(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(meta, DTensor):
        local = meta.to_local()
        return DTensor.from_local(torch.empty(local.shape, dtype=local.dtype, device=device),
                                  meta.device_mesh, meta.placements, run_check=False,
                                  shape=meta.shape, stride=meta.stride())
    return torch.empty(meta.shape, dtype=meta.dtype, device=device)


class _InPlace:
    """The described state dict (``sd``: meta tensors), its tensors (``leaves``)
    in state-dict order, the batches, and the load. See [Note: verified load]."""

    def __init__(self, model, optims, model_key, optim_key, buffer_bytes):
        self.model, self.optims, self.keys = model, optims, (model_key, optim_key)
        with shapes_only():
            msd, osd = get_state_dict(model, optims)
        self.fqns = _param_fqns(model)
        self.params = {fqn: p for p, fqn in self.fqns.items()}
        self.shard_device = {}  # model key -> the device of its shard
        for prefix, m in model.named_modules(remove_duplicate=False):
            for name, (_, _, e) in (state_dict_slots(m) or {}).items():
                self.shard_device[f"{prefix}.{name}" if prefix else name] = e.sharded.device
        self.leaves: list[_Leaf] = []
        self.sd = {model_key: self._describe(msd, (model_key,))}
        if optims:
            self.sd[optim_key] = self._describe(osd, (optim_key,))
        # optimizer state tensors (step ...) copied into in place; any other, or one
        # two entries share (an lr tensor shared by param groups), is replaced
        # by the read tensor only when the optimizer loads its state dict
        seen: dict[int, int] = {}
        for leaf in self.leaves:
            seen[id(leaf.live)] = seen.get(id(leaf.live), 0) + 1
        self.unshared = {i for i, n in seen.items() if n == 1}
        self.batches: list[list[_Leaf]] = []
        size = 0
        for leaf in self.leaves:
            if not self.batches or size + leaf.nbytes > buffer_bytes:
                self.batches.append([])
                size = 0
            self.batches[-1].append(leaf)
            size += leaf.nbytes
        text = repr([(leaf.path, type(leaf.meta).__name__, tuple(leaf.meta.shape),
                      str(leaf.meta.dtype)) for leaf in self.leaves])
        self.fingerprint = hashlib.sha256(text.encode()).hexdigest()

    def _describe(self, value: Any, path: tuple) -> Any:
        """``value``'s structure with meta tensors in place of its tensors; each
        tensor becomes a ``_Leaf``."""
        if isinstance(value, dict):
            out: Any = type(value)()
            if hasattr(value, "_metadata"):  # module versions, for load_state_dict
                out._metadata = value._metadata
            for k, v in value.items():
                out[k] = self._describe(v, path + (k,))
                if isinstance(v, torch.Tensor):
                    self._leaf(out, k, path + (k,), v)
            return out
        if isinstance(value, (list, tuple)):
            out = [self._describe(v, path + (i,)) for i, v in enumerate(value)]
            if isinstance(value, list):
                for i, v in enumerate(value):
                    if isinstance(v, torch.Tensor):
                        self._leaf(out, i, path + (i,), v)
            return out if isinstance(value, list) else type(value)(out)
        if isinstance(value, torch.Tensor):
            return _meta_like(value)
        return value  # DCP replaces it with the checkpoint's value

    def _leaf(self, container, key, path, value) -> None:
        model_key, optim_key = self.keys
        if type(value).__name__ == "ShardedTensor":
            raise TypeError(f"fsdp_compose [rank {_rank()}]: the state dict holds a "
                            f"ShardedTensor at {'.'.join(map(str, path))!r}, which the verified "
                            "load cannot describe; load with staged=True.")
        meta = container[key]
        ours = isinstance(value, DTensor) and value.to_local().is_meta
        if path[0] == model_key and len(path) == 2:
            kind = "model"
            device = self.shard_device.get(path[1]) if ours else value.device
        elif (ours and path[0] == optim_key and len(path) == 4 and path[1] == "state"
              and path[2] in self.params and SHARDED.get(self.params[path[2]]) is not None):
            kind = "piece"
            device = self.params[path[2]].device
        else:
            kind = "plain"
            device = value.device
        if device is None or device.type == "meta":
            raise RuntimeError(f"fsdp_compose [rank {_rank()}]: load_checkpoint cannot tell "
                               f"where the tensor at {'.'.join(map(str, path))} lives.")
        self.leaves.append(_Leaf(container, key, path, meta, value, device, kind))

    # -------------------------------------------------------------- verify
    def verify(self, checkpoint_id, storage_reader) -> None:
        """Local: DCP reads every item of this rank into the meta description
        (nothing kept but the non-tensor values); then what the commit needs is
        checked. Raises on anything wrong."""
        self.source = (checkpoint_id, _reader(checkpoint_id, storage_reader))
        _dcp_load_local(self.sd, *self.source, into_meta=True)
        for leaf in self.leaves:
            _check_kept(leaf, leaf.container[leaf.key], leaf.meta)
        optim_key = self.keys[1]
        for o in self.optims:
            _optim_load_dict(o, self.sd[optim_key], self.fqns)

    # ---------------------------------------------------------------- load
    def load(self, where: str) -> None:
        """Batch by batch: read (local), agree, write. Collectives in the same
        order on every rank: the batches and their tensors follow the
        description, whose fingerprint the ranks agreed on."""
        import torch.distributed.checkpoint as dcp
        done = 0
        for i, batch in enumerate(self.batches):
            err, staged = None, None
            try:
                staged = self._read(batch)
            except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - see _agree
                err = e
            _agree(err, where, f"reading batch {i + 1} of {len(self.batches)}, after the "
                   "checkpoint had been verified", local=True,
                   written=(done, len(self.leaves)))
            self._write(batch, staged)  # type: ignore[arg-type]
            done += len(batch)
            del staged
        self._finish()

    def _read(self, batch: list[_Leaf]) -> list[torch.Tensor]:
        sub: dict = {}
        staged = []
        for leaf in batch:
            node = sub
            for k in leaf.path[:-1]:
                node = node.setdefault(k, {})
            t = _fresh_like(leaf.meta, leaf.device)
            node[leaf.path[-1]] = t
            staged.append(t)
        _dcp_load_local(sub, *self.source)
        for leaf, t in zip(batch, staged):
            node = sub
            for k in leaf.path[:-1]:
                node = node[k]
            _check_kept(leaf, node[leaf.path[-1]], t)
        return staged

    def _write(self, batch: list[_Leaf], staged: list[torch.Tensor]) -> None:
        """Write a read batch into the live state. Cannot fail: keys, shapes and
        dtypes were verified. Collectives (the all-to-alls) in batch order."""
        msd = self.sd[self.keys[0]]
        sub = {leaf.key: t for leaf, t in zip(batch, staged) if leaf.kind == "model"}
        with torch.no_grad():
            if sub:
                if hasattr(msd, "_metadata"):
                    sub = _with_metadata(sub, msd._metadata)
                self.model.load_state_dict(sub, strict=False)
            for leaf, t in zip(batch, staged):
                if leaf.kind == "piece":
                    leaf.container[leaf.key] = _write_piece(
                        self.optims, self.params[leaf.path[2]], leaf.path[3], t)  # type: ignore[arg-type]
                elif leaf.kind == "plain":
                    live = leaf.live
                    if (leaf.path[1:2] == ("state",) and id(live) in self.unshared
                            and type(live) is type(t) and _writable(live, t.shape, t.dtype)
                            and live.device == t.device):
                        live.copy_(t)
                        leaf.container[leaf.key] = live
                    else:
                        leaf.container[leaf.key] = t

    def _finish(self) -> None:
        """The model's non-tensor entries, then each optimizer's
        ``load_state_dict`` of its live (now loaded) tensors and the
        checkpoint's param_groups, which it adopts. No collective."""
        model_key, optim_key = self.keys
        msd = self.sd[model_key]
        rest = {k: v for k, v in msd.items() if not isinstance(v, torch.Tensor)}
        if rest:
            self.model.load_state_dict(_with_metadata(rest, getattr(msd, "_metadata", {})),
                                       strict=False)
        for o in self.optims:
            osd = optim_state_from_dtensors(o, _optim_load_dict(o, self.sd[optim_key],
                                                                self.fqns))
            o.load_state_dict(osd)


def _check_kept(leaf: _Leaf, got: Any, want: torch.Tensor) -> None:
    """DCP replaces a tensor by the checkpoint's object where it holds no tensor."""
    if got is not want:
        raise ValueError(
            f"fsdp_compose [rank {_rank()}]: the checkpoint holds a {type(got).__name__} "
            f"where the model or optimizer has a tensor ({'.'.join(map(str, leaf.path))!r}).")


def _writable(live, shape, dtype) -> bool:
    return (isinstance(live, torch.Tensor) and tuple(live.shape) == tuple(shape)
            and live.dtype == dtype and live.is_contiguous())


def _with_metadata(d: dict, metadata) -> dict:
    from collections import OrderedDict
    out = OrderedDict(d)
    out._metadata = metadata  # type: ignore[attr-defined]
    return out


def _dcp_load_local(sd: dict, checkpoint_id, reader, into_meta: bool = False) -> None:
    """``dcp.load`` of ``sd`` on this rank alone (no collective), dtype-checked
    (``into_meta``: see ``_dtype_checked_planner``)."""
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a "
                                "single process")
        dcp.load(sd, checkpoint_id=checkpoint_id, storage_reader=reader,
                 planner=_dtype_checked_planner(into_meta), no_dist=True)


# ------------------------------------------------------------------ staging
class _Stage:
    """The staging state dict (``sd``) and what committing it needs."""

    def __init__(self, model, optims, device, model_key, optim_key):
        self.model, self.optims, self.keys = model, optims, (model_key, optim_key)
        with shapes_only():  # the structure, shapes and dtypes only: no copy of the state
            msd, osd = get_state_dict(model, optims)
        self.made: list[tuple[Any, Any, Any]] = []  # (container, key, staged value)
        self.device = torch.device(device)
        self.sd = {model_key: self._staged(msd)}
        if optims:
            self.sd[optim_key] = self._staged(osd)

    def _staged(self, value: Any) -> Any:
        """``value``'s structure with fresh tensors in place of its tensors."""
        if isinstance(value, dict):
            out: Any = type(value)()
            if hasattr(value, "_metadata"):  # module versions, for load_state_dict
                out._metadata = value._metadata
            for k, v in value.items():
                out[k] = self._staged(v)
                if isinstance(out[k], torch.Tensor):
                    self.made.append((out, k, out[k]))
            return out
        if isinstance(value, (list, tuple)):
            out = [self._staged(v) for v in value]
            if isinstance(value, list):
                self.made += [(out, k, v) for k, v in enumerate(out) if isinstance(v, torch.Tensor)]
            # (DCP cannot set into a tuple)
            return out if isinstance(value, list) else type(value)(out)
        if isinstance(value, torch.distributed.tensor.DTensor):
            local = value.to_local()
            return torch.distributed.tensor.DTensor.from_local(
                torch.empty(local.shape, dtype=local.dtype, device=self.device),
                value.device_mesh, value.placements, run_check=False,
                shape=value.shape, stride=value.stride())
        if isinstance(value, torch.Tensor):
            return torch.empty(value.shape, dtype=value.dtype, device=self.device)
        return value  # DCP replaces it in the staging dict with the checkpoint's value

    def prepare(self):
        """Check what DCP read (local); return the commit: the conversion to
        this rank's rows (collectives, which cannot fail: DCP checked every
        shape) and copies."""
        for container, key, staged in self.made:
            if container[key] is not staged:
                raise ValueError(
                    f"fsdp_compose [rank {_rank()}]: the checkpoint holds a "
                    f"{type(container[key]).__name__} where the model or optimizer has a tensor "
                    f"(key {key!r}).")
        model_key, optim_key = self.keys
        fqns = _param_fqns(self.model)
        loads = [_optim_load_dict(o, self.sd[optim_key], fqns) for o in self.optims]
        model, optims, msd = self.model, self.optims, self.sd[model_key]

        def commit() -> None:
            with torch.no_grad():
                model.load_state_dict(msd, strict=True)
                for o, osd in zip(optims, loads):
                    osd = optim_state_from_dtensors(o, _into_live(o, osd))
                    _copy_into_live(o, osd)
                    o.load_state_dict(osd)
        return commit


def _into_live(optim, osd: dict) -> dict:
    """``osd`` (from ``_optim_load_dict``) with each DTensor state value of a
    sharded parameter converted to this rank's rows straight into the live
    state tensor (``_write_piece``), in parameter order then key order, the
    same on every rank (the keys come from the checkpoint's structure): the
    optimizer's new state is its old tensors, not a second allocation."""
    state = dict(osd["state"])
    for pid, p in _keyed_params(optim, osd):
        if pid not in state or SHARDED.get(p) is None:
            continue
        state[pid] = {k: (_write_piece([optim], p, k, v) if isinstance(v, DTensor) else v)
                      for k, v in state[pid].items()}
    return {**osd, "state": state}


def _write_piece(optims, p, key, value: DTensor) -> torch.Tensor:
    """This rank's rows of optimizer state ``value`` (a DTensor) of sharded
    parameter ``p``, written into the live state tensor where one of that shape
    and dtype exists (else into a new one); returns it. A collective (the
    conversion's all-to-all, or ``full_tensor()`` for other placements)."""
    g, e = SHARDED.get(p)
    shape = local_of(p).shape  # this rank's rows (a RowParam's local tensor)
    live = next((o.state[p].get(key) for o in optims if p in o.state), None)
    live = local_of(live)
    dst = live if _writable(live, shape, value.dtype) else torch.empty(
        shape, dtype=value.dtype, device=p.device)
    bad = _load_entry(g, e, value, dst.view(-1))  # type: ignore[union-attr]
    if bad:  # (the shapes were checked by DCP: not expected)
        raise RuntimeError(f"fsdp_compose [rank {_rank()}] '{e.fqn}' optimizer state "
                           f"'{key}': {bad}")
    return dst if e.row is None else row_param(dst, e.row)  # type: ignore[return-value,arg-type]


def _check_loadable(model: nn.Module) -> None:
    """What would make the commit fail half way, refused before anything is read."""
    for unit in _units(model):
        if unit.state is not TrainingState.IDLE:
            raise unit_error(unit.fqn, f"load_checkpoint inside forward/backward (the unit is "
                             f"{unit.state.name}).", "Load between steps.")
        if any(g.device.type == "meta" for g in unit.groups):
            raise unit_error(unit.fqn, "its parameters are on the meta device.", META_FIX)


def _copy_into_live(optim, osd: dict) -> None:
    """Where a staged state tensor is on another device than the optimizer's own
    tensor of the same shape and dtype (CPU staging of an accelerator's state),
    copy it into that tensor and load that one, so that the accelerator's memory
    does not grow. On the same device the staged tensor itself is loaded (as
    ``optimizer.load_state_dict`` adopts the tensors it is given)."""
    params = [p for grp in optim.param_groups for p in grp["params"]]
    for pid, st in osd["state"].items():
        live = optim.state.get(params[pid], {})
        for k, v in st.items():
            old = live.get(k)
            if (isinstance(v, torch.Tensor) and isinstance(old, torch.Tensor)
                    and old.device != v.device and old.shape == v.shape
                    and old.dtype == v.dtype):
                old.copy_(v)
                st[k] = old


def _dtype_checked_planner(into_meta: bool = False):
    """DCP's default load planner, which also refuses a dtype other than the model's.

    ``into_meta``: the state dict's tensors are meta tensors that stay meta
    (the reads are performed and checked, the values dropped: a meta tensor's
    ``copy_`` does nothing); see ``_compat.dcp_flatten_state_dict``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    class _DtypeChecked(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            if not into_meta:
                return super().set_up_planner(state_dict, metadata, is_coordinator)
            # DefaultLoadPlanner's, without allocating the meta tensors
            self.original_state_dict = state_dict
            self.state_dict, self.mappings = _compat.dcp_flatten_state_dict(state_dict)
            self.metadata, self.is_coordinator = metadata, is_coordinator

        def create_local_plan(self):
            wrong = []
            for fqn, obj in self.state_dict.items():
                md = self.metadata.state_dict_metadata.get(fqn)  # type: ignore[union-attr]
                if not isinstance(md, TensorStorageMetadata):
                    continue
                if isinstance(obj, torch.Tensor):
                    dtype = obj.dtype
                else:
                    continue
                if md.properties.dtype != dtype:
                    wrong.append(f"'{fqn}' is {md.properties.dtype} in the checkpoint, "
                                 f"{dtype} here")
            if wrong:
                raise ValueError(f"dtype mismatch: {'; '.join(wrong[:4])}"
                                 f"{f' (and {len(wrong) - 4} more)' if len(wrong) > 4 else ''}. "
                                 "dcp.load would cast; load_checkpoint refuses (cast the model, "
                                 "or load with the plain recipe, which casts).")
            return super().create_local_plan()

    return _DtypeChecked()


# ------------------------------------------------------------------ agreement
def _describe(err: BaseException, local: bool = False) -> str:
    """``"rank r: Type: message"`` for each rank the error happened on
    (``local``: a ``no_dist`` DCP load, whose ``CheckpointException`` numbers
    this rank 0)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:  # DCP's CheckpointException: every rank's
        return "; ".join(f"rank {_rank() if local else r}: "
                         f"{_one(exc[0] if isinstance(exc, tuple) else exc)}"
                         for r, exc in sorted(failures.items()))
    return f"rank {_rank()}: {_one(err)}"


def _one(err: BaseException, limit: int = 600) -> str:
    text = " ".join(str(err).split()).rstrip(".")
    if len(text) > limit:
        text = text[:limit // 2] + " ... " + text[-limit // 2:]
    return f"{type(err).__name__}: {text}"


def _agree(err: BaseException | None, where: str, step: str, *, local: bool = False,
           token: str | None = None, written: tuple[int, int] | None = None) -> None:
    """Every rank learns every rank's error; if any, every rank raises.

    ``token``: what must be the same on every rank (else every rank raises).
    ``written``: ``(tensors written so far, of)``, the same on every rank; a
    failure once some were written raises with ``partial=True``."""
    mine = None if err is None else _describe(err, local)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, (mine, token))
    else:
        every = [(mine, token)]
    failed = {r: m for r, (m, _) in enumerate(every) if m is not None}
    if not failed:
        failed = {r: f"rank {r}: its model or optimizers are not rank 0's (the keys, shapes or "
                  "dtypes of their state dicts differ); build the same model and optimizers "
                  "on every rank" for r, (_, t) in enumerate(every) if t != every[0][1]}
    if not failed:
        return
    what = "; ".join(dict.fromkeys(failed.values()))  # DCP's error: the same on every rank
    cause = " This rank's original exception is the __cause__." if err is not None else ""
    if written is not None and written[0] > 0:
        raise CheckpointLoadError(
            f"fsdp_compose [rank {_rank()}]: loading checkpoint '{where}' failed while {step} "
            f"(the checkpoint or its storage changed or failed since); {written[0]} of "
            f"{written[1]} tensors had already been loaded, the same ones on every rank: the "
            "model and optimizer state is now a MIX of the checkpoint and what it was before "
            f"(param_groups unchanged): do not train on it. {what}. Fix: load a checkpoint "
            "again (this one once its storage is sound, or an earlier one): a complete load "
            "overwrites all of it. To be protected from faults after verification as well, "
            "load with staged=True (costs one more copy of this rank's state)." + cause,
            failed, partial=True) from err
    raise CheckpointLoadError(
        f"fsdp_compose [rank {_rank()}]: loading checkpoint '{where}' failed while {step}; "
        "nothing was loaded on any rank: the model's parameters and buffers and the "
        f"optimizer state are as they were before the call. {what}. Fix: if the checkpoint "
        "is damaged or incomplete (a truncated, corrupted or missing file), load an earlier "
        "one; if it was saved from another model or optimizer (a missing key, another shape "
        "or dtype), build the model and optimizer it was saved from." + cause,
        failed) from err
