"""The few private torch entry points we need, each with why (the list:
docs/design.md, "Private torch APIs"). The rest of the package uses public
torch APIs only.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
from collections.abc import Mapping
from typing import Any, Callable

import torch
# Why private: RowParam (_group/_row_dtensor.py) is a DTensor whose split is
# ours (uneven rows), which torch's public constructors cannot express: its
# spec (``DTensorSpec``, ``TensorMeta``) is built directly; the functional
# collectives are the ones DTensor's own redistribute uses; the pytree walk
# is torch's (no public pytree module in torch 2.11-2.14).
import torch.distributed._functional_collectives as funcol  # noqa: F401
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: F401
from torch.utils import _pytree
from torch.utils._pytree import tree_leaves as pytree_leaves  # noqa: F401
from torch.utils._pytree import tree_map_only  # noqa: F401

# Why private: our own reads and writes of a RowParam's internals (its local
# tensor, the flat's views, the optimizer step's swap) must not go through
# RowParam.__torch_function__ (its guard refuses ops whose result depends on
# the split, and each dispatch costs microseconds); torch has no public way
# to run an op on a subclass without its __torch_function__.
no_subclass_dispatch = torch._C.DisableTorchFunctionSubclass

# Why private: RowParam's ``.data`` and ``.grad`` are Python properties over
# torch's own C descriptors (through __torch_function__ a read costs 4-6 us,
# and zero_grad reads every parameter's): the descriptors themselves.
TENSOR_DATA = torch._C.TensorBase.data
TENSOR_GRAD: Any = torch._C.TensorBase.__dict__["grad"]


def fully_shard_homes() -> tuple:
    """The modules that hold torch's ``fully_shard``: the public
    ``torch.distributed.fsdp`` and, why private, the module torch defines it
    in (``torch.distributed.fsdp._fully_shard``), which code inside torch and
    some stacks import it from (``use_as_fsdp2`` rebinds both)."""
    import torch.distributed.fsdp as tfsdp
    import torch.distributed.fsdp._fully_shard as tfsdp_impl
    return (tfsdp, tfsdp_impl)


def queue_final_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once when the current backward pass finishes.

    Why private: autograd has no public end-of-backward hook (the root finishes
    reduce-scatters and reshards there); FSDP1/FSDP2 use the same one.
    """
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def graph_task_id() -> int:
    """The id of the backward pass running on this thread (-1: none).

    Why private: a reentrant checkpoint runs a *nested* backward; telling it
    from the outer one needs the engine's graph-task id.
    """
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    """True while the autograd engine is executing a graph on this thread.

    A forward that runs inside backward is activation-checkpoint
    recomputation (see ``graph_task_id`` for why this is private).
    """
    return graph_task_id() != -1


def will_execute(node) -> bool:
    """Whether the running backward will execute autograd ``node`` (e.g. a flat
    parameter's AccumulateGrad: will this unit get a gradient on this rank?).

    Why private: ``torch._C._will_engine_execute_node`` is the engine's own
    answer (``register_multi_grad_hook`` uses it); there is no public one. Only
    valid inside a backward, for the backward's own graph task.
    """
    return torch._C._will_engine_execute_node(node)


def default_store():
    """The default process group's store (``init_process_group``'s, behind its
    prefix). Raises ValueError without a default process group.

    Why private: diverging ranks need a channel outside the process group
    ([Note: divergence] in _divergence.py); every job has this store, and
    torch has no public getter for it.
    """
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def checkpoint_region() -> int | None:
    """An id of the innermost non-reentrant activation-checkpoint region the
    caller's forward runs in (``torch.utils.checkpoint``, also under
    ``checkpoint_wrapper`` and HF's gradient checkpointing), else None. For
    the backward's collective order (_backward_plan.py).

    Why private: the saved-tensors hooks stack is only readable through
    ``_top_saved_tensors_default_hooks``; a checkpoint region's pack hook (a
    closure per region, unlike ``save_on_cpu``'s or a user's) names it.
    """
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None or getattr(hooks[0], "__module__", None) != "torch.utils.checkpoint":
        return None
    return id(hooks[0])


_REENTRANT_FORWARD = torch.utils.checkpoint.CheckpointFunction.forward.__code__


