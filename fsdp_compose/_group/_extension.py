"""FSDP2's all-gather extension: a parameter's tensor subclass chooses what is gathered.
What is refused: ``check_params``. Decisions and measurements: docs/design.md,
"All-gather extension".

[Note: all-gather extension]
A parameter whose class defines ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather`` (torchao float8) is gathered with torch 2.13 FSDP2's
calls, on FSDP2's rows (``_layout.chunked``), alone in an ``ExtensionGroup``:
- sharded, the module holds an ``nn.Parameter`` DTensor ``Shard(0)`` over the
  unit's mesh, global shape, wrapping the subclass around a view of this
  rank's rows of the master shard: the object torchao's ``precompute_*``
  writes its scale to and the next pre-all-gather is called on. ``p.grad``:
  the same over the gradient shard;
- each tensor ``fsdp_pre_all_gather`` returns (1 or 5 arguments) is gathered
  as bytes into its own output, reused (storage freed at reshard); a unit's
  extension groups share ONE all-gather (``gather_together``). The first wait
  calls ``fsdp_post_all_gather``, later ones pass its result as ``out=``;
- backward: ``_Unsharded`` hands the gradient to the storage-less flat leaf as
  the flat gradient; from there on it is the plain groups' path (_grad_path.py).
"""
from __future__ import annotations

import inspect
import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._base import _compat

from .._plan import _layout
from .._base._common import ShardedState, unit_error
from ._flat_group import FlatGroup, FlatMode, _GATHER
from ._param_entry import ExtSpec, _data_name, inner_data
from .._comm._streams import Backend


def defines_extension(t: torch.Tensor) -> bool:
    """``t``'s class (or, for a DTensor, its local tensor's) defines FSDP2's
    all-gather extension."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            t = t.to_local()
    cls = type(t)
    return hasattr(cls, "fsdp_pre_all_gather") or hasattr(cls, "fsdp_post_all_gather")


def rebuild(template: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """An instance of ``template``'s subclass, with its metadata, around ``data``."""
    names, meta = template.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = {n: getattr(template, n) for n in names}
    inner[_data_name(template)] = data
    return type(template).__tensor_unflatten__(  # type: ignore[attr-defined]
        inner, meta, data.shape, data.stride())


def _arity(t: torch.Tensor) -> int:
    """Arguments of ``t.fsdp_pre_all_gather`` (bound: without self)."""
    return len(inspect.signature(t.fsdp_pre_all_gather).parameters)  # type: ignore[attr-defined]


