"""The stream manager: where collectives are issued and where they are waited.

[Note: hand-off protocol]
A collective's result is a *tensor plus the handle that makes it safe to use*.
Call sites never touch streams themselves: they ask the manager to issue an
all-gather / reduce-scatter and get back a ``Pending`` (work handle + the
tensors that must stay alive until it is waited), and they call ``wait()`` on
it right before the data is read. The manager drops its references only after
the wait, so no ``record_stream`` is ever needed.

On gloo (CPU) a collective runs on gloo's own thread and ``wait()`` blocks the
caller.

[Note: side streams] On CUDA every all-gather is issued on the manager's
all-gather stream and every reduce-scatter on its reduce-scatter stream (two
process groups, see _fully_shard._reduce_scatter_group, so they overlap each
other and compute):

    compute:  ... writes the input ─ record E1 ..................... wait E2 ─ reads the output
    side:                  wait E1 ─ collective (async) ─ wait it ─ record E2

- Everything the collective touches (input, output) is allocated on the
  compute stream *before* switching to the side stream (the reduce-scatter's
  output too), and the Pending keeps it alive until the compute stream has
  waited E2. A block is therefore freed (to the compute stream's pool) only
  once the compute stream is ordered after the side stream's last use: no
  ``record_stream`` anywhere.
- ``wait()`` on the side stream only orders that stream after NCCL's
  internal stream; nothing blocks the CPU, so ``waits_block_cpu`` is False
  and the backward schedule is FSDP2's (see [Note: gloo backward] in _unit.py
  for what gloo does instead).
- The streams are created once per root (high priority, so communication
  kernels are scheduled ahead of compute kernels queued at the same time).
- ``runtime`` is the seam for a test double on CPU (tests/test_streams.py):
  the protocol above is checked there; on CUDA it is torch.cuda's.
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


class CudaRuntime:
    """What the side-stream protocol needs from a device runtime: torch.cuda's."""

    @staticmethod
    def current_stream():
        return torch.cuda.current_stream()

    @staticmethod
    def new_stream():
        return torch.cuda.Stream(priority=-1)

    @staticmethod
    def use(stream):
        return torch.cuda.stream(stream)


class _EventWork:
    """A collective finished on a side stream when ``event`` completes."""

    def __init__(self, runtime, event, result=None):
        self._rt, self._event, self._result = runtime, event, result

    def wait(self):
        """Order the caller's current stream after the collective (every call:
        the caller may be on another stream the next time)."""
        self._rt.current_stream().wait_event(self._event)
        return self._result


class StreamManager:
    """One per root; shared by every unit below it."""

    def __init__(self, device: torch.device, runtime=None):
        self.device = device
        if runtime is None and device.type == "cuda":
            runtime = CudaRuntime()
        self._rt = runtime
        # gloo on CPU: wait() blocks this thread; side streams only order streams
        self.waits_block_cpu = runtime is None
        if runtime is not None:
            self.all_gather_stream = runtime.new_stream()
            self.reduce_scatter_stream = runtime.new_stream()

    def _on(self, stream, issue):
        """Run ``issue()`` (returns a work) on ``stream``, see [Note: side streams]."""
        rt = self._rt
        inputs_ready = rt.current_stream().record_event()
        with rt.use(stream):
            stream.wait_event(inputs_ready)
            result = issue().wait()  # this stream waits for NCCL's; the CPU goes on
            done = stream.record_event()
        return _EventWork(rt, done, result)

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, group) -> Pending:
        if self._rt is None:
            return Pending(_collectives.all_gather(output, shard, group), (output, shard))
        work = self._on(self.all_gather_stream,
                        lambda: _collectives.all_gather(output, shard, group))
        return Pending(work, (output, shard))

    def reduce_scatter(self, flat_grad: torch.Tensor, group, op=dist.ReduceOp.AVG) -> Pending:
        if self._rt is None:
            return Pending(_collectives.reduce_scatter(flat_grad, group, op), (flat_grad,))
        # the output is allocated here, on the compute stream (see the Note)
        out = flat_grad.new_empty(flat_grad.numel() // dist.get_world_size(group))
        work = self._on(self.reduce_scatter_stream,
                        lambda: _collectives.reduce_scatter(flat_grad, group, op, out=out))
        return Pending(work, (flat_grad, out))

    def all_reduce(self, tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> Pending:
        """In place; small tensors that travel with the reduce-scatters (the
        used-flags of [Note: parameters without a gradient] in _flat_group.py),
        so on the reduce-scatter stream."""
        if self._rt is None:
            return Pending(_collectives.all_reduce_async(tensor, op, group), (tensor,))
        work = self._on(self.reduce_scatter_stream,
                        lambda: _collectives.all_reduce_async(tensor, op, group))
        return Pending(work, (tensor,))

    @staticmethod
    def ready(result: torch.Tensor) -> Pending:
        """Nothing to communicate (one rank): ``wait()`` returns ``result``."""
        return Pending(_collectives.Ready(result), ())

    def __repr__(self) -> str:
        mode = "async-collectives" if self._rt is None else "side-streams"
        return f"StreamManager(device={self.device}, mode={mode})"
