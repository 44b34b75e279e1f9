"""The few private torch entry points we need, each with why.

Everything else in the package uses public torch APIs only.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import sys
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch.utils import _pytree


def queue_final_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once when the current backward pass finishes.

    Why private: the autograd engine exposes no public "end of backward" hook;
    the root needs one to finish reduce-scatters and reshard units whose
    post-backward never fired. FSDP1/FSDP2 use the same entry point.
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
    """The default process group's store (``init_process_group``'s, behind its prefix).

    Why private: ranks that diverge need a channel outside the process group,
    whose collectives are what no longer match (see [Note: divergence] in
    _divergence.py); the default store is one every job already has, and
    torch has no public getter for it. Raises ValueError without a default
    process group.
    """
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def checkpoint_region() -> int | None:
    """An id of the innermost non-reentrant activation-checkpoint region the
    caller's forward runs in (``torch.utils.checkpoint``, also under
    ``checkpoint_wrapper`` and HF's gradient checkpointing), else None.

    Why private: the stack of saved-tensors hooks is only readable through
    ``torch._C._autograd._top_saved_tensors_default_hooks``; a checkpoint
    region is told from other saved-tensors hooks (``save_on_cpu``, a user's)
    by its pack hook, a closure made per region in ``torch.utils.checkpoint``.
    Used for the backward's collective order (see _backward_schedule.py): the recompute of
    a region gathers all of its units before any of their gradients exists.
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

    Why private: a reentrant checkpoint runs its function under
    ``torch.no_grad()`` inside ``CheckpointFunction.forward`` and leaves no
    other trace (no saved-tensors hooks); its frame is found on the Python
    stack (``sys._getframe``), and its ``ctx`` (alive until the backward) names
    it. Asked only for units whose forward runs without grad inside a training
    forward. Used like ``checkpoint_region``: the recompute gathers the
    region's units before any of their gradients exists.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _REENTRANT_FORWARD:
            return id(frame.f_locals.get("ctx", frame))
        frame = frame.f_back
    return None


def profiler_enabled() -> bool:
    """True while a torch profiler is recording.

    Why private: ``record_function`` costs tens of microseconds per call even
    when nothing records; the hooks label their phases only while a profiler
    is active, and torch has no public query for that.
    """
    return torch._C._autograd._profiler_enabled()


def tree_leaves(tree: Any) -> list:
    """Flatten outputs (tuples, dicts, NamedTuples, HF ModelOutput ...) to leaves.

    Why private: ``torch.utils._pytree`` is the registry every torch and HF
    container type registers with; there is no public flattener with that
    coverage in torch 2.13. What it leaves whole (a dataclass, a dict, list or
    tuple subclass nobody registered) is opened here (``_children``): a tensor
    inside one must get its pre-backward hook too.
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
            new = copy.copy(x)
            for k, v in x.items():
                new[k] = tree_map_tensors(fn, v)
            return new
        return x

    return _pytree.tree_map(leaf, tree)


def functorch_disabled():
    """A context in which functorch transforms (``torch.func.jvp``, ``vmap`` ...)
    do not intercept tensor operations; a no-op when none is active.

    The hooks all-gather into, view, free and swap the unit's own buffers,
    which are not inputs of the function being transformed; under a transform
    every operation's result is wrapped (the all-gather then addresses a
    wrapper without storage). Why private: torch has no public way out of a
    transform; FSDP2 wraps its unshard / reshard in the same guard.
    """
    if torch._C._are_functorch_transforms_active():
        return torch._C._DisableFuncTorch()
    return _NULL


_NULL = contextlib.nullcontext()


def outside_functorch(fn: Callable) -> Callable:
    """``fn`` run under ``functorch_disabled()``: for the backward hooks, which
    a transform such as ``torch.func.grad`` runs inside its own backward."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch._C._are_functorch_transforms_active():
            with torch._C._DisableFuncTorch():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return run


def guard_torch_clip_helper(check: Callable[[Any], None]) -> Callable[[], None] | None:
    """Make torch's own ``clip_grad_norm_`` call ``check(parameters)`` before
    clipping; returns what undoes it (None: nothing was done).

    Why private: ``torch.nn.utils.clip_grad_norm_`` computes a rank-local norm
    on sharded parameters (see [Note: torch.nn.utils.clip_grad_norm_] in
    _torch_hooks.py). The public names are routed to ours, but a reference to
    torch's function taken before that still runs torch's body, which looks up
    its helper ``_clip_grads_with_norm_`` in its module at call time: wrapping
    that helper is the one place where such a call can be made loud instead of
    silently wrong. The public alias ``torch.nn.utils.clip_grads_with_norm_``
    (a separate name, used by fsdp_compose.clip_grad_norm_) is left alone.
    """
    from torch.nn.utils import clip_grad

    helper = getattr(clip_grad, "_clip_grads_with_norm_", None)
    if helper is None or getattr(helper, "_fsdp_compose_guard", False):
        return None

    def guarded(parameters, max_norm, total_norm, foreach=None):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        check(parameters)
        return helper(parameters, max_norm, total_norm, foreach)

    guarded._fsdp_compose_guard = True
    clip_grad._clip_grads_with_norm_ = guarded

    def undo():
        clip_grad._clip_grads_with_norm_ = helper
    return undo


def crc_checked_reader(path) -> Any:
    """A ``torch.distributed.checkpoint.FileSystemReader`` of ``path`` that checks
    the CRC-32 of every item it reads before torch unpickles it.

    Why private: DCP's ``FileSystemReader`` writes each item as a ``torch.save``
    zip record, whose CRC-32 ``torch.save`` computes (``set_crc32_options``), but
    neither DCP nor ``torch.load`` checks it on load: a flipped byte inside a
    tensor's data loads silently. The one seam where the bytes of an item pass
    by is the reader's private ``_slice_file(file, storage_info)``; this
    subclass reads the item there (it is read whole anyway), checks it and
    hands torch the same bytes. Where that seam is missing (another torch
    version), or the item went through a storage transform (compression), the
    plain reader's behaviour is kept. Records written without a CRC
    (``set_crc32_options(False)`` stores 0) are not checked.
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
    _load_checkpoint.py) lets DCP plan and perform this rank's reads into a
    description of the state dict made of meta tensors, which keeps nothing.
    ``DefaultLoadPlanner.set_up_planner`` first allocates every meta tensor of
    the state dict (``_init_state_dict``, meant for loading into a model still
    on meta): the copy of the state the verification exists to avoid. Our
    planner's ``set_up_planner`` skips that step and does the rest, which is
    this flattening; it must give DCP's own keys, so it is DCP's function.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    return flatten_state_dict(state_dict)


def dtensor_local(t) -> torch.Tensor:
    """The local tensor object a DTensor holds (not a view of it).

    Why private: torchao's ``precompute_float8_dynamic_scale_for_fsdp``
    stores each weight's scale on ``weight._local_tensor``, the object whose
    ``fsdp_pre_all_gather`` the next all-gather must call (FSDP2 reads
    ``sharded_param._local_tensor`` alike). ``DTensor.to_local()`` of an
    ``nn.Parameter`` DTensor returns a fresh view in torch 2.13 (gh-166156),
    without that attribute.
    """
    return t._local_tensor
