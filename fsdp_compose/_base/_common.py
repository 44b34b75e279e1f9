"""Life-cycle enums, the error helper and the schedule trace."""
from __future__ import annotations

import contextlib
import enum
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from . import _compat

# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn).
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TrainingState(enum.Enum):
    """Where a fully_shard unit is in a training step."""

    IDLE = enum.auto()           # between steps, or between forward and backward
    FORWARD = enum.auto()        # inside the unit's forward (pre-forward ran)
    PRE_BACKWARD = enum.auto()   # a gradient reached the unit's outputs
    POST_BACKWARD = enum.auto()  # all of the unit's gradients are accumulated


class ShardedState(enum.Enum):
    """Whether a flat group's full parameters are materialised."""

    SHARDED = enum.auto()     # only the local shard exists; params are shard views
    UNSHARDING = enum.auto()  # all-gather issued, not yet waited
    UNSHARDED = enum.auto()   # full flat buffer holds data; params are full-shape views
    PARTIAL = enum.auto()     # reshard_after_forward=N: 1/N of the flat kept until backward


class Gather(enum.Enum):
    """Why a unit's all-gather is asked for: ``RootContext.gather`` decides
    from it whether and how (alone, or in a bucket) the unit is gathered."""

    FORWARD = enum.auto()    # its pre-forward (then the forward prefetch)
    SKIPPED = enum.auto()    # the forward order's +u, which this rank skipped
    PREFETCH = enum.auto()   # a unit ahead in the forward order (if still sharded)
    BACKWARD = enum.auto()   # its pre-backward (the gather order up to it first)
    RECOMPUTE = enum.auto()  # its forward recomputed in backward (ditto)
    IN_ORDER = enum.auto()   # the gather order reaches it
    AGAIN = enum.auto()      # a pre-backward after its reduction (a second use)
    USER = enum.auto()       # FSDPModule.unshard


class Reshard(enum.Enum):
    """The events after which a unit may free its unsharded parameters:
    ``RootContext.reshard`` decides (the one policy table)."""

    AFTER_FORWARD = enum.auto()   # its post-forward, or the order's -u (skipped here)
    GRADS_COMPUTED = enum.auto()  # one group's parameter gradients exist (gloo)
    AFTER_BACKWARD = enum.auto()  # every trainable group's gradient accumulated
    BACKWARD_END = enum.auto()    # the root's final callback (or an aborted step)
    NEW_STEP = enum.auto()        # a training root forward starts a step


class Kept(enum.Enum):
    """Why a unit is left unsharded between steps (``Unit.keep``)."""

    NO = enum.auto()
    USER = enum.auto()      # FSDPModule.unshard, until reshard() or a backward's end
    BACKWARD = enum.auto()  # set_reshard_after_backward(False): until the next step,
                            # or sooner if an optimizer step changed a shard


@dataclass(frozen=True)
class RootSettings:
    """The settings of the whole model (FSDPModule's root-only setters), a
    frozen value on the root unit (``Unit.root_settings``), replaced by
    ``Unit.update_root_settings``; ``RootContext.settings`` reads it. A setter
    called before lazy init (when the root is not known yet) sets it on its
    unit; lazy init refuses one set on a unit that is not the root."""

    # how many units to all-gather ahead, in forward (last step's order) and
    # backward (gather order): in-flight unsharded memory is the current
    # unit plus this many
    prefetch_depth: int = 1
    overlap_reduce_scatter: bool = True  # see set_overlap_reduce_scatter
    bucket_bytes: int = 1 << 20          # see set_reduce_scatter_bucket_bytes
    gather_bucket_bytes: int = 1 << 20   # see set_all_gather_bucket_bytes
    is_last_backward: bool = True        # False leaves the last reduce in flight
    forward_order_dynamic: bool = False  # see set_forward_order_dynamic
    # names of the setters called (see FSDPModule._root_setting)
    called: frozenset = frozenset()


@dataclass(frozen=True)
class ReduceSettings:
    """A unit's reduction settings, which its groups' gradient paths read
    (``GradientPath.settings``)."""

    requires_all_reduce: bool = True    # HSDP: False keeps a partial sum, no all-reduce
    divide_factor: float | None = None  # set_gradient_divide_factor (None: the mean)
    force_sum: bool = False             # set_force_sum_reduction_for_comms


