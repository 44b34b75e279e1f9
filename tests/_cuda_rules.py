"""CUDA's rules for streams, events and the caching allocator, checked on CPU.

``CudaRules`` is both the stream runtime of ``fsdp_compose._comm._streams.StreamManager``
(the seam ``runtime_factory``: ``current_stream``, ``new_stream``, ``use``,
host buffers and copies) and a ``TorchDispatchMode`` that sees every aten and
c10d op run while it is active. This machine has no GPU: the tensors are CPU
tensors, and the model decides which of them stand for device memory and on
which stream each op would run on a GPU. It is our own model of the rules, not
torch's CUDA sanitizer (which needs a GPU).

What is modelled
----------------
* Participants: every stream the runtime makes (``compute`` is the current
  stream outside any ``use``), and ``host`` (the CPU thread).
* Storages (``untyped_storage``): *device* memory, except what stands for host
  memory: the runtime's ``host_empty`` buffers, ``torch.tensor(data)`` (made
  on the CPU in real code), storages a test marks (``mark_host``: an
  offloaded shard), the outputs of ops whose tensors are all host tensors,
  0-dim results of factories (host scalars, which CUDA takes by value) and
  storages made by no op while the checker runs (a file read, a pickle).
  Tensors alive when the checker starts are device memory made on the
  compute stream (the model, its optimizer). A device storage has an
  *allocating stream* (the current stream when it was made; resized up from
  0 bytes: a new allocation).
* An op runs on the current stream when it touches device memory, else on the
  host. ``Tensor.to(cpu)`` of a host literal stands for a copy onto the
  device (CPU stands for the device here; other host tensors keep it a
  no-op, as on a GPU machine). Every launch on a stream is ordered after what the host did before it
  (the stream's vector clock takes the host's); the host is ordered after a
  stream only by a synchronisation: ``event.synchronize()``,
  ``stream.synchronize()``, a device value read on the host (``.item()``,
  ``.tolist()``) or a blocking copy (``Tensor.to`` of a host tensor onto the
  device without ``non_blocking``), each of which synchronises the current
  stream.
* Happens-before: vector clocks. ``record_event`` snapshots the stream's
  clock; ``wait_event`` / ``wait_stream`` join it into the waiting stream's.
* Reads and writes of each op come from its schema (``Tensor(a!)``: written;
  other tensor arguments: read; outputs: written, fresh); view ops access
  nothing. c10d collectives (whose schemas do not mark the tensors they
  write) from a table: an all-reduce / broadcast reads and writes its
  tensors, an all-gather or reduce-scatter reads its input and writes its
  output.

What is flagged (each as a ``Violation`` naming both accesses: op,
participant, file:line of the innermost frame in the package, else the test)
----------------------------------------------------------------------------
1. ``race``: two accesses to one storage from different participants, at
   least one a write, neither ordered before the other.
2. ``reuse``: a device storage freed (last reference dropped, or
   ``untyped_storage().resize_(0)``) goes back to its allocating stream's
   pool with its uses on other streams; the next allocation on that stream
   may get the block, so at that allocation every such use must be ordered
   before the allocating stream (what ``record_stream`` would otherwise do).
3. ``sync in hook``: a host synchronisation inside a forward (``in_forward``,
   the scenario's model call) or a backward (the autograd engine runs a
   graph task), unless the package marked it as intended
   (``runtime.intended_sync(why)``).
4. ``order``: collectives on two process groups issued in a different
   relative order on two ranks that are in both (``collectives`` of every
   rank compared by ``check_orders`` after the scenario).
5. ``async``: a collective on device memory issued with ``async_op=True``
   on a side stream (NCCL would run it on c10d's internal stream; the
   protocol issues every side-stream collective ``async_op=False``).
   Elsewhere an ``async_op=True`` collective is modelled on the current
   stream.
6. ``mixed``: one op on a host tensor (not 0-dim) and a device tensor, other
   than a copy (a copy between them is a blocking copy: a host sync).

What it cannot see: kernel timing (a race is flagged whether or not the
kernels would overlap), NCCL internals (a collective is one access by its
stream; its completion across ranks, its internal stream and channels are not
modelled), memory the package reaches other than through ops (data pointers,
DLPack), and CUDA's behaviour with ``CUDA_LAUNCH_BLOCKING`` or graphs.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

_PKG = os.sep + "fsdp_compose" + os.sep
_HERE = os.path.abspath(__file__)
_TORCH = os.path.dirname(torch.__file__)
_STDLIB = os.path.dirname(os.__file__)
HOST = "host"


_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


class Violation(AssertionError):
    pass


def _where() -> str:
    """file:line of the innermost frame in fsdp_compose, else the innermost
    frame outside torch and this file (the scenario)."""
    f = sys._getframe(2)
    outside = None
    while f is not None:
        name = f.f_code.co_filename
        if _PKG in name:
            return f"{name.split(_PKG)[-1]}:{f.f_lineno} ({f.f_code.co_name})"
        if outside is None and name != _HERE and not name.startswith(_TORCH) \
                and not name.startswith(_STDLIB):
            outside = f"{os.path.basename(name)}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return outside or "?"


@dataclass
class Access:
    who: str       # participant
    seq: int       # its clock when it made the access
    op: str
    where: str
    write: bool

    def __str__(self) -> str:
        return f"{'write' if self.write else 'read'} by {self.op} on {self.who} at {self.where}"


@dataclass
class _Storage:
    host: bool
    alloc: str                       # allocating stream (device storages)
    write: Access | None = None
    reads: dict = field(default_factory=dict)   # participant -> latest read
    uses: dict = field(default_factory=dict)    # participant -> latest access
    made: str = ""
    literal: bool = False            # torch.tensor(data): a host literal, see ``Tensor.to``


class Event:
    def __init__(self, rules: "CudaRules", stream: "Stream", clock: dict, last_op: str,
                 last_tag: str | None = None):
        self.rules, self.stream, self.clock, self.last_op = rules, stream, clock, last_op
        self.last_tag = last_tag
        self.id = next(rules._ids)

    def synchronize(self) -> None:
        self.rules._host_sync(self.clock, f"event.synchronize() of {self.stream.name}")

    def query(self) -> bool:
        return True


class Stream:
    def __init__(self, rules: "CudaRules", name: str):
        self.rules, self.name = rules, name
        self.last_op = ""
        self.last_tag = None  # the test's tag (CudaRules.tag) when its last op ran

    def record_event(self, event=None) -> Event:
        rules = self.rules
        clock = rules._launch(self.name)
        ev = Event(rules, self, dict(clock), self.last_op, self.last_tag)
        rules.log.append(("record", self.name, ev.id, self.last_op))
        return ev

    def wait_event(self, event: Event) -> None:
        rules = self.rules
        _join(rules._launch(self.name), event.clock)
        rules.log.append(("wait", self.name, event.id, event.stream.name, event.last_op,
                          event.last_tag))

    def wait_stream(self, other: "Stream") -> None:
        self.wait_event(other.record_event())

    def synchronize(self) -> None:
        self.rules._host_sync(dict(self.rules._clock(self.name)),
                              f"stream.synchronize() of {self.name}")

    def __repr__(self) -> str:
        return f"Stream({self.name})"


def _join(into: dict, other: dict) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


def _tensors(x) -> list:
    if isinstance(x, DTensor):  # (a sharded parameter, its grad: the memory is its local
        return [x._local_tensor]  # tensor; the wrapper has none, and its ops reach no mode)
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


_OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "scatter_object_list",
                       "gather_object")

# c10d ops: (indices of read-and-written args, indices of read args, indices of written args)
_C10D = {
    "allreduce_": ((0,), (), ()),
    "broadcast_": ((0,), (), ()),
    "_allgather_base_": ((), (1,), (0,)),
    "allgather_into_tensor_coalesced_": ((), (1,), (0,)),
    "_reduce_scatter_base_": ((), (1,), (0,)),
    "reduce_scatter_tensor_coalesced_": ((), (1,), (0,)),
}


class CudaRules(TorchDispatchMode):
    """See the module docstring. Use ``with rules.active():`` around a
    scenario; ``violations`` lists what was flagged (``strict``: raise at the
    first one, with both accesses)."""

    def __init__(self, side_streams=("ag", "rs", "ar", "s3", "s4"), strict: bool = True):
        super().__init__()
        self.strict = strict
        self.violations: list[str] = []
        self.log: list = []            # record / wait / sync / alloc-check events
        self.collectives: list = []    # (group name, kind) in issue order (rule 4)
        self.syncs: list = []          # (what, where, in hook, intended)
        self.members: dict = {}        # group name -> (its name with its ranks, its ranks)
        self._ids = itertools.count()
        self._names = iter(side_streams)
        self._clocks: dict[str, dict] = {HOST: {HOST: 0}, "compute": {"compute": 0}}
        self._compute = Stream(self, "compute")
        self._stack = [self._compute]
        self._st: dict[int, _Storage] = {}
        # stream -> [(storage info, [pending Access], free where)]
        self._pools: dict[str, list] = {}
        self._intended: list[str] = []
        self._forward = 0
        self._off = 0
        self._fail: list = []
        self._tag = None

    # ------------------------------------------------------------ runtime API
    def current_stream(self, device=None) -> Stream:
        return self._stack[-1]

    def new_stream(self, device=None) -> Stream:
        s = Stream(self, next(self._names))
        self._clocks[s.name] = {s.name: 0}
        return s

    @contextlib.contextmanager
    def use(self, stream: Stream):
        self._stack.append(stream)
        try:
            yield
        finally:
            self._stack.pop()

    @contextlib.contextmanager
    def intended_sync(self, why: str):
        self._intended.append(why)
        try:
            yield
        finally:
            self._intended.pop()

    def host_empty(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        with self._paused():
            t = torch.empty(numel, dtype=dtype)
        self._new(t, host=True, who=HOST)
        return t

    def host_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Non-blocking copy on the current stream (pinned source)."""
        self._copy(dst, src, "host_to_device")

    def device_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._copy(dst, src, "device_to_host")

    def to_device(self, t: torch.Tensor, device) -> torch.Tensor:
        """A host tensor copied onto the device, non-blocking from pinned
        memory, on the current stream (a fresh device allocation)."""
        with self._paused():
            out = torch.empty_like(t)
        self._new(out, host=False, who=self.current_stream().name)
        self._copy(out, t, "to_device")
        return out

    def _copy(self, dst, src, what) -> None:
        who = self.current_stream().name
        where = _where()
        self._launch(who)
        self._mark_last(what)
        self._access(src, who, what, where, write=False)
        self._access(dst, who, what, where, write=True)
        with self._paused():
            dst.copy_(src)

    # ------------------------------------------------------------- test API
    @contextlib.contextmanager
    def active(self) -> Iterator["CudaRules"]:
        """The mode, the runtime seam and the patches (``.tolist()``,
        ``Tensor.to``, ``UntypedStorage.resize_``, the collectives' issue
        order) for the scenario inside."""
        from fsdp_compose._comm import _streams

        rules = self
        real_tolist, real_to = torch.Tensor.tolist, torch.Tensor.to
        real_resize = torch.UntypedStorage.resize_

        def tolist(t):
            if not rules._off:
                rules._host_read(t, "tolist")
            with rules._paused():
                return real_tolist(t)

        def to(t, *args, **kw):
            target = kw.get("device", args[0] if args and not isinstance(args[0], torch.dtype)
                            else None)
            if isinstance(target, torch.Tensor):
                target = target.device
            if rules._off or not isinstance(target, (str, torch.device)) \
                    or torch.device(target).type != "cpu" or not rules._is_literal(t):
                return real_to(t, *args, **kw)
            # a host literal (torch.tensor(data)) moved "onto the device" (CPU stands
            # for it here); other host tensors (offloaded data) keep ``.to(cpu)``
            # a no-op, as on a GPU machine
            dtype = kw.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), t.dtype))
            blocking = not kw.get("non_blocking", False)
            out = rules.to_device(t.detach() if not t.requires_grad else t, None)
            if dtype != out.dtype:
                out = out.to(dtype)
            if blocking:
                rules._host_sync(dict(rules._clock(rules.current_stream().name)),
                                 "a blocking host-to-device copy")
            return out

        def resize_(s, n):
            if not rules._off:
                rules._resized(s, n)
            return real_resize(s, n)

        with contextlib.ExitStack() as stack:
            stack.enter_context(_streams.runtime_factory(lambda device: rules))
            stack.enter_context(mock.patch.object(torch.Tensor, "tolist", tolist))
            stack.enter_context(mock.patch.object(torch.Tensor, "to", to))
            stack.enter_context(mock.patch.object(torch.UntypedStorage, "resize_", resize_))
            stack.enter_context(_record_collectives(self))
            for name in _OBJECT_COLLECTIVES:  # pickles in host memory: not modelled
                real = getattr(dist, name, None)
                if real is not None:
                    stack.enter_context(mock.patch.object(dist, name, self._unmodelled(real)))
            self._adopt_existing()
            stack.enter_context(self)
            yield self

    def _unmodelled(self, fn):
        def run(*args, **kw):
            with self._paused():
                return fn(*args, **kw)
        return run

    @contextlib.contextmanager
    def tag(self, label: str):
        """Ops inside carry ``label``: an event recorded after them says so
        in the log of a wait for it (what a stream waited for)."""
        prev, self._tag = self._tag, label
        try:
            yield
        finally:
            self._tag = prev

    @contextlib.contextmanager
    def in_forward(self):
        """The model's forward runs inside (rule 3)."""
        self._forward += 1
        try:
            yield
        finally:
            self._forward -= 1

    def mark_host(self, t: torch.Tensor) -> None:
        """``t`` stands for host memory (e.g. a CPU-offloaded shard)."""
        self._storage(t).host = True

    def fail_when(self, pred: Callable[[str, str], bool], times: int = 1) -> None:
        """Raise RuntimeError("injected failure") at the next ``times`` ops
        for which ``pred(op name, stream)`` holds (a failure inside the
        post-reduce, an OOM)."""
        self._fail.append([pred, times])

    def check(self) -> None:
        if self.violations:
            raise Violation("\n".join(self.violations))

    def _mark_last(self, op: str) -> None:
        stream = self.current_stream()
        stream.last_op, stream.last_tag = op, self._tag

    # --------------------------------------------------------------- clocks
    def _clock(self, who: str) -> dict:
        return self._clocks[who]

    def _launch(self, who: str) -> dict:
        """A new op on ``who``: a stream is ordered after the host's past."""
        clock = self._clocks[who]
        if who != HOST:
            _join(clock, self._clocks[HOST])
        clock[who] = clock.get(who, 0) + 1
        return clock

    def _ordered(self, acc: Access, who: str) -> bool:
        return acc.who == who or self._clocks[who].get(acc.who, 0) >= acc.seq

    def _flag(self, rule: str, text: str) -> None:
        msg = f"[{rule}] {text} (rank {dist.get_rank() if dist.is_initialized() else 0})"
        self.violations.append(msg)
        if self.strict:
            raise Violation(msg)

    def _in_hook(self) -> bool:
        from fsdp_compose._base import _compat

        return self._forward > 0 or _compat.in_backward()

    def _host_sync(self, clock: dict, what: str) -> None:
        self._launch(HOST)
        _join(self._clocks[HOST], clock)
        where = _where()
        hook = self._in_hook()
        self.syncs.append((what, where, hook, bool(self._intended)))
        self.log.append(("sync", what, where))
        if hook and not self._intended:
            self._flag("sync in hook", f"{what} at {where} inside a "
                       f"{'backward' if self._forward == 0 else 'forward'}: it blocks the CPU "
                       "until the stream is done (mark it with intended_sync if it must be)")

    def _host_read(self, t: torch.Tensor, op: str) -> None:
        st = self._storage(t)
        where = _where()
        if not st.host:
            self._host_sync(dict(self._clock(self.current_stream().name)),
                            f"{op} of a device value")
        self._launch(HOST)
        self._access(t, HOST, op, where, write=False)

    # ------------------------------------------------------------- storages
    @contextlib.contextmanager
    def _paused(self):
        self._off += 1
        try:
            yield
        finally:
            self._off -= 1

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def _is_literal(self, t: torch.Tensor) -> bool:
        st = self._st.get(self._key(t))
        return st is not None and st.literal

    def _is_host(self, t: torch.Tensor) -> bool:
        st = self._st.get(self._key(t))
        return st is None or st.host  # (unknown: made by no op, see _storage)

    def _storage(self, t: torch.Tensor) -> _Storage:
        k = self._key(t)
        st = self._st.get(k)
        if st is None:  # made by no op while active (a file read, a pickle): host memory
            st = self._st[k] = _Storage(host=True, alloc="compute", made="outside any op")
            weakref.finalize(t.untyped_storage(), self._freed, k)
        return st

    def _adopt_existing(self) -> None:
        """Every tensor alive when the checker starts stands for device memory
        made on the compute stream (the model, its optimizer), unless marked."""
        for o in gc.get_objects():
            if type(o) in _TENSOR_TYPES and o.device.type == "cpu":
                try:
                    k = self._key(o)
                except (RuntimeError, NotImplementedError):
                    continue
                if k not in self._st:
                    self._st[k] = _Storage(host=False, alloc="compute", made="before")
                    weakref.finalize(o.untyped_storage(), self._freed, k)

    def _new(self, t: torch.Tensor, host: bool, who: str) -> _Storage:
        k = self._key(t)
        if k in self._st and self._st[k].made not in ("before", "outside any op"):
            return self._st[k]
        alloc = "compute" if host else who
        st = self._st[k] = _Storage(host=host, alloc=alloc, made=_where())
        weakref.finalize(t.untyped_storage(), self._freed, k)
        if not host and t.untyped_storage().nbytes() > 0:
            self._allocated(alloc, st.made)
        return st

    def _allocated(self, stream: str, where: str) -> None:
        """An allocation on ``stream``: it may get any block freed to its pool."""
        pool = self._pools.pop(stream, [])
        for made, pending, freed_at in pool:
            late = [a for a in pending if not self._ordered(a, stream)]
            for a in late:
                self._flag("reuse", f"a block allocated on {stream} (made at {made}) was freed "
                           f"at {freed_at} while its {a} was not ordered before {stream}; the "
                           f"allocation at {where} on {stream} may be handed that block")

    def _release(self, st: _Storage, where: str) -> None:
        if st.host:
            return
        pending = [a for who, a in st.uses.items()
                   if who != st.alloc and who != HOST and not self._ordered(a, st.alloc)]
        if pending:
            self._pools.setdefault(st.alloc, []).append((st.made, pending, where))

    def _freed(self, k: int) -> None:
        st = self._st.pop(k, None)
        if st is not None:
            self._release(st, _where())

    def _resized(self, s, n: int) -> None:
        k = s._cdata
        st = self._st.get(k)
        if st is None:
            return
        if n == 0 and s.nbytes() > 0:
            self._release(st, _where())
            self._st[k] = _Storage(host=st.host, alloc=st.alloc, made=st.made)
        elif n > 0 and s.nbytes() == 0 and not st.host:
            who = self.current_stream().name
            self._st[k] = _Storage(host=False, alloc=who, made=_where())
            self._allocated(who, self._st[k].made)

    def _access(self, t: torch.Tensor, who: str, op: str, where: str, write: bool) -> None:
        if t.untyped_storage().nbytes() == 0 and t.numel() == 0:
            return
        st = self._storage(t)
        acc = Access(who, self._clocks[who][who], op, where, write)
        if st.write is not None and not self._ordered(st.write, who):
            self._flag("race", f"{acc} is not ordered after the {st.write}")
        if write:
            for r in st.reads.values():
                if not self._ordered(r, who):
                    self._flag("race", f"{acc} is not ordered after the {r}")
            st.write, st.reads = acc, {}
        else:
            st.reads[who] = acc
        st.uses[who] = acc

    # ------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._off:
            return func(*args, **kwargs)
        name = f"{func.namespace}.{func._schema.name.split('::')[-1]}"
        stream = self.current_stream().name
        for f in self._fail:
            if f[1] > 0 and f[0](name, stream):
                f[1] -= 1
                raise RuntimeError(f"injected failure at {name} on {stream}")
        if func is torch.ops.aten._local_scalar_dense.default:
            self._host_read(args[0], "item")
            with self._paused():
                return func(*args, **kwargs)
        if func is torch.ops.aten.lift_fresh.default:  # torch.tensor(data): host memory
            self._new(args[0], host=True, who=HOST).literal = True
            return func(*args, **kwargs)
        if func.is_view or name in ("aten.detach", "aten.alias", "aten._unsafe_view"):
            return func(*args, **kwargs)
        reads, writes = self._accesses(func, args, kwargs)
        ins = [t for t in reads + writes]
        device = [t for t in ins if not self._is_host(t)]
        host_big = [t for t in ins if self._is_host(t) and (t.dim() > 0)]
        who = stream if (device or not ins) else HOST
        if name.startswith("c10d.") and device and len(self._stack) > 1 \
                and _async_op(func, args, kwargs):
            self._flag("async", f"{name} at {_where()} issued with async_op=True on the side "
                       f"stream {stream}: NCCL would run it on c10d's internal stream, not on "
                       "ours (the protocol issues every side-stream collective async_op=False)")
        if device and host_big and name != "aten.copy_":
            self._flag("mixed", f"{name} at {_where()} mixes host and device tensors")
        where = _where()
        if not ins:  # a factory: a 0-dim result stands for a host scalar (CUDA takes
            # one by value in device ops; on this machine ``device=`` cannot tell)
            out = func(*args, **kwargs)
            outs = _tensors(out)
            if outs and all(t.dim() == 0 for t in outs):
                who = HOST
            self._launch(who)
            for t in outs:
                self._new(t, host=who == HOST, who=who)
                self._access(t, who, name, where, write=True)
            if who != HOST:
                self._mark_last(name)
            return out
        self._launch(who)
        if who != HOST:
            self._mark_last(name)
        for t in reads:
            if who == HOST or not self._is_host(t) or t.dim() > 0:
                self._access(t, who, name, where, write=False)
            else:  # a 0-dim host tensor in a device op: read by value at the launch
                self._launch(HOST)
                self._access(t, HOST, name, where, write=False)
        for t in writes:
            self._access(t, who, name, where, write=True)
        if device and host_big and name == "aten.copy_":  # a blocking copy between them
            self._host_sync(dict(self._clock(stream)), "a blocking copy between host and device")
        out = func(*args, **kwargs)
        known = {self._key(t) for t in ins}
        for t in _tensors(out):
            if self._key(t) in known:
                continue
            self._new(t, host=who == HOST, who=who)
            self._access(t, who, name, where, write=True)
            known.add(self._key(t))
        return out

    def _accesses(self, func, args, kwargs):
        name = func._schema.name.split("::")[-1]
        if func.namespace == "c10d":
            rw, r, w = _C10D.get(name, (tuple(range(len(args))), (), ()))
            reads = [t for i in rw + r if i < len(args) for t in _tensors(args[i])]
            writes = [t for i in rw + w if i < len(args) for t in _tensors(args[i])]
            return reads, writes
        reads, writes = [], []
        for i, a in enumerate(func._schema.arguments):
            v = args[i] if i < len(args) else kwargs.get(a.name)
            ts = _tensors(v)
            if not ts:
                continue
            if a.alias_info is not None and a.alias_info.is_write:
                writes += ts
            else:
                reads += ts
        return reads, writes


