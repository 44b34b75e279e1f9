"""fsdp_compose: composable, zero-copy fully-sharded data parallelism for PyTorch.

    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters())   # after fully_shard
"""
from ._comm._collectives import comm_stats, reset_comm_stats
from ._base._common import ShardedState, TrainingState, record_schedule
from ._comm._divergence import DivergenceError
from ._runtime._fsdp_module import FSDPModule, UnshardHandle, register_fsdp_forward_method
from ._runtime._fully_shard import fully_shard, param_info
from ._group._row_dtensor import RowShard, TPShard
from ._group._row_dtensor import _rebuild as _rebuild_row_param  # noqa: F401  (pickles: there)
from .api import (CommStats, CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                  ParamInfo)
from .checkpoint._checkpoint import get_state_dict, set_state_dict
from .checkpoint._load_checkpoint import CheckpointLoadError, load_checkpoint
from .checkpoint._materialize import materialize
from ._runtime._drop_in import use_as_fsdp2
from ._optim.clip import clip_grad_norm_
from ._optim._torch_hooks import declare_optimizer, install_torch_hooks

__all__ = [
    "fully_shard",
    "DivergenceError",
    "FSDPModule",
    "UnshardHandle",
    "clip_grad_norm_",
    "declare_optimizer",
    "install_torch_hooks",
    "param_info",
    "register_fsdp_forward_method",
    "ParamInfo",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "comm_stats",
    "reset_comm_stats",
    "CommStats",
    "record_schedule",
    "TrainingState",
    "ShardedState",
    "get_state_dict",
    "set_state_dict",
    "load_checkpoint",
    "CheckpointLoadError",
    "materialize",
    "use_as_fsdp2",
    "RowShard",
    "TPShard",
]
__version__ = "0.1.0"