@dataclass(frozen=True)
class UnitSettings:
    """A unit's user settings (fully_shard's arguments and FSDPModule's
    per-unit setters), a frozen value replaced by ``Unit.update_settings``."""

    reshard_after_forward: bool | int | None = None  # None: True except on the root
    # False: stay gathered after backward (the next forward all-gathers
    # nothing, unless an optimizer step changed a shard meanwhile)
    reshard_after_backward: bool = True
    # False (set_unshard_in_backward): backward does not need the parameters
    # (e.g. an embedding): no all-gather for this unit in backward
    unshard_in_backward: bool = True
    # False: keep accumulating the unsharded flat gradient, no reduce-scatter
    requires_gradient_sync: bool = True
    forward_prefetch: tuple | None = None   # explicit units; None: by order
    backward_prefetch: tuple | None = None
    reduce: ReduceSettings = ReduceSettings()


def weak_hook(obj, method: str, arg=None):
    """A hook calling ``obj.<method>([arg,] *hook_args)`` that keeps neither
    ``obj`` nor ``arg`` alive. Autograd nodes and tensors hold their hooks in
    C++, where the garbage collector cannot see a cycle through them: a strong
    hook would keep the whole sharded model alive for the life of the process."""
    me = weakref.ref(obj)
    if arg is None:
        def hook(*hook_args):
            o = me()
            return None if o is None else getattr(o, method)(*hook_args)
    else:
        ref = weakref.ref(arg)

        def hook(*hook_args):
            o = me()
            return None if o is None else getattr(o, method)(ref(), *hook_args)
    return hook


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def group_backends(group=None) -> dict[str, str]:
    """``{device type: backend}`` of a process group (the default one if None),
    from its backend config ("cpu:gloo,cuda:nccl"; a plain "nccl" reads
    "cuda:nccl"). ``dist.get_backend()`` is no substitute: it returns the
    string given to ``init_process_group``, i.e. "undefined" without one and
    "cpu:gloo,cuda:nccl" for that spelling."""
    pairs = (p.split(":", 1) for p in str(dist.get_backend_config(group)).split(",") if ":" in p)
    return {device.strip(): backend.strip() for device, backend in pairs}


def default_device(group=None) -> torch.device:
    """The device a job's default mesh (and ``materialize``) uses: the current
    CUDA device when a GPU is visible and the process group (the default one
    if None) sends CUDA tensors to a GPU backend (NCCL, whichever way
    ``init_process_group`` was spelled); else the CPU (gloo, which also takes
    CUDA tensors, means a CPU job)."""
    if dist.is_initialized() and torch.cuda.is_available():
        backend = group_backends(group).get("cuda")
        if backend is not None and backend != "gloo":
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def unit_error(fqn: str, what: str, fix: str = "", exc=RuntimeError) -> Exception:
    """An error that names the rank and the unit, and says what to change."""
    name = fqn if fqn else "<root>"
    msg = f"fsdp_compose [rank {rank()}] unit '{name}': {what}"
    if fix:
        msg += f" {fix}"
    return exc(msg)


# What to do about parameters still on the meta device (README, "Building on the meta device").
META_FIX = ("Build on the meta device, fully_shard, then give the shards storage before the "
            "first forward: fsdp_compose.materialize(model) (initialises them as eager "
            "construction would), or model.to_empty(device=...) followed by loading a state dict "
            "or initialising them; see the README, 'Building on the meta device'.")


def root_setting_fix(where: str) -> str:
    """What to do when a root-only setter was called on another unit."""
    return (f"Call {where}() on the root module (the one fully_shard was applied to "
            f"last, whose forward runs the others), e.g. model.{where}(...).")


_NO_LABEL = contextlib.nullcontext()


def label(phase: str, fqn: str):
    """Profiler label ``fsdp_compose::<phase> (<unit fqn>)``, only while profiling."""
    if _compat.profiler_enabled():
        return torch.profiler.record_function(f"fsdp_compose::{phase} ({fqn})")
    return _NO_LABEL


# ---------------------------------------------------------------------------
# Schedule trace: the seams append (event, unit fqn, detail) while a recorder
# is active. One `is None` check per event when it is not. Process-wide, as
# a profiler is: a test and tools seam set for a ``with`` block (nothing
# outlives it), so no job lookup per event.
# ---------------------------------------------------------------------------
_trace: list | None = None


def trace(event: str, fqn: str, detail: str = "") -> None:
    if _trace is not None:
        _trace.append((event, fqn, detail))


@contextlib.contextmanager
def record_schedule() -> Iterator[list]:
    """Record ``(event, unit_fqn, detail)`` tuples from the hook seams."""
    global _trace
    prev, _trace = _trace, []
    try:
        yield _trace
    finally:
        _trace = prev
