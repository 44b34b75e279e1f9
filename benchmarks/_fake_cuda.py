"""A CUDA job on a machine without a GPU: the doubles that let the CUDA path of
fsdp_compose run on CPU (tests/test_gpu_path.py, tests/test_streams.py and
``python -m benchmarks.gpu_check --dry-run``). Imports torch only (no pytest,
no fsdp_compose).

* :class:`StreamDouble`: the stream runtime of ``fsdp_compose._comm._streams.
  StreamManager`` (installed with ``_streams.runtime_factory``). Streams and
  events record into a log instead of ordering anything; host copies are
  logged with the stream they are issued on and whether their host buffer is
  pinned; ``event.synchronize()`` is logged. The manager then runs its
  side-stream protocol (the NCCL schedule) on CPU tensors.
* :class:`CudaJob`: torch as a GPU job sees it: a visible GPU
  (``torch.cuda.is_available`` / ``device_count`` / ``current_device`` /
  ``is_initialized``; its current stream is not capturing a CUDA graph, as
  the optimizers' ``step()`` asks), the default process group's backend string and
  config as torch computes them for a spelling of ``init_process_group`` on
  a CUDA machine (``BackendConfig`` with the accelerator reported as CUDA),
  and, for process groups made NCCL-only, NCCL's "No backend type associated
  with device type cpu" on a tensor of another device. A move to CUDA
  (``Tensor.to``) gives a CPU copy marked as on CUDA; ``pin_memory()``
  returns the tensor itself; allocating on CUDA still fails on a CPU-only
  build.

What neither can show: CUDA's semantics (a stream that really runs ahead, a
block reused while a kernel still reads it), kernels, or real collectives.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Sequence
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["StreamDouble", "CudaJob"]


class _Event:
    def __init__(self, n: int, stream: "_Stream"):
        self.n, self.stream = n, stream

    def synchronize(self) -> None:
        self.stream.rt.log.append(("sync", self.stream.name, self.n))

    def query(self) -> bool:  # (every recorded op completes when issued)
        return True


class _Stream:
    def __init__(self, name: str, rt: "StreamDouble"):
        self.name, self.rt = name, rt

    def record_event(self) -> _Event:
        ev = _Event(next(self.rt.ids), self)
        self.rt.log.append(("record", self.name, ev.n))
        return ev

    def wait_event(self, ev: _Event) -> None:
        self.rt.log.append(("wait", self.name, ev.n))


class StreamDouble:
    """The stream runtime of ``StreamManager`` (``fsdp_compose._comm._streams``, the
    seam ``runtime_factory``) as a double: streams and events record into
    ``log`` instead of ordering anything (``("record", stream, n)``,
    ``("wait", stream, n)``, ``("sync", stream, n)``); host copies are logged
    with the stream they are issued on (``("h2d", stream)``, ``("d2h",
    stream, pinned)``); ``mark`` logs a test's own milestones.
    ``side_streams``: the names of the streams the manager makes, in the order
    it makes them (the all-gather stream first); one more is an error."""

    def __init__(self, side_streams: Sequence[str] = ("ag", "rs", "ar")):
        self.log: list = []      # stream operations, copies, issues, releases, marks
        self.issues: list = []   # (kind, stream, async_op, numel) of every collective
        self.ids = itertools.count()
        self._names = iter(side_streams)
        self._stack = [_Stream("compute", self)]
        self._pinned = WeakIdKeyDictionary()

    def current_stream(self) -> _Stream:
        return self._stack[-1]

    def new_stream(self) -> _Stream:
        return _Stream(next(self._names), self)

    @contextlib.contextmanager
    def use(self, stream: _Stream):
        self._stack.append(stream)
        try:
            yield
        finally:
            self._stack.pop()

    @staticmethod
    def intended_sync(why: str):
        return contextlib.nullcontext()

    def to_device(self, t: torch.Tensor, device) -> torch.Tensor:
        return t.to(device)

    def host_empty(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        if pin:
            self._pinned[t] = True
        return t

    def host_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(("h2d", self.current_stream().name))
        dst.copy_(src)

    def device_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(("d2h", self.current_stream().name, dst in self._pinned))
        dst.copy_(src)

    def mark(self, what: str) -> None:
        self.log.append(("mark", what))


class _NotCapturing:
    """The current stream of a GPU job, to the one question asked of it here."""

    @staticmethod
    def is_capturing() -> bool:
        return False


class CudaJob:
    """See the module doc. ``spelling``: the backend given to
    ``init_process_group`` (None: no backend, torch reports "undefined");
    ``nccl_groups``: process groups that answer as NCCL-only ones."""

    def __init__(self, spelling: str | None = "cpu:gloo,cuda:nccl", nccl_groups=()):
        self.spelling = spelling or "undefined"
        # BackendConfig("undefined") takes the machine's accelerator: up to torch
        # 2.13 from torch._C._get_accelerator() (the build's), from 2.14 on from
        # torch.accelerator.current_accelerator(check_available=True) (None
        # without a GPU, also in a CUDA build): on a GPU machine both say CUDA
        with mock.patch.object(torch._C, "_get_accelerator", lambda: torch.device("cuda")), \
                mock.patch.object(torch.accelerator, "current_accelerator",
                                  lambda check_available=False: torch.device("cuda")):
            self.config = repr(BackendConfig(self.spelling))
        self.nccl_groups = list(nccl_groups)
        self.on_cuda = WeakIdKeyDictionary()  # tensors "moved to CUDA"
        self.all_reduced: list = []  # (device type, backends of the group)

    def _is_default(self, group) -> bool:
        return group is None or group is dist.group.WORLD

    @contextlib.contextmanager
    def active(self):
        real_backend, real_config = dist.get_backend, dist.get_backend_config
        real_to, real_all_reduce = torch.Tensor.to, dist.all_reduce

        def get_backend(group=None):
            return self.spelling if self._is_default(group) else real_backend(group)

        def get_backend_config(group=None):
            if any(group is g for g in self.nccl_groups):
                return "cuda:nccl"
            return self.config if self._is_default(group) else real_config(group)

        def to(t, *args, **kw):
            target = kw.get("device", args[0] if args else None)
            if isinstance(target, (str, torch.device)) and torch.device(target).type == "cuda":
                moved = t.detach().clone()
                self.on_cuda[moved] = True
                return moved
            return real_to(t, *args, **kw)

        def all_reduce(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
            device = "cuda" if t in self.on_cuda else t.device.type
            backends = dict(p.split(":") for p in get_backend_config(group).split(","))
            self.all_reduced.append((device, get_backend_config(group)))
            if device not in backends:
                raise RuntimeError(f"No backend type associated with device type {device}")
            return real_all_reduce(t, op=op, group=group, async_op=async_op)

        with contextlib.ExitStack() as stack:
            for name, value in (("is_available", lambda: True), ("device_count", lambda: 8),
                                ("current_device", lambda: 0), ("is_initialized", lambda: True),
                                ("set_device", lambda d: None),
                                # (the optimizers' graph-capture check, torch 2.11)
                                ("is_current_stream_capturing", lambda: False)):
                stack.enter_context(mock.patch.object(torch.cuda, name, value))
            # The same check in torch 2.13 and 2.14 (their optimizer.py): on a CUDA
            # build (whose accelerator is CUDA) it asks torch.accelerator.is_available()
            # (i.e. the patched torch.cuda.is_available), then torch.accelerator.
            # current_stream().is_capturing(): the real stream query, which without
            # a GPU raises "CUDA driver version is insufficient" (a CPU build skips
            # the check). A GPU job's current stream is not capturing.
            stack.enter_context(mock.patch.object(torch.accelerator, "current_stream",
                                                  lambda device=None: _NotCapturing()))
            stack.enter_context(mock.patch.object(dist, "get_backend", get_backend))
            stack.enter_context(mock.patch.object(dist, "get_backend_config", get_backend_config))
            stack.enter_context(mock.patch.object(torch.Tensor, "to", to))
            # nothing to pin on a CPU-only build: the tensor itself
            stack.enter_context(mock.patch.object(torch.Tensor, "pin_memory",
                                                  lambda t, *a, **kw: t))
            stack.enter_context(mock.patch.object(dist, "all_reduce", all_reduce))
            yield self
