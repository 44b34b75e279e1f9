"""The few private torch entry points we need, each with why.

Everything else in the package uses public torch APIs only.
"""
from __future__ import annotations

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


def profiler_enabled() -> bool:
    """True while a torch profiler is recording.

    Why private: ``record_function`` costs tens of microseconds per call even
    when nothing records; the hooks label their phases only while a profiler
    is active, and torch has no public query for that.
    """
    return torch._C._autograd._profiler_enabled()


def tree_leaves(tree: Any) -> list:
    """Flatten outputs (tuples, dicts, dataclasses, HF ModelOutput ...) to leaves.

    Why private: ``torch.utils._pytree`` is the registry every torch and HF
    container type registers with; there is no public flattener with that
    coverage in torch 2.13.
    """
    return _pytree.tree_leaves(tree)


def tree_map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to every tensor leaf (mixed-precision casts of
    forward inputs and outputs); same registry as ``tree_leaves``, same reason."""
    return _pytree.tree_map_only(torch.Tensor, fn, tree)