def check_params(label: str, params: list, *, mesh, post_forward_size, granularity: str) -> None:
    """Refuse, naming the parameter, what the extension path cannot honour
    ([Note: all-gather extension]): one of the two methods only (ValueError);
    a ``fsdp_pre_all_gather`` taking neither 1 nor 5 arguments (TypeError); a
    class that is not a traceable wrapper subclass with one inner tensor of the
    parameter's shape and dtype, a 0-d parameter, a tensor-parallel DTensor
    wrapping it, a 2-D mesh (NotImplementedError); ``reshard_after_forward=N``,
    ``shard_granularity="tensor"``, the one-argument form over a dim 0 the
    shard world size does not divide (ValueError)."""
    for p, _slots, fqn in params:
        if not defines_extension(p):
            continue
        cls = type(p.to_local() if isinstance(p, DTensor) else p).__name__
        where = (f"parameter '{fqn}' is a {cls}, whose class defines FSDP2's all-gather "
                 "extension (fsdp_pre_all_gather / fsdp_post_all_gather)")

        def refuse(what: str, fix: str, exc=NotImplementedError):
            raise unit_error(label, f"{where}, but {what}", fix, exc=exc)

        if isinstance(p, DTensor):
            refuse("it is also a tensor-parallel DTensor, which fsdp_compose does not gather "
                   "through the extension.", "Turn the extension off for it (torchao: "
                   "Float8LinearConfig(enable_fsdp_float8_all_gather=False)), or shard this model "
                   "with torch.distributed.fsdp.fully_shard.")
        t = type(p)
        if not (hasattr(t, "fsdp_pre_all_gather") and hasattr(t, "fsdp_post_all_gather")):
            refuse("it defines only one of fsdp_pre_all_gather / fsdp_post_all_gather.",
                   "Define both (FSDP2 requires both too).", exc=ValueError)
        n = _arity(p)
        if n not in (1, 5):
            refuse(f"its fsdp_pre_all_gather takes {n} arguments.", "Define "
                   "fsdp_pre_all_gather(self, mesh) or fsdp_pre_all_gather(self, mesh, "
                   "outer_size, outer_stride, module, mp_policy), as FSDP2 calls it.",
                   exc=TypeError)
        if _data_name(p) is None:
            refuse("fsdp_compose cannot rebuild it around a rank's rows: it needs a traceable "
                   "wrapper subclass (__tensor_flatten__ / __tensor_unflatten__) with exactly one "
                   "inner tensor of the parameter's shape and dtype.",
                   "Give the class those methods, or turn its extension off.")
        if p.dim() == 0:
            refuse("it is 0-d (the extension path shards dim-0 rows).",
                   "Make it at least 1-d.")
        if mesh.ndim != 1:
            refuse("HSDP (a 2-D mesh) is not supported with the extension yet.",
                   "Pass a 1-D mesh for the units holding such parameters.")
        if post_forward_size:
            refuse(f"reshard_after_forward={post_forward_size} (an int) cannot re-gather it "
                   "within a smaller group (FSDP2 raises there too).",
                   "Use reshard_after_forward=True or False for this unit.", exc=ValueError)
        if granularity != "row":
            refuse(f"shard_granularity={granularity!r} is not supported with the extension "
                   "(it is gathered in FSDP2's rows).", "Use the default \"row\" for this unit.",
                   exc=ValueError)
        world = mesh.size(0)
        if n == 1 and p.shape[0] % world:
            refuse(f"its fsdp_pre_all_gather(self, mesh) cannot pad: dim 0 ({p.shape[0]}) is "
                   f"not a multiple of the shard world size {world}, so the ranks would gather "
                   "pieces of different sizes (FSDP2 alike).",
                   f"Make dim 0 a multiple of {world}, or define the five-argument "
                   "fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy) "
                   "returning inputs padded to FSDP2's padded shard size.", exc=ValueError)


def torch_mp_policy(mp) -> object:
    """Our policy as torch's ``MixedPrecisionPolicy`` (what the five-argument
    ``fsdp_pre_all_gather`` is given by FSDP2)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if mp is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                                output_dtype=mp.output_dtype,
                                cast_forward_inputs=mp.cast_forward_inputs)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D tensor seen as bytes (the transport: gloo moves no float8)."""
    return t.view(torch.uint8)


class _Unsharded(torch.autograd.Function):
    """The unsharded parameter the module computes with, as a function of the
    group's (storage-less) flat leaf: the gradient flows into the flat gradient."""

    @staticmethod
    def forward(node, flat, group):  # (node: autograd's ctx; not a root context)
        node.group = group
        return group._full.detach()

    @staticmethod
    def backward(node, grad):
        return node.group._flat_grad(grad), None


