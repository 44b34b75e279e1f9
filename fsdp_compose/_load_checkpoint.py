"""Loading a DCP checkpoint so that a failed load changes nothing.

[Note: staged load]
``torch.distributed.checkpoint.load`` reads into the tensors of the state dict
it is given, one item after the other. Given ``get_state_dict``'s views of the
live shards (the plain recipe, which costs no memory), a load that fails half
way (a truncated or corrupted file, on any rank) has already overwritten part of
the parameters and optimizer state, on every rank that read something, and it
raises ``CheckpointException``, a ``BaseException`` that ``except Exception``
does not catch.

``load_checkpoint`` is transactional instead, in four steps:

1. *Stage* (local): a state dict of the same structure as the live one (the
   same ShardedTensor boxes, so DCP still reshards from any world size) whose
   tensors are fresh allocations on ``staging_device``.
2. *Read*: ``dcp.load`` into the staging dict, with a planner that also
   refuses a dtype that differs from the model's (DCP itself casts silently)
   and, for a file-system checkpoint, a reader that checks each item's CRC-32
   (DCP does not: a flipped byte inside a tensor loads silently). DCP turns a
   failure on any rank into a ``CheckpointException`` on every rank.
3. *Check* (local): every staged tensor is still the one we allocated (the
   checkpoint held a tensor there), and the optimizer state dicts to load are
   built (``_optim_load_dict``, which raises on a checkpoint for another
   optimizer) without touching the optimizers.
4. *Agree, then commit*: after step 1 and after steps 2-3, one object
   all-gather of each rank's error (None where it went well). If any rank
   failed, every rank raises ``CheckpointLoadError`` (a RuntimeError naming
   each failed rank and what failed) with nothing changed. Otherwise every rank
   copies the staged values into the live tensors (``model.load_state_dict``,
   whose hooks copy each rank's piece into its shard; then
   ``optimizer.load_state_dict`` with the staged state, which it adopts, or,
   staged on another device than the live state, copied into the live tensors
   first, so an accelerator's memory does not grow). The commit only copies
   and adopts values of checked keys, shapes and dtypes, so no rank
   half-applies.

Cost: the staging copy, one more copy of this rank's parameter shards,
buffers and optimizer state, held from step 1 to the commit (measured in the
README and docs/design.md). It lives on ``staging_device``, CPU by default,
so an accelerator's memory does not grow. It cannot be streamed per tensor:
atomicity needs every value read before any is applied.

An optimizer with no state yet gets it from ``get_state_dict``'s zero-gradient
lr-0 step (so that its structure can be staged); on failure that state is
removed again.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _compat
from ._checkpoint import (_as_list, _optim_load_dict, _param_fqns, _units, get_state_dict,
                          optim_state_from_dtensors)
from ._common import META_FIX, TrainingState, rank as _rank, unit_error


class CheckpointLoadError(RuntimeError):
    """``load_checkpoint`` failed on at least one rank, and changed nothing on any.

    Raised on every rank. ``failures``: ``{rank: what failed there}``; this
    rank's own exception (DCP's ``CheckpointException``, or ours) is the
    ``__cause__``."""

    def __init__(self, msg: str, failures: dict[int, str]):
        super().__init__(msg)
        self.failures = failures


def load_checkpoint(model: nn.Module, optimizers, checkpoint_id=None, *, storage_reader=None,
                    staging_device: str | torch.device = "cpu", model_key: str = "model",
                    optim_key: str = "optim") -> None:
    """Load a DCP checkpoint saved as ``{model_key: model_sd, optim_key: optim_sd}``
    (from ``get_state_dict``, at any world size) into ``model`` and
    ``optimizers``; if it fails anywhere, nothing changes anywhere.

    On any error (a truncated, corrupted or missing file, a missing key, another
    shape or dtype, missing optimizer state), on any rank, every rank raises
    :class:`CheckpointLoadError` (a ``RuntimeError``) and the parameters, buffers
    and optimizer state (tensors, ``step``, param_groups) of every rank are
    bit-identical to before. Costs one copy of this rank's state on
    ``staging_device`` during the call; see [Note: staged load].

    ``optimizers``: an optimizer, a list of them, or ``[]`` (then only
    ``model_key`` is read). ``storage_reader``: a DCP ``StorageReader``; by
    default a ``FileSystemReader`` of ``checkpoint_id`` that also checks each
    item's CRC-32. Every rank must call it (it runs DCP's collectives and two
    object all-gathers on the default process group).
    """
    if checkpoint_id is None and storage_reader is None:
        raise ValueError("fsdp_compose.load_checkpoint: pass checkpoint_id (a path) or "
                         "storage_reader.")
    optims = _as_list(optimizers)
    where = str(checkpoint_id) if checkpoint_id is not None else type(storage_reader).__name__
    fresh = [o for o in optims if not o.state]  # get_state_dict gives them state: undone on failure
    import torch.distributed.checkpoint as dcp
    stage, commit, err = None, None, None
    try:
        try:
            stage = _Stage(model, optims, staging_device, model_key, optim_key)
        except Exception as e:  # noqa: BLE001 - reported on every rank by _agree
            err = e
        _agree(err, where, "preparing the staging copy")
        step = "reading the checkpoint"
        try:
            reader = (storage_reader if storage_reader is not None
                      else _compat.crc_checked_reader(checkpoint_id))
            dcp.load(stage.sd, checkpoint_id=checkpoint_id, storage_reader=reader,
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


# ------------------------------------------------------------------ staging
class _Stage:
    """The staging state dict (``sd``) and what committing it needs."""

    def __init__(self, model, optims, device, model_key, optim_key):
        _check_loadable(model)
        self.model, self.optims, self.keys = model, optims, (model_key, optim_key)
        msd, osd = get_state_dict(model, optims)
        for i, o in enumerate(optims):
            params = [p for grp in o.param_groups for p in grp["params"]]
            if not o.state and any(p.grad is not None for p in params):
                raise ValueError(
                    f"fsdp_compose [rank {_rank()}]: optimizer {i} has no state yet and its "
                    "parameters hold gradients, so its state cannot be created to load into. "
                    "Call optimizer.zero_grad(set_to_none=True) before loading.")
        self.made: list[tuple[Any, Any, Any]] = []  # (container, key, staged value)
        self.device = torch.device(device)
        self.sd = {model_key: self._staged(msd)}
        if optims:
            self.sd[optim_key] = self._staged(osd)

    def _staged(self, value: Any) -> Any:
        """``value``'s structure with fresh tensors in place of its tensors."""
        if isinstance(value, dict):
            out = type(value)()
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
            return out if isinstance(value, list) else type(value)(out)  # (DCP cannot set into a tuple)
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
                    osd = optim_state_from_dtensors(o, osd)
                    _copy_into_live(o, osd)
                    o.load_state_dict(osd)
        return commit


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


