"""Life-cycle enums, the error helper and the schedule trace."""
from __future__ import annotations

import contextlib
import enum
import weakref
from typing import Iterator

import torch
import torch.distributed as dist

from . import _compat


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


def unit_error(fqn: str, what: str, fix: str = "", exc=RuntimeError) -> Exception:
    """An error that names the rank and the unit, and says what to change."""
    name = fqn if fqn else "<root>"
    msg = f"fsdp_compose [rank {rank()}] unit '{name}': {what}"
    if fix:
        msg += f" {fix}"
    return exc(msg)


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
# is active. One `is None` check per event when it is not.
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