class ExtensionGroup(FlatGroup):
    """One parameter whose class defines the all-gather extension, see the Note.
    A cast or move after ``fully_shard`` raises NotImplementedError; a gather
    raises where the pre-all-gather's inputs are not padded to the padded
    shard (five arguments, uneven rows) or change shape or dtype."""

    def __init__(self, unit_fqn: str, params: list, *, mp_policy=None, **kw):
        (p, slots, _fqn), = params
        self._template = p            # the original subclass instance (metadata for rebuild)
        self._module = slots[0][0]    # what FSDP2 passes as ``module``
        self._torch_mp = torch_mp_policy(mp_policy)
        self._arity = _arity(p)
        self._outputs: list[torch.Tensor] | None = None   # all-gather outputs (1-D), reused
        self._in_sizes: list[torch.Size] | None = None    # the inputs' sizes, first gather
        self._in_dtypes: list[torch.dtype] | None = None
        self._storage: list[tuple[torch.Tensor, int]] = []  # (tensor, bytes) freed at reshard
        self._full: torch.Tensor | None = None            # the unsharded parameter, reused
        self._metadata = None
        self._pend: list = []
        super().__init__(unit_fqn, params, **kw)
        self._template = None  # (its inner tensor is the original, full-size parameter)

    # ---------------------------------------------------------------- building
    @staticmethod
    def _local_of(p: torch.Tensor) -> torch.Tensor:
        return inner_data(p)

    @staticmethod
    def _plan_layout(slots, world, align, granularity, before) -> _layout.Layout:
        return _layout.chunked(slots[0], world)

    def _decide_mode(self) -> FlatMode:
        return FlatMode.GATHERED  # (at world size 1 too: the subclass's calls run as in FSDP2)

    def _allocate(self, device: torch.device, params: list | None = None) -> None:
        if params is not None:  # a cast or move after fully_shard
            raise unit_error(self.unit_fqn, f"parameter '{self.entries[0].fqn}' uses FSDP2's "
                             "all-gather extension; casting or moving it after fully_shard is "
                             "not supported.", "Cast or move the model before fully_shard.",
                             exc=NotImplementedError)
        self._new_shard(device)
        e = self.entries[0]
        e.ext = ExtSpec(self.mesh, e.shape, _layout.contiguous_stride(e.shape))
        e.row = None  # (shown as FSDP2 shows it: torch.chunk's Shard(0))
        with torch.no_grad():
            local = rebuild(self._template, e.piece(self.shard))
            e.sharded = nn.Parameter(e.ext.wrap(local), requires_grad=self._trains[0])
        # the flat leaf: autograd's, for the flat gradient; never given storage
        self.flat = torch.empty(self.padded_numel, dtype=self.compute_dtype, device=device)
        if device.type != "meta":
            self.flat.untyped_storage().resize_(0)
        self.flat.requires_grad_(self.requires_grad)
        self.flat_data = self.flat.data
        self._hook_flat()
        e.unsharded = None  # type: ignore[assignment]
        self.split_node = None

    def _copy_attrs(self, e, p: torch.Tensor) -> None:
        # user attributes only: not the subclass's own (its inner tensors, config)
        with torch.no_grad():
            own = set(e.sharded.__dict__) | set(_compat.dtensor_local(e.sharded).__dict__)
        e.sharded.__dict__.update({k: v for k, v in p.__dict__.items() if k not in own})

    def materialize_(self, device: torch.device) -> None:
        e = self.entries[0]
        if self.device.type != "meta":
            raise unit_error(self.unit_fqn, "materialize_: the group is not on the meta device.")
        old = e.sharded
        with torch.no_grad():
            self._template = _compat.dtensor_local(old)
            self._allocate(device)
            self._template = None
        self._copy_attrs(e, old)
        self.install_sharded()

    # ---------------------------------------------------------- flat (never allocated)
    def _alloc_flat(self) -> None:
        pass

    def _ensure_flat(self) -> None:
        pass

    def _free_flat(self) -> None:
        pass

    def gather_key(self) -> None:
        return None  # (not in a plain bucket: its own buffers, see the Note)

    def gathers_together(self, streams) -> bool:
        """Sharded over several ranks: gathered with the unit's other
        extension groups in one all-gather (``gather_together``)."""
        return (self.state is ShardedState.SHARDED and self.world > 1
                and self.device.type != "meta")

    def shares_reduce(self) -> bool:
        """A unit's extension groups (one per float8 weight) share one
        reduce-scatter per key on every backend but gloo: never one per weight."""
        return self.world > 1 and self._pads

    # ------------------------------------------------------------------ gather
    def unshard(self, streams: Backend) -> None:
        if self.state is ShardedState.UNSHARDED or self.state is ShardedState.UNSHARDING:
            return
        pairs = self._start_gather()
        if self.world == 1:
            for src, dst in pairs:
                dst.copy_(src)
        elif len(pairs) > 1:
            gather_together([self], streams, [pairs])
            return
        else:
            self._pend = [streams.all_gather(dst, src, self.pg, (self.unit_fqn, _GATHER))
                          for src, dst in pairs]
        self.state = ShardedState.UNSHARDING

    def _start_gather(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``fsdp_pre_all_gather`` on this rank's piece: [(what this rank sends,
        the output it is gathered into)], each as bytes."""
        e = self.entries[0]
        if self.device.type == "meta":
            from .._base._common import META_FIX
            raise unit_error(self.unit_fqn, f"parameters ['{e.fqn}'] are on the meta device.",
                             META_FIX)
        self.unsharded_version = self.shard._version
        inputs = self._pre_all_gather(e)
        outputs = self._alloc_outputs()
        self._pend = []
        return [(_as_bytes(inp.reshape(-1).contiguous()), _as_bytes(out))
                for inp, out in zip(inputs, outputs)]

    def _pre_all_gather(self, e) -> list[torch.Tensor]:
        with torch.no_grad():
            local = _compat.dtensor_local(e.sharded)  # (the object precompute_* writes to)
            if self.offload:
                local = local.to(self.device, non_blocking=True)
            if self._arity == 1:
                inputs, self._metadata = local.fsdp_pre_all_gather(self.mesh)  # type: ignore[attr-defined]
            else:
                inputs, self._metadata = local.fsdp_pre_all_gather(  # type: ignore[attr-defined]
                    self.mesh, e.shape, _layout.contiguous_stride(e.shape), self._module,
                    self._torch_mp)
        inputs = list(inputs)
        padded = torch.Size((self.layout.chunk // max(1, math.prod(e.shape[1:])),)
                            + tuple(e.shape[1:]))
        if (self._arity == 5 and local.shape != padded
                and any(t.shape != padded for t in inputs)):
            raise unit_error(self.unit_fqn, f"parameter '{e.fqn}' is sharded unevenly (global "
                             f"shape {tuple(e.shape)} over {self.world} ranks), and its "
                             "fsdp_pre_all_gather returned inputs of shapes "
                             f"{[tuple(t.shape) for t in inputs]} instead of the padded shard "
                             f"shape {tuple(padded)}.", "Pad the inputs to outer_size's padded "
                             "shard, as FSDP2 requires.")
        sizes, dtypes = [t.shape for t in inputs], [t.dtype for t in inputs]
        if self._in_sizes is None:
            self._in_sizes, self._in_dtypes = sizes, dtypes
        elif sizes != self._in_sizes or dtypes != self._in_dtypes:
            raise unit_error(self.unit_fqn, f"parameter '{e.fqn}': fsdp_pre_all_gather returned "
                             f"{list(zip(sizes, dtypes))}, but "
                             f"{list(zip(self._in_sizes, self._in_dtypes))} "  # type: ignore[arg-type]
                             "at the first gather; the all-gather buffers are reused, so they "
                             "must not change.")
        return inputs

    def _alloc_outputs(self) -> list[torch.Tensor]:
        if self._outputs is None:
            self._outputs = [torch.empty(s.numel() * self.world, dtype=d, device=self.device)
                             for s, d in zip(self._in_sizes, self._in_dtypes)]  # type: ignore[arg-type]
            self._storage = [(t, t.untyped_storage().nbytes()) for t in self._outputs]
        else:
            for t, nbytes in self._storage:
                if t.untyped_storage().nbytes() == 0:
                    t.untyped_storage().resize_(nbytes)
        return self._outputs

    def _complete_gather(self) -> None:
        if self.state is not ShardedState.UNSHARDING:
            return
        for p in self._pend:
            p.wait()
        self._pend = []
        self._post_all_gather()
        self.state = ShardedState.UNSHARDED

    def _post_all_gather(self) -> None:
        e = self.entries[0]
        outs = tuple(o.view(-1, *s[1:])
                     for o, s in zip(self._outputs, self._in_sizes))  # type: ignore[arg-type]
        with torch.no_grad():
            local = _compat.dtensor_local(e.sharded)
            if self._full is None:
                result = local.fsdp_post_all_gather(  # type: ignore[attr-defined]
                    outs, self._metadata, self.compute_dtype)
                unsharded, inner = result
                if unsharded.shape != e.shape or not unsharded.is_contiguous():
                    # padded outputs: the parameter's rows, as FSDP2 cuts them
                    unsharded = torch.as_strided(unsharded, e.shape,
                                                 _layout.contiguous_stride(e.shape), 0)
                self._full = unsharded
                known = {id(t) for t, _ in self._storage}
                self._storage += [(t, t.untyped_storage().nbytes()) for t in inner
                                  if id(t) not in known]
            else:
                local.fsdp_post_all_gather(outs, self._metadata,  # type: ignore[attr-defined]
                                           self.compute_dtype,
                                           out=self._full)
        self._metadata = None
        e.unsharded = self._full  # (a grad-enabled forward's views replace it: refresh_views)
        self._views_installed = False

    def refresh_views(self) -> None:
        if self.state is ShardedState.UNSHARDING:
            self._complete_gather()
        if self.state is not ShardedState.UNSHARDED:
            return
        e = self.entries[0]
        if self._trains[0] and torch.is_grad_enabled():
            e.unsharded = _Unsharded.apply(self.flat, self)
            self.split_node = e.unsharded.grad_fn
            self.split_node.register_prehook(self._split_prehook)  # type: ignore[union-attr]
        else:
            e.unsharded = self._full  # type: ignore[assignment]
            self.split_node = None
        self._views_installed = False
        self._views_stale = False

    def _flat_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The parameter's gradient as the flat gradient (see the Note)."""
        g = grad.reshape(-1)
        if g.dtype != self.compute_dtype:
            g = g.to(self.compute_dtype)
        if g.numel() != self.padded_numel:
            g = torch.cat([g, g.new_zeros(self.padded_numel - g.numel())])
        return g

    def reshard(self, to_post_forward: bool = False) -> None:
        if self.state is ShardedState.SHARDED:
            return
        self._complete_gather()  # never free memory a collective writes
        self.install_sharded()
        for t, _ in self._storage:
            t.untyped_storage().resize_(0)
        self.state = ShardedState.SHARDED

    def __repr__(self) -> str:
        return "Extension" + super().__repr__()