def _async_op(func, args, kwargs) -> bool:
    for i, a in enumerate(func._schema.arguments):
        if a.name in ("async_op", "asyncOp"):
            if i < len(args):
                return bool(args[i])
            return bool(kwargs.get(a.name, a.default_value))  # (c10d omits True: the default)
    return False


# ---------------------------------------------------------------- rule 4
_KINDS = ("all_reduce", "broadcast", "all_gather_into_tensor", "all_gather_single",
          "reduce_scatter_tensor", "reduce_scatter_single", "barrier", "all_gather_object")


@contextlib.contextmanager
def _record_collectives(rules: CudaRules):
    """Every collective the package issues, as (group name, kind), in order."""
    from fsdp_compose._comm import _collectives

    def wrap(real, kind):
        def issue(*args, **kw):
            group = kw.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            group = group or dist.group.WORLD
            gname = group.group_name
            if gname not in rules.members:
                ranks = tuple(dist.get_process_group_ranks(group))
                rules.members[gname] = f"{gname}{list(ranks)}", ranks
            rules.collectives.append((rules.members[gname][0], kind))
            return real(*args, **kw)
        return issue

    with contextlib.ExitStack() as stack:
        for kind in _KINDS:
            real = getattr(dist, kind, None)
            if real is not None:
                stack.enter_context(mock.patch.object(dist, kind, wrap(real, kind)))
        for attr, kind in (("_all_gather_tensor", "all_gather"),
                           ("_reduce_scatter_tensor", "reduce_scatter")):
            stack.enter_context(mock.patch.object(_collectives, attr,
                                                  wrap(getattr(_collectives, attr), kind)))
        yield


def check_orders(per_rank: list, members: dict) -> list[str]:
    """Rule 4 over every rank's ``sequence`` (``per_rank[r]``): for two ranks
    and two groups both ranks belong to (``members``: group name -> ranks),
    the two groups' collectives come in the same relative order."""
    bad = []
    names = sorted(members)
    for a, b in itertools.combinations(range(len(per_rank)), 2):
        for g1, g2 in itertools.combinations(names, 2):
            both = {g1, g2}
            if not all(a in members[g] and b in members[g] for g in both):
                continue
            sa = [x for x in per_rank[a] if x[0] in both]
            sb = [x for x in per_rank[b] if x[0] in both]
            if sa != sb:
                i = next((i for i, (x, y) in enumerate(zip(sa, sb)) if x != y),
                         min(len(sa), len(sb)))
                bad.append(f"[order] ranks {a} and {b} issue the collectives of groups {g1} and "
                           f"{g2} in different orders from the {i}th: {sa[i:i + 3]} vs "
                           f"{sb[i:i + 3]}")
    return bad
