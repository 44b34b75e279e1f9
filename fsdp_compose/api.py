"""Public value types. No runtime logic lives here."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamInfo:
    """Where one original parameter lives, as seen from this rank.

    ``fqn``: its name in the outermost module ``fully_shard`` was applied to.
    ``shape``: its global (unsharded) shape.
    ``rows``: ``(start, end)``: while sharded, the parameter tensor is rows
    ``full_param[start:end]`` of dim 0 (shape ``(end - start, *shape[1:])``;
    ``(0, 0)`` when this rank holds none of it). At shard world size 1 it is
    ``(0, shape[0])``: the whole parameter. (A 0-d parameter is one row, and
    its piece is 1-D, of 1 or 0 elements.)
    ``local_range``: the same piece as ``(start, end)`` of
    ``full_param.flatten()``.
    ``unit_fqn``: the fully_shard unit that owns it.
    ``granularity``: the unit's ``shard_granularity`` (``"row"`` or ``"tensor"``).
    ``rank_bytes``: for each rank of the shard group, the bytes of parameters
    (padding excluded) it holds in this parameter's flat group: ``max`` over
    ``mean`` is the group's imbalance (the most loaded rank sets the size of
    the collectives and the optimizer's time).
    ``placements`` / ``tp_shape``: for a tensor-parallel (DTensor) parameter,
    its placements on its TP mesh and its global shape; ``shape`` is then the
    shape of this rank's TP shard (what the flat buffer holds, and whose rows
    ``rows`` counts). None otherwise.
    """

    fqn: str
    shape: torch.Size
    local_range: tuple[int, int]
    unit_fqn: str
    placements: tuple | None = None
    tp_shape: torch.Size | None = None
    rows: tuple[int, int] = (0, 0)
    granularity: str = "row"
    rank_bytes: tuple[int, ...] = ()

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
    all_to_all_calls: int = 0   # state dicts: our rows <-> FSDP2's Shard(0) chunks
    all_to_all_bytes: int = 0   # (bytes this rank sent)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Per-unit mixed precision, as ``fully_shard(..., mp_policy=)`` (same names as FSDP2).

    ``param_dtype``: the dtype the unit computes in. The fp32 (or whatever the
    parameters are) sharded master is cast in one pass straight into the
    all-gather input; gradients come out of backward in this dtype.
    ``reduce_dtype``: the dtype of the gradient reduce-scatter (default:
    ``param_dtype``); the result is accumulated into the master-dtype gradient
    shard. In fp16/bf16 the reduction divides before and after the sum so
    partial sums stay in range. fp16 gradients also need loss scaling, with
    ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` (its
    inf check is all-reduced; ``torch.amp.GradScaler`` would check this
    rank's rows only, so on sharded parameters it raises: see the README):
    the policy does not scale the loss.
    ``output_dtype``: cast the unit's floating-point outputs to this dtype.
    ``cast_forward_inputs``: cast floating-point forward inputs to
    ``param_dtype`` (e.g. an fp32 norm unit next to bf16 blocks:
    ``MixedPrecisionPolicy(param_dtype=torch.float32)``).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (the default). Subclassed by ``CPUOffloadPolicy``."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer state on CPU.

    The shard is copied to the device (cast to ``param_dtype`` in the same
    pass) right before its all-gather, and the gradient shard back after the
    reduce-scatter; the optimizer steps on CPU. ``pin_memory``: page-lock the
    CPU shards (faster, asynchronous host-to-device copies; CUDA only).
    Parameters may start on CPU or on the mesh's device.
    """

    pin_memory: bool = True