def reentrant_checkpoint_region() -> int | None:
    """An id of the innermost reentrant activation checkpoint
    (``checkpoint(..., use_reentrant=True)``, also under ``checkpoint_wrapper``
    and HF's gradient checkpointing) whose forward is running, else None.
    Used like ``checkpoint_region``, for no-grad forwards inside training.

    Why private: such a checkpoint leaves no trace but its
    ``CheckpointFunction.forward`` frame (``sys._getframe``), whose ``ctx``
    (alive until the backward) names it.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _REENTRANT_FORWARD:
            return id(frame.f_locals.get("ctx", frame))
        frame = frame.f_back  # type: ignore[assignment]
    return None


def profiler_enabled() -> bool:
    """True while a torch profiler is recording.

    Why private: the hooks label phases only then (``record_function`` costs
    tens of microseconds per call even unrecorded); no public query exists.
    """
    return torch._C._autograd._profiler_enabled()


def tree_leaves(tree: Any) -> list:
    """Flatten outputs (tuples, dicts, NamedTuples, HF ModelOutput ...) to leaves.

    Why private: ``torch.utils._pytree`` is the registry every torch and HF
    container type registers with; torch 2.13 has no public flattener of that
    coverage. What it leaves whole (an unregistered dataclass, dict, list or
    tuple subclass) is opened too (``_children``): its tensors need hooks.
    """
    out = []
    for leaf in _pytree.tree_leaves(tree):
        kids = None if isinstance(leaf, torch.Tensor) else _children(leaf)
        if kids is None:
            out.append(leaf)
        else:
            out.extend(tree_leaves(kids))
    return out


def _children(x: Any) -> list | None:
    """The items of a container torch's pytree does not know, or None."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [getattr(x, f.name) for f in dataclasses.fields(x)]
    if isinstance(x, Mapping):
        return list(x.values())
    if isinstance(x, (list, tuple)):
        return list(x)
    return None


def tree_map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to every tensor leaf (mixed-precision casts of
    forward inputs and outputs); same registry as ``tree_leaves``, same reason.
    An unregistered dataclass or dict subclass is rebuilt around the mapped
    values (``dataclasses.replace`` / a shallow copy); other objects are left
    as they are."""
    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            fields = dataclasses.fields(x)
            new = dataclasses.replace(x, **{f.name: tree_map_tensors(fn, getattr(x, f.name))
                                            for f in fields if f.init})
            for f in fields:
                if not f.init:
                    object.__setattr__(new, f.name, tree_map_tensors(fn, getattr(x, f.name)))
            return new
        if isinstance(x, dict):
            copied = copy.copy(x)
            for k, v in x.items():
                copied[k] = tree_map_tensors(fn, v)
            return copied
        return x

    return _pytree.tree_map(leaf, tree)


def functorch_disabled():
    """A context in which functorch transforms (``torch.func.jvp``, ``vmap`` ...)
    do not intercept tensor operations (which would wrap the unit's own
    buffers: an all-gather into a wrapper without storage); a no-op when none
    is active. Why private: no public way out of a transform; FSDP2 uses it.
    """
    if torch._C._are_functorch_transforms_active():
        return torch._C._DisableFuncTorch()
    return _NULL


_NULL = contextlib.nullcontext()


def guard_torch_clip_helper(check: Callable[[Any], None]) -> Callable[[], None] | None:
    """Make torch's own ``clip_grad_norm_`` call ``check(parameters)`` before
    clipping; returns what undoes it (None: nothing was done).

    Why private: torch's ``clip_grad_norm_`` is rank-local on sharded
    parameters ([Note: torch.nn.utils.clip_grad_norm_] in _torch_hooks.py); a
    reference to it taken before the public names were routed to ours still
    looks up ``_clip_grads_with_norm_`` at call time, the one seam where that
    call can raise. The public ``torch.nn.utils.clip_grads_with_norm_`` (used
    by fsdp_compose.clip_grad_norm_) is left alone.
    """
    from torch.nn.utils import clip_grad

    helper = getattr(clip_grad, "_clip_grads_with_norm_", None)
    if helper is None or getattr(helper, "_fsdp_compose_guard", False):
        return None

    def guarded(parameters, max_norm, total_norm, foreach=None):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        check(parameters)
        return helper(parameters, max_norm, total_norm, foreach)

    guarded._fsdp_compose_guard = True  # type: ignore[attr-defined]
    clip_grad._clip_grads_with_norm_ = guarded

    def undo():
        clip_grad._clip_grads_with_norm_ = helper
    return undo


def crc_checked_reader(path) -> Any:
    """A ``torch.distributed.checkpoint.FileSystemReader`` of ``path`` that checks
    the CRC-32 of every item it reads before torch unpickles it: OSError on
    a truncated or corrupted item. Not checked: records without a CRC (stored
    as 0), items under a storage transform, and every item where the reader
    has no ``_slice_file`` (another torch version: the plain reader).

    Why private: ``torch.save`` writes the CRC-32 but neither DCP nor
    ``torch.load`` checks it; the reader's ``_slice_file`` is the one seam
    where an item's bytes pass (read whole there anyway).
    """
    import io
    import struct
    import zipfile
    import zlib

    from torch.distributed.checkpoint import FileSystemReader

    if not hasattr(FileSystemReader, "_slice_file"):
        return FileSystemReader(path)

    def check(raw: bytes) -> None:
        view = memoryview(raw)
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            for info in z.infolist():
                if not info.CRC:
                    continue
                if info.compress_type != zipfile.ZIP_STORED:
                    z.read(info)  # zipfile checks the CRC-32 (raises BadZipFile)
                    continue
                # stored: the CRC of the bytes in place (no copy); local header: 30
                # bytes, then the name and the extra field, whose lengths it holds
                h = info.header_offset
                n, m = struct.unpack("<HH", raw[h + 26:h + 30])
                start = h + 30 + n + m
                if zlib.crc32(view[start:start + info.compress_size]) != info.CRC:
                    raise zipfile.BadZipFile(f"Bad CRC-32 for file {info.filename!r}")

    class _CrcCheckedReader(FileSystemReader):
        def _slice_file(self, file, sinfo):
            if getattr(sinfo, "transform_descriptors", None):
                return super()._slice_file(file, sinfo)
            file.seek(sinfo.offset)
            raw = file.read(sinfo.length)
            where = f"'{getattr(sinfo, 'relative_path', '?')}' bytes [{sinfo.offset}, " \
                    f"{sinfo.offset + sinfo.length})"
            if len(raw) != sinfo.length:
                raise OSError(f"checkpoint file {where}: the file ends after {len(raw)} of "
                              f"these {sinfo.length} bytes (truncated).")
            try:
                check(raw)
            except zipfile.BadZipFile as e:
                raise OSError(f"checkpoint file {where}: {e} (the bytes differ from what "
                              "was written: corrupted).") from e
            return io.BytesIO(raw)

    return _CrcCheckedReader(path)


def dcp_flatten_state_dict(state_dict: dict) -> tuple[dict, dict]:
    """DCP's flattening of a nested state dict: ``(flat, mappings)``, each
    leaf under the key DCP gives it (``"optim.state.<fqn>.exp_avg"``) and that
    key's path in ``state_dict``.

    Why private: ``load_checkpoint``'s verification ([Note: verified load] in
    _load_checkpoint.py) has DCP plan this rank's reads into meta tensors;
    ``DefaultLoadPlanner.set_up_planner`` would allocate them all (the copy
    the verification avoids), so our planner does only the rest of it, this
    flattening, which must give DCP's own keys.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    return flatten_state_dict(state_dict)