def gather_together(groups: list[ExtensionGroup], streams: Backend,
                    pairs: list | None = None) -> None:
    """ONE all-gather for every tensor that the ``fsdp_pre_all_gather`` of
    ``groups`` (sharded, on one process group, world > 1) returns, as FSDP2
    gathers a unit's parameters: this rank's bytes of each end to end (a copy
    in), and at each group's wait its outputs' rows copied out of the shared
    buffer (a copy out). ``pairs``: what ``_start_gather`` already returned."""
    if pairs is None:
        pairs = [g._start_gather() for g in groups]
    sends = [src for group_pairs in pairs for src, _ in group_pairs]
    W, n = groups[0].world, sum(t.numel() for t in sends)
    send = torch.cat(sends)
    recv = torch.empty(W * n, dtype=torch.uint8, device=groups[0].device)
    many = f" (with {len(groups) - 1} more parameters)" if len(groups) > 1 else ""
    pending = streams.all_gather(recv, send, groups[0].pg,
                                 (groups[0].unit_fqn, _GATHER + many))
    work = _TogetherWork(pending, recv.view(W, n), groups, pairs)
    for g in groups:
        g._pend = [work.part(g)]
        g.state = ShardedState.UNSHARDING


class _TogetherWork:
    """The all-gather ``gather_together`` issued: waited once; each group's
    outputs are copied out when that group waits, the buffer released after
    the last."""

    def __init__(self, pending, recv: torch.Tensor, groups: list, pairs: list):
        self._pending, self._recv = pending, recv
        self._at: dict[int, list] = {}
        at = 0
        for g, group_pairs in zip(groups, pairs):
            spans = []
            for src, dst in group_pairs:
                spans.append((dst, at, src.numel()))
                at += src.numel()
            self._at[id(g)] = spans

    def part(self, g: ExtensionGroup) -> "_Part":
        return _Part(self, g)

    def _copy_out(self, g: ExtensionGroup) -> None:
        self._pending.wait()  # (idempotent; on CUDA it orders the current stream)
        spans = self._at.pop(id(g), None)
        if spans is None:
            return
        W = self._recv.shape[0]
        for dst, at, width in spans:
            dst.view(W, width).copy_(self._recv[:, at:at + width])
        if not self._at:
            self._recv = None  # type: ignore[assignment]


class _Part:
    """``g``'s share of a ``_TogetherWork``: ``wait()`` copies its outputs out."""

    def __init__(self, work: _TogetherWork, g: ExtensionGroup):
        self._work, self._g = work, g

    def wait(self) -> None:
        self._work._copy_out(self._g)
