"""Public value types. No runtime logic lives here."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamInfo:
    """Where one original parameter lives, as seen from this rank.

    ``fqn``: its name in the outermost module ``fully_shard`` was applied to.
    ``shape``: its global (unsharded) shape.
    ``local_range``: ``(start, end)`` such that, while sharded, the parameter
    tensor equals ``full_param.flatten()[start:end]`` (``start == end`` when
    this rank holds none of it).
    ``unit_fqn``: the fully_shard unit that owns it.
    """

    fqn: str
    shape: torch.Size
    local_range: tuple[int, int]
    unit_fqn: str

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass
class CommStats:
    """Collectives this process issued (since start or the last reset).

    Bytes are the size of the *unsharded* side of each collective: the
    all-gather output and the reduce-scatter input.
    """

    all_gather_calls: int = 0
    all_gather_bytes: int = 0
    reduce_scatter_calls: int = 0
    reduce_scatter_bytes: int = 0
    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0