def _dtype_checked_planner():
    """DCP's default load planner, which also refuses a dtype other than the model's."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    class _DtypeChecked(DefaultLoadPlanner):
        def create_local_plan(self):
            wrong = []
            for fqn, obj in self.state_dict.items():
                md = self.metadata.state_dict_metadata.get(fqn)
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
def _describe(err: BaseException) -> str:
    """``"rank r: Type: message"`` for each rank the error happened on."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:  # DCP's CheckpointException: every rank's
        return "; ".join(f"rank {r}: {_one(exc[0] if isinstance(exc, tuple) else exc)}"
                         for r, exc in sorted(failures.items()))
    return f"rank {_rank()}: {_one(err)}"


def _one(err: BaseException, limit: int = 600) -> str:
    text = " ".join(str(err).split()).rstrip(".")
    if len(text) > limit:
        text = text[:limit // 2] + " ... " + text[-limit // 2:]
    return f"{type(err).__name__}: {text}"


def _agree(err: BaseException | None, where: str, step: str) -> None:
    """Every rank learns every rank's error; if any, every rank raises."""
    mine = None if err is None else _describe(err)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    failed = {r: m for r, m in enumerate(every) if m is not None}
    if not failed:
        return
    what = "; ".join(dict.fromkeys(failed.values()))  # DCP's error: the same on every rank
    raise CheckpointLoadError(
        f"fsdp_compose [rank {_rank()}]: loading checkpoint '{where}' failed while {step}; "
        "nothing was loaded on any rank: the model's parameters and buffers and the "
        f"optimizer state are as they were before the call. {what}. Fix: if the checkpoint "
        "is damaged or incomplete (a truncated, corrupted or missing file), load an earlier "
        "one; if it was saved from another model or optimizer (a missing key, another shape "
        "or dtype), build the model and optimizer it was saved from."
        + (" This rank's original exception is the __cause__." if err is not None else ""),
        failed) from err