def dtensor_local(t) -> torch.Tensor:
    """The local tensor object a DTensor holds (not a view of it).

    Why private: torchao's ``precompute_float8_dynamic_scale_for_fsdp`` stores
    the scale on ``weight._local_tensor``, whose ``fsdp_pre_all_gather`` the next
    all-gather must call (as FSDP2 does); ``to_local()`` of an ``nn.Parameter``
    DTensor is a fresh view without it in torch 2.13 (gh-166156).
    """
    return t._local_tensor


# DTensor's C++ dispatch caches sharding decisions keyed by each placement's
# C++ type and dim: a RowShard (a Python subclass of Shard, _row_dtensor.py)
# is Shard(0) there, its split invisible. An op on a RowParam would leave an
# entry whose output carries our RowShard, returned later for a plain
# Shard(0) DTensor of the same shape (FSDP2's, a user's): wrong rows,
# silently. So every DTensor op dispatched on a RowParam clears that cache
# afterwards (the per-step code dispatches none). Private; absent: nothing to clear.
_CLEAR_NATIVE_CACHE = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)


def clear_dtensor_dispatch_cache() -> None:
    if _CLEAR_NATIVE_CACHE is not None:
        _CLEAR_NATIVE_CACHE()


# A Tensor subclass's metadata reads and writes (``p.grad``, ``p.data``,
# ``p.size()``) reach its Python ``__torch_function__`` (~4 us each, where
# DTensor's own C implementation costs ~0.7 us). RowParam's fast path for
# them (_row_dtensor.py: ``zero_grad`` reads and clears ``p.grad`` of every
# parameter, every step) runs the call with torch functions disabled through
# torch's C implementation of exactly that, which the public route (entering
# ``DisableTorchFunctionSubclass`` in Python) costs ~1 us more per call.
# Private; absent: the public route.
_DISABLED_IMPL = getattr(torch._C, "_disabled_torch_function_impl", None)


def call_without_torch_function(func, types, args, kwargs):
    """``func(*args, **kwargs)`` with subclasses' ``__torch_function__`` off."""
    if _DISABLED_IMPL is not None:
        return _DISABLED_IMPL(func, types, args, kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def concat_meshes(meshes: list):
    """The mesh whose dims are ``meshes``' dims in order (the unit's data-
    parallel mesh, then a tensor-parallel parameter's), or None where torch
    cannot build it (the meshes are not slices of one root mesh).

    Why private: a tensor-parallel parameter inside a unit is a DTensor over
    both the unit's mesh and its TP mesh (as FSDP2 shows it), and torch has
    no public way to join two sliced meshes; FSDP2 calls the same
    ``DeviceMesh._concatenate`` (2.11, 2.13 and 2.14).
    """
    from torch.distributed.device_mesh import DeviceMesh
    join = getattr(DeviceMesh, "_concatenate", None)
    if join is None:
        return None
    try:
        return join(list(meshes))
    except Exception:  # noqa: BLE001 - not one root mesh: the caller keeps plain pieces
        return None
