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
process groups, see _fully_shard._reduce_scatter_group), high priority, made
once per root; the all-reduce stream when an HSDP unit first needs it:

    compute:  ... writes the input ─ record E1 ..................... wait E2 ─ reads the output
    side:                  wait E1 ─ collective (async_op=False) ─ record E2

- ``async_op=False`` inside the side stream's context: c10d (torch >= 2.8)
  launches the kernel on our stream, without blocking the CPU.
- Everything the collective touches is allocated on the compute stream before
  switching, and the Pending keeps it alive until compute waited E2: a block
  is freed only once compute is ordered after its last use (no record_stream).
- Nothing blocks the CPU: the backward schedule is FSDP2's (gloo's, switched on
  by ``BlockingStreams.hook_split_node``: [Note: gloo backward] in _state.py).

[Note: post-reduce] What follows a reduce-scatter on CUDA (post-divide, cast,
fold into ``p.grad``, offload's non-blocking copy to pinned host memory) runs
on its side stream right after it (``reduce_scatter(then=)``); with HSDP on the
all-reduce stream, which waits for the reduce-scatter and all-reduces first.
E2 (after the collective) is what ``Pending.wait()`` orders compute after (the
next unit's launch); E3 (after the post-reduce) compute waits for in
``finish_backward``, and the post-reduce's output lives until then. Every
side-stream context starts by waiting the compute stream (``_on``), so its
pool's blocks are reused only after a later compute event. If the post-reduce
raises, its event is still recorded and compute waits for it before the error
propagates. Work reading those host copies, folds needing the used-flags'
counts (``after_backward``) and the step's host-to-device copies (``copy_in``)
wait for ONE synchronisation at the end of backward (eval: ``end_eval_forward``);
only then may the optimizer rewrite a pinned shard. Every intended host
synchronisation is marked ``runtime.intended_sync(why)`` (tests/_cuda_rules.py).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, NamedTuple, Protocol

import torch
import torch.distributed as dist

from . import _collectives, _divergence


class Pending(NamedTuple):
    work: Any  # a dist.Work, or one of _collectives' works (ReduceScatterWork, ...)
    keep_alive: tuple  # tensors the collective reads or writes
    what: tuple[str, str] | None = None  # (unit fqn, which collective): named if it never completes

    def wait(self):
        """Block until the data is there; a reduce-scatter returns its result.
        A collective that cannot complete (see [Note: divergence] in
        _divergence.py) raises a DivergenceError naming the unit and collective."""
        try:
            return self.work.wait()
        except _divergence.CollectiveStopped as e:
            if self.what is None:
                raise
            raise _divergence.collective_error(*self.what, e) from e


class Backend(Protocol):
    """How a root's collectives run and are waited: the one seam between the
    schedule and the device. One object per root, chosen at lazy init
    (``make_streams``):

    - ``StreamManager``: a device with streams (NCCL): the side-stream
      protocol ([Note: side streams]) and FSDP2's backward schedule;
    - ``BlockingStreams``: CPU (gloo): waits block, bucket buffers are kept
      ([Note: bucket buffers]), and the gloo backward ([Note: gloo backward]
      in _state.py), which ``hook_split_node`` alone switches on.

    The schedule (``_state.RootContext``) and the groups call only these
    members; neither branches on which backend it has."""

    device: torch.device

    @property
    def runtime(self) -> Any:
        """The device's stream runtime (None: no streams)."""
        ...

    @property
    def host_work_pending(self) -> bool:
        """Host copies wait for the end-of-backward sync (``finish_backward``)."""
        ...

    # ---------------------------------------------------------- collectives
    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, group,
                   what: tuple | None = None, bounds: tuple | None = None,
                   padded: bool | None = None) -> Pending: ...

    def reduce_scatter(self, flat_grad: torch.Tensor, group, op=dist.ReduceOp.AVG,
                       then=None, all_reduce: bool = False, what: tuple | None = None,
                       bounds: tuple | None = None, padded: bool | None = None) -> Pending: ...

    def all_reduce(self, tensor: torch.Tensor, group, op=dist.ReduceOp.SUM,
                   what: tuple | None = None) -> Pending: ...

    def replica_all_reduce(self, tensor: torch.Tensor, op, group, what: tuple) -> None:
        """HSDP: ``tensor`` (gradient shards, or their flags) across the
        replicas, in place, in a post-reduce (on CUDA its side stream)."""
        ...

    def min_across(self, values: list[int], shard_groups: list,
                   replicate_groups: list) -> list[int]: ...

    # ------------------------------------------------------- the backward
    def hook_split_node(self, node, hook) -> bool:
        """Register ``hook`` as a pre-hook of a group's split node if this
        backend runs the gloo backward ([Note: gloo backward] in _state.py);
        returns whether it did."""
        ...

    # ------------------------------------------------------------- buffers
    def bucket(self, kind: str, numel: int, dtype: torch.dtype, device: torch.device,
               holder=None) -> torch.Tensor: ...

    def holder_of(self, kind: str, dtype: torch.dtype, device: torch.device) -> Any: ...

    def release(self, buf: torch.Tensor) -> None: ...

    def ready(self, result: torch.Tensor) -> Pending: ...

    def hold(self, t: torch.Tensor) -> None: ...

    def to_device(self, t: torch.Tensor) -> torch.Tensor: ...

    # --------------------------------------------------------- host copies
    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, from_host: bool) -> None: ...

    def to_host(self, t: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor: ...

    def on_host(self, fn) -> None: ...

    def after_backward(self, t: torch.Tensor, fn) -> None: ...

    # ---------------------------------------------------------------- ends
    def finish_backward(self) -> None: ...

    def end_eval_forward(self) -> None: ...

    def abort(self) -> None: ...


class CudaRuntime:
    """What the side-stream protocol needs from a device runtime: torch.cuda's,
    on the manager's device (not the current one: a process may drive several)."""

    def __init__(self, device: torch.device):
        self.device = device

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def new_stream(self):
        return torch.cuda.Stream(device=self.device, priority=-1)

    @staticmethod
    def use(stream):
        return torch.cuda.stream(stream)

    @staticmethod
    def intended_sync(why: str):
        """Marks a host synchronisation the protocol means (a CPU-side rule
        checker flags the others inside forward and backward)."""
        return contextlib.nullcontext()

    @staticmethod
    def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=pin)

    @staticmethod
    def host_to_device(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    @staticmethod
    def device_to_host(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A small host tensor on ``device``, on the current stream, without a
        sync: from pinned memory, non-blocking."""
        return t.pin_memory().to(device, non_blocking=True)


def default_runtime(device: torch.device) -> "CudaRuntime | None":
    """torch.cuda's streams and events on a CUDA device; None elsewhere (gloo:
    no side streams, ``wait()`` blocks the CPU)."""
    return CudaRuntime(device) if device.type == "cuda" else None


_runtime_for: Callable[[torch.device], object] = default_runtime


@contextlib.contextmanager
def runtime_factory(runtime_for: Callable[[torch.device], object]) -> Iterator[None]:
    """Every ``StreamManager`` made inside (one per root, at lazy init) takes
    its runtime from ``runtime_for(device)`` (None: no side streams) instead
    of ``default_runtime``: the constructor seam for a test double."""
    global _runtime_for
    prev, _runtime_for = _runtime_for, runtime_for
    try:
        yield
    finally:
        _runtime_for = prev


def runtime_for(device: torch.device):
    """The stream runtime of ``device`` (the seam ``runtime_factory`` swaps)."""
    return _runtime_for(device)


class _EventWork:
    """A collective finished on a side stream when ``event`` completes."""

    def __init__(self, runtime, event, result=None):
        self._rt, self.event, self.result = runtime, event, result

    def wait(self):
        """Order the caller's current stream after the collective (every call:
        the caller may be on another stream the next time)."""
        self._rt.current_stream().wait_event(self.event)
        return self.result


class StreamManager:
    """The side-stream protocol (CUDA): one per root, shared by every unit
    below it. ``BlockingStreams`` is the same interface where a wait blocks
    the CPU (gloo); ``make_streams`` chooses at lazy init."""

    # waits only order streams: FSDP2's backward schedule (hook_split_node: no hook)

    def __init__(self, device: torch.device, runtime):
        self.device = device
        self._rt = runtime
        self.all_gather_stream = runtime.new_stream()
        self.reduce_scatter_stream = runtime.new_stream()
        self._all_reduce_stream = None  # made when an HSDP unit first reduces
        self._held: list = []           # kept alive by the post-reduce running now
        self._host_copies = False       # a copy to or from host memory since the last sync
        self._on_host: list = []        # work that reads such copies: after the sync
        self._post_reduces: list = []   # CUDA: (event, tensors) waited at the end of backward
        self._reads: list = []          # CUDA: (device tensor, fn(values)) after the sync

    @property
    def runtime(self):
        """The stream runtime."""
        return self._rt

    def _on(self, stream, issue, then=None, post=None, after=None):
        """Run ``issue()`` (returns a work) on ``stream``, then ``then(result)``
        on the same stream, see [Note: side streams]. ``post``: the tensors
        the post-reduce (``then``) reads or makes, kept until the compute
        stream waited for it at the end of backward (``finish_backward``);
        the returned work then waits for the collective only (what the next
        unit needs), see [Note: post-reduce]. ``after``: an event of another
        side stream to wait for too.

        If anything raises on the side stream (an OOM in a cast, a failed
        pinned allocation, an HSDP all-reduce error), the side stream still
        records its event and the caller's stream waits for it before the
        error propagates: the buffers go back to the allocator ordered after
        every use the side stream had already enqueued."""
        rt = self._rt
        caller = rt.current_stream()
        inputs_ready = caller.record_event()
        with rt.use(stream):
            stream.wait_event(inputs_ready)
            if after is not None:
                stream.wait_event(after)
            ok = False
            try:
                result = issue().wait()  # async_op=False: already enqueued, the CPU goes on
                if then is not None:
                    issued = stream.record_event()
                    then(result)
                ok = True
            finally:
                done = stream.record_event()
                if not ok:
                    caller.wait_event(done)
        if then is None:
            return _EventWork(rt, done, result)
        self._post_reduces.append((done, post))
        return _EventWork(rt, issued, result)

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, group,
                   what: tuple | None = None, bounds: tuple | None = None,
                   padded: bool | None = None) -> Pending:
        """``bounds``, ``padded``: uneven pieces (see ``_collectives.all_gather``)."""
        work = self._on(self.all_gather_stream,
                        lambda: _collectives.all_gather(output, shard, group, async_op=False,
                                                        bounds=bounds, padded=padded))
        return Pending(work, (output, shard), what)

    def reduce_scatter(self, flat_grad: torch.Tensor, group, op=dist.ReduceOp.AVG,
                       then=None, all_reduce: bool = False, what: tuple | None = None,
                       bounds: tuple | None = None, padded: bool | None = None) -> Pending:
        """``then(output)``: on CUDA, the post-reduce (see [Note: post-reduce]),
        run at once on a side stream (the all-reduce stream if ``all_reduce``);
        the Pending's ``wait()`` orders the caller after the reduce-scatter,
        ``finish_backward`` after the post-reduce. ``bounds``: uneven pieces
        (see ``_collectives.reduce_scatter``)."""
        # the output is allocated here, on the compute stream (see the Note)
        if bounds is None:
            out = flat_grad.new_empty(flat_grad.numel() // dist.get_world_size(group))
        else:
            r = dist.get_rank(group)
            out = flat_grad.new_empty(bounds[r + 1] - bounds[r])
        self._held = []
        hsdp = all_reduce and then is not None
        post = [out]  # (the input: read by the collective only, freed once it is waited)
        try:
            work = self._on(self.reduce_scatter_stream,
                            lambda: _collectives.reduce_scatter(flat_grad, group, op, out=out,
                                                                async_op=False,
                                                                bounds=bounds, padded=padded),
                            None if hsdp else then, post)
            if hsdp:  # the post-reduce on the all-reduce stream, after the reduce-scatter
                reduced = work.event
                self._on(self._all_reduce_side_stream(), lambda: _collectives.Ready(out),
                         then, post, after=reduced)
                # the next unit waits for the reduce-scatter only, not for the
                # all-reduce stream (which runs the earlier units' post-reduces too)
                work = _EventWork(self._rt, reduced, out)
        finally:
            post.extend(self._held)
            self._held = []
        return Pending(work, (flat_grad, out), what)

    def all_reduce(self, tensor: torch.Tensor, group, op=dist.ReduceOp.SUM,
                   what: tuple | None = None) -> Pending:
        """In place; small tensors that travel with the reduce-scatters (the
        used-flags of [Note: parameters without a gradient] in _grad_path.py),
        so on the reduce-scatter stream, issued ``async_op=False`` there (as
        the reduce-scatters: ``async_op=True`` would run it on c10d's internal
        stream, which the next reduce-scatter would then wait for)."""
        work = self._on(self.reduce_scatter_stream,
                        lambda: _collectives.all_reduce_async(tensor, op, group, async_op=False))
        return Pending(work, (tensor,), what)

    def replica_all_reduce(self, tensor: torch.Tensor, op, group, what: tuple) -> None:
        """On the all-reduce stream, where the post-reduce runs: waits order streams."""
        _collectives.all_reduce(tensor, op, group, what, blocks_cpu=False)

    @staticmethod
    def hook_split_node(node, hook) -> bool:
        """FSDP2's backward schedule: no hook."""
        return False

    def min_across(self, values: list[int], shard_groups: list,
                   replicate_groups: list) -> list[int]:
        """The element-wise minimum of ``values`` over the groups, read on the
        host (the forward-order agreement, [Note: forward order] in _forward_walk.py).
        On CUDA each group's on the stream of its other collectives (a shard
        group's all-gathers, a replicate group's all-reduces): NCCL kernels of
        one communicator on two streams could run concurrently and deadlock.
        The tensor is made on the compute stream (from pinned memory), each
        side stream waits for compute before touching it (as every side-stream
        context does: [Note: side streams]), and the result comes back in ONE
        host synchronisation, intended (a forward pre-hook needs the answer)."""
        rt = self._rt
        t = rt.to_device(torch.tensor(values, dtype=torch.int64), self.device)
        for groups, stream in ((shard_groups, self.all_gather_stream),
                               (replicate_groups, None)):
            if groups:
                stream = stream or self._all_reduce_side_stream()
                self._on(stream, lambda g=groups: _collectives.min_in_place(t, g)).wait()
        host = rt.host_empty(len(values), torch.int64, pin=True)
        rt.device_to_host(host, t)
        with rt.intended_sync("the forward-order agreement"):
            rt.current_stream().record_event().synchronize()
        return host.tolist()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A small host tensor (flags) on the manager's device, on the current
        stream; on CUDA from pinned memory, without a host sync."""
        return self._rt.to_device(t, self.device)

    def _all_reduce_side_stream(self):
        if self._all_reduce_stream is None:
            self._all_reduce_stream = self._rt.new_stream()
        return self._all_reduce_stream

    # -------------------------------------------------------- bucket buffers
    @staticmethod
    def bucket(kind: str, numel: int, dtype: torch.dtype, device: torch.device,
               holder=None) -> torch.Tensor:
        """A buffer for an all-gather or reduce-scatter bucket (``kind``),
        given back with ``release``: fresh (the caching allocator reuses
        blocks itself; gloo keeps one, see [Note: bucket buffers])."""
        return torch.empty(numel, dtype=dtype, device=device)

    @staticmethod
    def holder_of(kind: str, dtype: torch.dtype, device: torch.device):
        """Nothing is kept (fresh buffers)."""
        return None

    @staticmethod
    def release(buf: torch.Tensor) -> None:
        """``buf`` (from ``bucket``) is no longer read or written."""

    @staticmethod
    def ready(result: torch.Tensor) -> Pending:
        """Nothing to communicate (one rank): ``wait()`` returns ``result``."""
        return Pending(_collectives.Ready(result), ())

    # ---------------------------------------------------------- post-reduce
    def hold(self, t: torch.Tensor) -> None:
        """Keep ``t`` (made on the compute stream, last read by the post-reduce
        running now) alive until the compute stream has waited for it."""
        self._held.append(t)

    # --------------------------------------------------------- host copies
    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, from_host: bool) -> None:
        """Copy a shard into the unsharded flat (cast and/or host-to-device),
        on the current (compute) stream. From host memory on CUDA: non-blocking,
        and the end of backward synchronises before the shard can be rewritten."""
        if from_host:
            self._rt.host_to_device(dst, src)
            self._host_copies = True
        else:
            dst.copy_(src, non_blocking=src.is_pinned())

    def to_host(self, t: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """``t`` in ``dtype`` in host memory. CUDA: a non-blocking copy on the
        current stream into a fresh (pinned) buffer; read it only in work
        passed to ``on_host``."""
        src = t if t.dtype == dtype else t.to(dtype)
        dst = self._rt.host_empty(src.numel(), dtype, pin)
        self._rt.device_to_host(dst, src)
        self._host_copies = True
        return dst

    def on_host(self, fn) -> None:
        """Run ``fn`` once the host copies issued so far have landed: after
        the end-of-backward synchronisation."""
        self._on_host.append(fn)

    def after_backward(self, t: torch.Tensor, fn) -> None:
        """``fn(t.tolist())`` at the end of backward, where ONE host
        synchronisation reads every such tensor (the used-flags' counts on
        CUDA: no host sync per reduce-scatter)."""
        self._reads.append((t, fn))

    @property
    def host_work_pending(self) -> bool:
        """Something waits for the end-of-backward synchronisation."""
        return self._host_copies or bool(self._reads)

    def finish_backward(self) -> None:
        """End of backward, after every reduce-scatter was waited: the compute
        stream waits for every post-reduce (FSDP2 waits them here too: the
        next unit only needed the reduce-scatter), then ONE CPU
        synchronisation covers every host copy of the step and every value
        read back (see [Note: post-reduce])."""
        compute = self._rt.current_stream()
        for event, _ in self._post_reduces:
            compute.wait_event(event)
        self._post_reduces = []
        if not self._host_copies and not self._reads:
            return
        reads, self._reads = self._reads, []
        host = None
        if reads:  # one copy of every value to read
            flat = torch.cat([t.reshape(-1).to(torch.float32) for t, _ in reads])
            host = self._rt.host_empty(flat.numel(), flat.dtype, pin=True)
            self._rt.device_to_host(host, flat)
        with self._rt.intended_sync("the end of backward: host copies and used-flags"):
            compute.record_event().synchronize()
        self._host_copies = False
        fns, self._on_host = self._on_host, []
        for fn in fns:
            fn()
        if reads:
            values, at = host.tolist(), 0  # type: ignore[union-attr]
            for t, fn in reads:
                fn(values[at:at + t.numel()])
                at += t.numel()

    def end_eval_forward(self) -> None:
        """A root forward with no backward to follow (eval): its host-to-device
        copies of offloaded shards are synchronised now, once, so the CPU may
        rewrite the shards (an optimizer, a checkpoint load) without racing
        them; a training forward leaves it to the end of backward."""
        if not self._host_copies or self._on_host or self._reads:
            return
        with self._rt.intended_sync("an eval forward's host-to-device copies"):
            self._rt.current_stream().record_event().synchronize()
        self._host_copies = False

    def abort(self) -> None:
        """After a backward raised, for the reduce-scatters it left in flight
        (dropped unread): the compute stream waits for every post-reduce (on
        CUDA each collective is followed on its stream by its post-reduce, so
        this orders the compute stream after the collective too, and its
        buffers may go back to the allocator); the work that would have read
        host copies is dropped."""
        compute = self._rt.current_stream()
        for event, _ in self._post_reduces:
            compute.wait_event(event)
        # No synchronisation: the copies of the dropped step are covered by the
        # next one (end of backward, eval forward), as they are on the compute
        # stream or ordered before it; the pinned buffers they write are the
        # host allocator's to keep until the copies are done.
        self._post_reduces = []
        self._reads = []
        self._host_copies = False
        self._on_host = []

    def __repr__(self) -> str:
        return f"StreamManager(device={self.device}, mode=side-streams)"


class BlockingStreams:
    """``StreamManager``'s interface where a wait blocks the CPU (gloo on
    CPU, no stream runtime): collectives are issued ``async_op=True`` on the
    default stream, host copies are plain copies, and the backward frees a
    unit's parameters once its gradients are computed ([Note: gloo backward]
    in _state.py, switched on by ``hook_split_node``). Bucket buffers are
    kept (see ``bucket``)."""

    runtime = None
    host_work_pending = False

    def __init__(self, device: torch.device):
        self.device = device
        self._buckets: dict = {}  # (kind, dtype, device) -> [buffer, holder or None]

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, group,
                   what: tuple | None = None, bounds: tuple | None = None,
                   padded: bool | None = None) -> Pending:
        return Pending(_collectives.all_gather(output, shard, group, bounds=bounds,
                                               padded=padded), (output, shard), what)

    def reduce_scatter(self, flat_grad: torch.Tensor, group, op=dist.ReduceOp.AVG,
                       then=None, all_reduce: bool = False, what: tuple | None = None,
                       bounds: tuple | None = None, padded: bool | None = None) -> Pending:
        """``then`` is not run here: the caller runs it after ``wait()``."""
        return Pending(_collectives.reduce_scatter(flat_grad, group, op, bounds=bounds,
                                                   padded=padded), (flat_grad,), what)

    def all_reduce(self, tensor: torch.Tensor, group, op=dist.ReduceOp.SUM,
                   what: tuple | None = None) -> Pending:
        return Pending(_collectives.all_reduce_async(tensor, op, group), (tensor,), what)

    @staticmethod
    def replica_all_reduce(tensor: torch.Tensor, op, group, what: tuple) -> None:
        """Blocking, waited in slices (a stopped collective names ``what``)."""
        _collectives.all_reduce(tensor, op, group, what, blocks_cpu=True)

    @staticmethod
    def hook_split_node(node, hook) -> bool:
        """The gloo backward: each split node reports its gradients computed."""
        node.register_prehook(hook)
        return True

    def min_across(self, values: list[int], shard_groups: list,
                   replicate_groups: list) -> list[int]:
        return _collectives.min_across(values, shard_groups + replicate_groups)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def bucket(self, kind: str, numel: int, dtype: torch.dtype, device: torch.device,
               holder=None) -> torch.Tensor:
        """[Note: bucket buffers] Each kind, dtype and device has one buffer
        per root, made at the first bucket (regrown to the largest seen) and
        kept: a bucket costs its size once instead of leaving heap holes
        several times a step (docs/design.md, "Peak RSS of small units"). A
        buffer still in use when the next bucket of its kind comes (its
        ``holder``, see ``holder_of``) is not handed out again: that bucket
        gets a fresh tensor. The caller flushes a holder it can flush first
        (an all-gather bucket copies its remaining chunks out,
        _flat_group.gather_bucket); one it cannot (a reduce-scatter in flight;
        a backward that raised with one in flight: gloo may still write it)
        keeps the buffer."""
        key = (kind, dtype, device)
        kept = self._buckets.get(key)
        if kept is not None and kept[1] is not None:
            return torch.empty(numel, dtype=dtype, device=device)
        if kept is None or kept[0].numel() < numel:
            kept = self._buckets[key] = [torch.empty(numel, dtype=dtype, device=device), None]
        kept[1] = holder if holder is not None else True
        return kept[0][:numel]

    def holder_of(self, kind: str, dtype: torch.dtype, device: torch.device):
        """What still holds the kept buffer of ``kind`` (None: it is free)."""
        kept = self._buckets.get((kind, dtype, device))
        return None if kept is None else kept[1]

    def release(self, buf: torch.Tensor) -> None:
        for kept in self._buckets.values():
            if kept[1] is not None and buf.data_ptr() == kept[0].data_ptr():
                kept[1] = None

    ready = staticmethod(StreamManager.ready)

    def hold(self, t: torch.Tensor) -> None:
        """Nothing to keep: gloo's works hold their tensors themselves."""

    @staticmethod
    def copy_in(dst: torch.Tensor, src: torch.Tensor, from_host: bool) -> None:
        dst.copy_(src, non_blocking=src.is_pinned())

    @staticmethod
    def to_host(t: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        return t.to(torch.device("cpu"), dtype)

    @staticmethod
    def on_host(fn) -> None:
        fn()  # (a plain copy has landed)

    @staticmethod
    def after_backward(t: torch.Tensor, fn) -> None:
        fn(t.tolist())  # (no host sync to save)

    def finish_backward(self) -> None:
        pass

    def end_eval_forward(self) -> None:
        pass

    def abort(self) -> None:
        """A bucket buffer a dropped collective may still write is not reused."""
        self._buckets = {k: v for k, v in self._buckets.items() if v[1] is None}

    def __repr__(self) -> str:
        return f"BlockingStreams(device={self.device})"


def make_streams(device: torch.device) -> Backend:
    """A root's backend (lazy init): the side-stream protocol where ``device``
    has a stream runtime (``runtime_for``), else the blocking one."""
    runtime = runtime_for(device)
    if runtime is None:
        return BlockingStreams(device)
    return StreamManager(device, runtime)
