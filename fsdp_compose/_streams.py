"""The stream manager: where collectives are issued and where they are waited.

[Note: hand-off protocol]
A collective's result is a *tensor plus the handle that makes it safe to use*.
Call sites never touch streams themselves: they ask the manager to issue an
all-gather / reduce-scatter and get back a ``Pending`` (work handle + the
tensors that must stay alive until it is waited), and they call ``wait()`` on
it right before the data is read. The manager drops its references only after
the wait, so no ``record_stream`` is ever needed.

On gloo (CPU) a collective runs on gloo's own thread and ``wait()`` blocks the
caller. On NCCL, ``async_op=True`` runs it on the process group's internal
stream and ``wait()`` makes the *current* stream wait for it, so the same call
sites are correct on both. Dedicated all-gather / reduce-scatter streams with
explicit events (so a prefetch can overlap compute on GPU) belong to the
overlap work (issue 4) and plug in here without changing any call site.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from . import _collectives


class Pending(NamedTuple):
    work: object  # a dist.Work, or one of _collectives' works (ReduceScatterWork, ...)
    keep_alive: tuple  # tensors the collective reads or writes

    def wait(self):
        """Block until the data is there; a reduce-scatter returns its result."""
        return self.work.wait()


class StreamManager:
    """One per root; shared by every unit below it."""

    def __init__(self, device: torch.device):
        self.device = device
        # gloo on CPU: wait() blocks this thread; NCCL: it only orders streams
        self.waits_block_cpu = device.type == "cpu"

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, group) -> Pending:
        return Pending(_collectives.all_gather(output, shard, group), (output, shard))

    def reduce_scatter(self, flat_grad: torch.Tensor, group, op=dist.ReduceOp.AVG) -> Pending:
        return Pending(_collectives.reduce_scatter(flat_grad, group, op), (flat_grad,))

    @staticmethod
    def ready(result: torch.Tensor) -> Pending:
        """Nothing to communicate (one rank): ``wait()`` returns ``result``."""
        return Pending(_collectives.Ready(result), ())

    def __repr__(self) -> str:
        return f"StreamManager(device={self.device}, mode=async-collectives)"
