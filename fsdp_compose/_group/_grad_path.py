"""The gradient path of a flat group: from the flat gradient autograd
accumulated to ``p.grad`` of the sharded Parameters.

    take_grad        flat.grad (or zeros) in the reduce dtype, unsynced
                     microbatches added, pre-divided: a ``TakenGrad``
    launch_*         the reduce-scatter (its input: the flat gradient, with
                     the used-flags inline or in their own all-reduce)
    _finish_reduce   the post-reduce: HSDP all-reduce, post-divide, cast or
                     device-to-host copy, then ``_fold_grad`` into p.grad

``GradientPath`` is ``group.grad`` of a ``FlatGroup`` (_flat_group.py holds
the storage: shard, flat, views, gather and free). It owns the used-flags,
the unsynced sum and HSDP's partial sum; it reads the group's layout, storage
and spec through a weak reference and writes the group only through
``flat.grad`` and the entries' ``p.grad``. Decisions and measurements:
docs/design.md, "Gradients", "Gradients as DDP's".

[Note: parameters without a gradient] ``p.grad`` stays None exactly where
DDP (``find_unused_parameters=True``) leaves it, for an entry no rank produced
a gradient for, alike on every rank. The flat gradient cannot tell that from
a zero gradient, so:
- each group flags, per entry, whether this rank produced one: the split
  node's pre-hook sees None for a view that got none, OR-ed over the unit's
  uses and the unsynced microbatches (``_before_split_backward``);
- the flags travel with the reduction: in a bucket, and for a flat gradient
  up to ``INLINE_FLAGS_BYTES``, as E more columns after each rank's chunk of
  the reduce-scatter input, so the output is the gradient shard then the
  flags' rank average (``_launch_inline``); else a SUM all-reduce of E fp32 on
  the same process group. HSDP adds and all-reduces them with the gradient;
- the fold: an entry no rank produced a gradient for gets none, a frozen
  entry (``requires_grad_(False)``) is never touched, every other one gets
  the rank average; a rank that produced every gradient reads no counts.

[Note: empty pieces] Where this rank holds none of a parameter other ranks
hold (``ParamEntry.held_elsewhere``: 0 rows, or a tensor-layout parameter
owned elsewhere), the fold treats it like any entry: ``p.grad`` is an empty
gradient of the piece's shape ``(0, *shape[1:])`` where some rank produced
one, None where none did, so ``p.grad is None`` is alike on every rank, as
with DDP. It has the gradient shard's dtype and device but is not a view of
it (that would keep the whole shard alive on a rank holding nothing of the
group). An element-wise optimizer steps it as DDP steps the whole (state
created, ``step`` counted, nothing moves); one that needs whole tensors does
not see it: [Note: optimizers on sharded parameters] in _torch_hooks.py.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from .._base import _compat
from .._comm import _collectives

from .._plan import _layout
from .._base._common import ReduceSettings, label
from .._comm._streams import Backend, Pending
from ._param_entry import adopt_grads

# A flat gradient up to this size carries its used-flags in its own
# reduce-scatter (one copy, into a buffer with E more columns); a larger one
# sends them in a tiny all-reduce of their own, where that copy would cost
# more than the collective's latency (see [Note: parameters without a gradient]).
INLINE_FLAGS_BYTES = 256 << 10
_inline_flags_bytes = INLINE_FLAGS_BYTES  # process-wide: a test seam, for a with block


@contextlib.contextmanager
def inline_flags_limit(nbytes: int) -> Iterator[None]:
    """Inside, the size up to which a flat gradient carries its used-flags in
    its reduce-scatter is ``nbytes`` (0: every one sends them in an all-reduce
    of its own): the seam for tests of that path on small models."""
    global _inline_flags_bytes
    prev, _inline_flags_bytes = _inline_flags_bytes, nbytes
    try:
        yield
    finally:
        _inline_flags_bytes = prev

# which collective a unit waits for, in a DivergenceError (see _divergence.py)
_REDUCE = "the reduce-scatter of its gradients"
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _divide_factors(total: int, reduce_dtype: torch.dtype, factor: float | None = None,
                    force_sum: bool = False) -> tuple[float | None, float | None]:
    """(pre, post) divisors for a SUM reduction over ``total`` ranks, or (None, None) for AVG.

    In fp16/bf16, summing W gradients then dividing can overflow (fp16) or lose
    the small ones; dividing by f before and W/f after (f a power of two near
    sqrt(W): exact scaling) keeps the partial sums in range.
    ``factor`` (``set_gradient_divide_factor``): the sum is divided by it
    instead of by ``total`` (1.0: a plain sum); ``force_sum``
    (``set_force_sum_reduction_for_comms``): a SUM, then the division.
    """
    if factor is not None:
        return 1.0, float(factor)
    if force_sum and total > 1 and reduce_dtype not in _LOW_PRECISION:
        return 1.0, float(total)
    if reduce_dtype not in _LOW_PRECISION or total == 1:
        return None, None
    f = 1
    while total % (2 * f) == 0 and (2 * f) * (2 * f) <= total:
        f *= 2
    return float(f), total / f


@dataclass(frozen=True)
class TakenGrad:
    """A flat gradient taken for one reduction (``GradientPath.take_grad``)."""

    flat_grad: torch.Tensor   # padded_numel, in the reduce dtype, pre-divided
    used: list[bool]          # per entry: this rank produced a gradient (then reset)
    pre: float | None         # divided by before a SUM; None: the reduction is an AVG
    post: float | None        # to divide by after the SUM (see _divide_factors)

    @property
    def op(self) -> dist.ReduceOp.RedOpType:
        return dist.ReduceOp.AVG if self.pre is None else dist.ReduceOp.SUM


@dataclass
class _GradLaunch:
    """A reduce-scatter in flight, and how to fold its output into p.grad."""

    path: "GradientPath"
    streams: Backend
    pending: Pending | None  # wait() gives the reduced output
    used: "_UsedFlags"   # per entry: did this rank, and how many ranks, produce a gradient
    post_divide: float | None = None
    span: tuple[int, int] | None = None  # this group's part of a bucket's output
    bucket: torch.Tensor | None = None   # the input, from streams.bucket (released once waited)
    # folds every launch of the shared reduce-scatter (_fold_all)
    fold_bucket: Callable[[torch.Tensor], None] | None = None
    done: bool = field(default=False)
    folded: bool = field(default=False)

    def fold(self, out: torch.Tensor, reduced: bool = False) -> None:
        self.folded = True
        if self.span is not None:
            out = out[self.span[0]:self.span[1]]
        self.path._finish_reduce(out, self.used, self.post_divide, self.streams, reduced)

    def finish(self) -> None:
        if not self.done:
            out = self.pending.wait()  # type: ignore[union-attr]
            self.pending = None  # (it holds the flat gradient: it goes now)
            if self.bucket is not None:
                self.streams.release(self.bucket)
                self.bucket = None
            self.done = True
            if not self.folded:
                (self.fold_bucket or self.fold)(out)
            self.used.release()


def _fold_all(launches: list[_GradLaunch]):
    """The post-reduce of a reduce-scatter shared by ``launches``: on CUDA the
    stream manager runs it at once on a side stream (see [Note: post-reduce]
    in _streams.py); on gloo the first launch to ``finish`` runs it.

    With HSDP the bucket's output goes across the replicas in ONE all-reduce
    (its gradient shards and their inline flags, end to end), not one per
    group; a group that keeps a partial sum (``requires_all_reduce`` False)
    is left out, the others then go one by one."""
    def fold(out: torch.Tensor) -> None:
        for launch in launches:  # run once: no launch -> fold -> launches cycle outlives it
            launch.fold_bucket = None  # (a cycle would keep every flat gradient to the next gc)
        first = launches[0]
        if len(launches) == 1 or first.path.group.replicate_pg is None:
            for launch in launches:
                launch.fold(out)
            return
        for launch in launches:
            launch.used.wait()
        sums = [launch.path._hsdp_sum(out[launch.span[0]:launch.span[1]],  # type: ignore[index]
                                       launch.used, launch.streams) for launch in launches]
        if all(sums):
            first.path._hsdp_all_reduce(out[:launches[-1].span[1]], first.used,  # type: ignore[index]
                                         first.post_divide, first.streams)
        for launch, summed in zip(launches, sums):
            if summed and not all(sums):
                lo, hi = launch.span  # type: ignore[misc]
                launch.path._hsdp_all_reduce(out[lo:hi], launch.used, launch.post_divide,
                                              launch.streams)
            if summed:
                launch.fold(out, reduced=True)
            launch.folded = True
    for launch in launches:
        launch.fold_bucket = fold
    return fold


class _UsedFlags:
    """Per entry of one group: whether this rank produced a gradient
    (``local``), and what the reduction made of the flags: the E elements
    after the gradient shard in the reduce-scatter output (``inline``), or
    ``counts``, all-reduced by ``pending`` (None at world size 1)."""

    def __init__(self, local: list[bool], inline: bool = False, pending: Pending | None = None,
                 counts: torch.Tensor | None = None):
        self.local, self.inline, self._pending, self.counts = local, inline, pending, counts

    def wait(self) -> None:
        """Order the caller (the post-reduce: on CUDA a side stream) after the
        flags' all-reduce."""
        if self._pending is not None:
            self._pending.wait()

    def release(self) -> None:
        """The compute stream waits too, then the flags' buffer may go (see
        [Note: side streams] in _streams.py: every collective is waited by the
        stream that allocated its tensors)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def all_here(self, trains) -> bool:
        """Every entry that ``trains`` got its gradient on this rank: nothing to read."""
        return all(u or not t for u, t in zip(self.local, trains))

    def any_rank(self, trains) -> list[bool] | None:
        """Per entry: did any rank produce a gradient (> 0: a sum or an
        average); None: every entry that ``trains`` did here, nothing to read.
        Reads ``counts`` on the host: on CUDA only at the end of backward
        (``StreamManager.after_backward``), or from host memory (offload)."""
        if self.all_here(trains):
            return None
        if self.counts is None:
            return self.local
        return [c > 0 for c in self.counts.tolist()]


def _flags_tensor(flags: list[bool], streams: Backend,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # on CUDA no sync: from pinned memory, on the current stream
    return streams.to_device(torch.tensor(flags, dtype=dtype))


class GradientPath:
    """A flat group's gradient path, ``group.grad`` (see the module
    docstring); its reference to the group is weak: no cycle keeps a model's
    groups alive."""

    def __init__(self, group) -> None:
        self.group = weakref.proxy(group)
        self.settings = ReduceSettings()  # the unit's (Unit.update_settings)
        self._used = [False] * len(group.entries)  # see [Note: parameters without a gradient]
        self._flags_row: tuple | None = None  # (flags, their tensor): read-only, reused
        self._unsynced: torch.Tensor | None = None   # accumulated flat grad in reduce dtype
        self._partial: tuple | None = None  # HSDP: (reduce-scattered, flags), not all-reduced

    def _move_grad_state(self, flat_grad: torch.Tensor | None) -> None:
        """After ``adopt_params`` re-made the storage: what a backward left
        (``flat_grad``: the old flat's gradient) follows the new device and
        dtypes, as ``_apply`` casts ``p.grad``."""
        g = self.group
        if flat_grad is not None and g.flat.requires_grad:
            g.flat.grad = flat_grad.to(g.device, g.compute_dtype)
        if self._unsynced is not None:
            self._unsynced = self._unsynced.to(g.device, g.reduce_dtype)
        if self._partial is not None:  # (HSDP: the sum and its used-flags)
            p_out, p_used = self._partial
            if p_used.counts is not None:
                p_used.counts = p_used.counts.to(g.device)
            self._partial = (p_out.to(g.device, g.reduce_dtype), p_used)

    def _before_split_backward(self, grad_outputs) -> None:
        """The split node's pre-hook: note which views got a gradient (None:
        none, see [Note: parameters without a gradient]). (On gloo the root's
        own pre-hook on the node runs next: [Note: gloo backward] in _state.py.)"""
        used = self._used
        for k, i in enumerate(self.group._view_at):
            if grad_outputs[i] is not None:
                used[k] = True

    def _adopt_grad_shard(self, buf: torch.Tensor, take: list[bool]) -> None:
        """``buf`` becomes the gradient shard of the entries in ``take`` (an
        empty piece held elsewhere gets an empty gradient, see [Note: empty pieces])."""
        entries = [e for e, t in zip(self.group.entries, take) if t]
        adopt_grads(entries, [_empty_grad(e, buf) if e.held_elsewhere() else e.piece(buf)
                              for e in entries])

    def stash_unsynced_grad(self) -> None:
        """No gradient sync this backward: keep the flat gradient for the next.

        In the compute dtype autograd accumulates into ``flat.grad`` in place;
        when the reduce dtype is wider (bf16 compute, fp32 reduce) the sum is
        kept in the reduce dtype instead, as torch FSDP2 does.
        """
        g = self.group.flat.grad
        if g is None or g.dtype == self.group.reduce_dtype:
            return
        self.group.flat.grad = None
        if self._unsynced is None:
            self._unsynced = g.to(self.group.reduce_dtype)
        else:
            self._unsynced.add_(g)

    def drop_grad(self) -> None:
        """Forget the flat gradient and flags of a backward that raised midway."""
        self.group.flat.grad = None
        self._unsynced = None
        self._used = [False] * len(self.group.entries)

    def launch_reduce_scatter(self, streams: Backend) -> _GradLaunch:
        """Reduce-scatter ``flat.grad`` (zeros if this rank produced none)."""
        g = self.group
        inline = (g.padded_numel * g.reduce_dtype.itemsize <= _inline_flags_bytes
                  and (g.gather_bounds is None or g.padded()))  # (gloo's uneven: on their own)
        if g.world > 1 and inline:
            return _launch_inline([self], streams)[0]
        taken = self.take_grad()
        used, post = taken.used, taken.post
        if g.world == 1:  # the flat gradient is the gradient shard
            if g.replicas > 1 and inline:  # HSDP: the flags ride in the all-reduce
                out = torch.cat([taken.flat_grad, self.flags_row(used, streams)])
                return _GradLaunch(self, streams, streams.ready(out),
                                   _UsedFlags(used, inline=True), post)
            return _GradLaunch(self, streams, streams.ready(taken.flat_grad), _UsedFlags(used),
                               post)
        counts = _flags_tensor(used, streams)  # see [Note: parameters without a gradient]
        # The flags' all-reduce is issued first: on CUDA the post-reduce (the
        # fold, which reads them) runs as soon as the reduce-scatter is issued.
        with label("used_flags", g.unit_fqn):  # (tools.timeline tells it from the reduction)
            flags = streams.all_reduce(counts, g.rs_pg, dist.ReduceOp.SUM,
                                       (g.unit_fqn, "the all-reduce of its used-flags"))
        launch = _GradLaunch(self, streams, None, _UsedFlags(used, pending=flags, counts=counts),
                             post)
        launch.pending = streams.reduce_scatter(taken.flat_grad, g.rs_pg, taken.op,
                                                _fold_all([launch]), g.replicate_pg is not None,
                                                (g.unit_fqn, _REDUCE), bounds=g.gather_bounds,
                                                padded=g.padded())
        return launch

    def bucket_key(self) -> tuple:
        """Groups with equal keys can share one reduce-scatter (see launch_bucket)."""
        g = self.group
        return (g.reduce_dtype, g.rs_pg, g.world, g.device, g.replicas,
                self.settings.divide_factor, self.settings.force_sum,
                id(self) if g.gather_bounds is not None and not g.padded()
                else None)  # (gloo's uneven pieces: never merged)

    def flags_row(self, used: list[bool], streams: Backend) -> torch.Tensor:
        """``used`` as a tensor in the reduce dtype on the device, to be copied
        (the same flags step after step: made once), then zeros up to the
        next multiple of 16 bytes after the gradient shard: every group's part
        of a bucket, and every rank's chunk, starts 16-byte aligned (NCCL's
        fast path; the gradient shards the optimizer reads)."""
        g = self.group
        key = (tuple(used), g.device, g.reduce_dtype)  # (a model moved or cast)
        if self._flags_row is None or self._flags_row[0] != key:
            align = _layout.align_elems(g.reduce_dtype.itemsize)
            pad = -(g.slot + len(used)) % align
            self._flags_row = (key, _flags_tensor(list(used) + [False] * pad, streams,
                                                  g.reduce_dtype))
        return self._flags_row[1]

    def _inline_counts(self, out: torch.Tensor) -> torch.Tensor:
        """The flags' rank average after the gradient shard in ``out`` (not the
        padding), at ``slot`` (an uneven group's piece is padded to it)."""
        g = self.group
        return out[g.slot:g.slot + len(g.entries)]

    def take_grad(self) -> TakenGrad:
        """The flat gradient, ready to reduce: in ``reduce_dtype``, unsynced
        microbatches added, pre-divided; with this rank's used-flags (reset)."""
        g = self.group
        flat_grad = g.flat.grad
        g.flat.grad = None
        if flat_grad is None:
            flat_grad = torch.zeros(g.padded_numel, dtype=g.reduce_dtype, device=g.device)
        elif flat_grad.dtype != g.reduce_dtype:
            flat_grad = flat_grad.to(g.reduce_dtype)
        if self._unsynced is not None:
            flat_grad = flat_grad.add_(self._unsynced)
            self._unsynced = None
        used, self._used = self._used, [False] * len(g.entries)
        pre, post = _divide_factors(g.world * g.replicas, g.reduce_dtype,
                                    self.settings.divide_factor, self.settings.force_sum)
        if pre is not None and pre != 1.0:
            flat_grad.div_(pre)
        return TakenGrad(flat_grad, used, pre, post)

    def _split_flags(self, out: torch.Tensor, used: _UsedFlags, streams: Backend):
        """(gradient shard, flag sums): views into ``out`` when the flags came
        inline, else ``used.counts``."""
        if used.inline:
            return out[:self.group.shard_numel], self._inline_counts(out)
        if used.counts is None:  # (shard world size 1: the flags are local)
            used.counts = _flags_tensor(used.local, streams)
        return out, used.counts

    def _finish_reduce(self, out: torch.Tensor, used: _UsedFlags, post: float | None,
                       streams: Backend, reduced: bool = False) -> None:
        """On CUDA this runs on a side stream (see [Note: post-reduce] in _streams.py).
        ``reduced``: the HSDP sum and all-reduce were done for a whole bucket
        (``_fold_all``)."""
        g = self.group
        used.wait()
        if used.counts is not None:  # (HSDP writes them there: kept to the end of backward)
            streams.hold(used.counts)
        if g.replicate_pg is not None and not reduced:  # HSDP: then across the replicas
            if not self._hsdp_sum(out, used, streams):
                return  # p.grad is left alone until an all-reduced backward
            self._hsdp_all_reduce(out, used, post, streams)
        if used.inline:
            out, used.counts = out[:g.shard_numel], self._inline_counts(out)
        if post is not None and post != 1.0:
            out.div_(post)
        if g.offload:  # device-to-host, folded once the copy has landed
            host = streams.to_host(out, g.dtype, g.pin_memory)
            if used.counts is not None:  # (read by the fold, after the copy)
                used.counts = streams.to_host(used.counts, used.counts.dtype, g.pin_memory)
            # p.grad is read then: an earlier fold of this group may be waiting too
            streams.on_host(lambda: self._fold_grad(host, used.any_rank(g._trains)))
            return
        if out.dtype != g.dtype:
            out = out.to(g.dtype)
        if used.counts is not None and not used.all_here(g._trains):
            # which entries no rank produced: read once, at the end of backward
            # (on CUDA a read here would block the backward thread)
            streams.after_backward(used.counts, lambda counts: self._fold_grad(
                out, [c > 0 for c in counts]))
            return
        self._fold_grad(out, used.any_rank(g._trains))

    def _hsdp_sum(self, out: torch.Tensor, used: _UsedFlags, streams: Backend) -> bool:
        """HSDP: add a partial sum an earlier backward kept; False: keep this
        one as the partial sum instead (``requires_all_reduce`` False)."""
        grad, counts = self._split_flags(out, used, streams)
        if self._partial is not None:  # (its gradient and flags are added alike)
            p_out, p_used = self._partial
            p_grad, p_counts = self._split_flags(p_out, p_used, streams)
            grad.add_(p_grad)
            counts.add_(p_counts.to(counts.dtype))
            used.local = [a or b for a, b in zip(used.local, p_used.local)]
            streams.hold(p_out)
            streams.hold(p_counts)
            self._partial = None
        if not self.settings.requires_all_reduce:
            self._partial = (out, used)
            return False
        return True

    def _hsdp_all_reduce(self, out: torch.Tensor, used: _UsedFlags, post: float | None,
                         streams: Backend) -> None:
        """``out`` (inline: with its flags) across the replicas, and the
        counts when they came in their own all-reduce."""
        g = self.group
        op = dist.ReduceOp.AVG if post is None else dist.ReduceOp.SUM
        what = (g.unit_fqn, "the all-reduce of its gradient shards across replicas")
        streams.replica_all_reduce(out, op, g.replicate_pg, what)  # (inline: flags too)
        if not used.inline:
            streams.replica_all_reduce(used.counts,  # type: ignore[arg-type]
                                       dist.ReduceOp.SUM, g.replicate_pg, what)

    def _fold_grad(self, out: torch.Tensor, any_rank: list[bool] | None) -> None:
        """Add this reduction into p.grad, see [Note: parameters without a gradient].
        ``any_rank[k]``: some rank produced entry k's gradient (None: all did)."""
        with torch.no_grad():
            entries = self.group.entries
            with _compat.no_subclass_dispatch():  # (torch's getter: not RowParam.grad's)
                none = all(_compat.TENSOR_GRAD.__get__(e.sharded) is None for e in entries)
            if none:  # the common case: adopt it
                take = [t and (any_rank is None or any_rank[k])
                        for k, t in enumerate(self.group._trains)]
                self._adopt_grad_shard(out, take)
                return
            # accumulation without zero_grad, a partial zero_grad (an optimizer
            # over part of the unit), p.grad set by the user: one by one
            for k, e in enumerate(entries):
                if not self.group._trains[k]:
                    continue  # frozen: backward leaves p.grad alone
                g = e.grad_rows()
                piece = e.piece(out)
                if g is not None:
                    g.add_(piece.view_as(g))
                elif any_rank is None or any_rank[k]:
                    e.set_grad(_empty_grad(e, out) if e.held_elsewhere()
                               else piece.clone())  # (a view would keep all of out alive)


def _empty_grad(e, buf: torch.Tensor) -> torch.Tensor:
    """The gradient of an empty piece held elsewhere: a tensor of its own, not
    a view of ``buf`` (which would keep the gradient shard alive on a rank
    that holds nothing of it, see [Note: empty pieces])."""
    return buf.new_empty(e.piece_shape)


def launch_bucket(paths: list[GradientPath], streams: Backend) -> list[_GradLaunch]:
    """ONE reduce-scatter for several groups with the same ``bucket_key()``.

    For many small units, where a collective's latency dominates its bytes:
    one collective instead of one per unit, for one copy (``_launch_inline``).
    """
    first = paths[0]
    if first.group.world == 1 or len(paths) == 1:  # nothing to merge
        return [p.launch_reduce_scatter(streams) for p in paths]
    return _launch_inline(paths, streams)


def _launch_inline(paths: list[GradientPath], streams: Backend) -> list[_GradLaunch]:
    """Reduce-scatter the groups' flat gradients with their used-flags inline.

    The input is rank-major: for each rank r, every group's chunk r followed
    by its E flags (the same in every chunk), in turn: one ``cat`` of the flat
    gradients viewed as (W, S_i) and the flags as (W, E_i). The output is, for
    every group, its gradient shard then the rank average of its flags (> 0
    where any rank produced the gradient), end to end; each group adopts its
    slice (a view).
    """
    first = paths[0]
    taken = [p.take_grad() for p in paths]
    W = first.group.world
    rows = [p.flags_row(t.used, streams) for p, t in zip(paths, taken)]
    n = sum(p.group.slot + row.numel() for p, row in zip(paths, rows))
    dtype = taken[0].flat_grad.dtype
    flat = streams.bucket("reduce_scatter", W * n, dtype, first.group.device).view(W, n)
    # (see [Note: bucket buffers] in _streams.py)
    if all(p.group.gather_bounds is None for p in paths):  # equal chunks: one cat
        cols = []
        for p, t, row in zip(paths, taken, rows):
            cols += [t.flat_grad.view(W, p.group.shard_numel), row.expand(W, row.numel())]
        torch.cat(cols, dim=1, out=flat)
    else:  # uneven pieces padded to their slots ([Note: padded collectives] in _collectives.py)
        at = 0
        for p, t, row in zip(paths, taken, rows):
            g = p.group
            if g.gather_bounds is None:
                flat[:, at:at + g.slot].copy_(t.flat_grad.view(W, g.slot))
            else:
                _collectives.pack(flat.view(-1), t.flat_grad, g.gather_bounds, g.slot, n, at)
            flat[:, at + g.slot:at + g.slot + row.numel()].copy_(row.expand(W, row.numel()))
            at += g.slot + row.numel()
    launches, at = [], 0
    for p, t, row in zip(paths, taken, rows):
        n = p.group.slot + row.numel()
        launches.append(_GradLaunch(p, streams, None, _UsedFlags(t.used, inline=True), t.post,
                                    (at, at + n)))
        at += n
    g = first.group
    pending = streams.reduce_scatter(flat.view(-1), g.rs_pg, taken[0].op, _fold_all(launches),
                                     g.replicate_pg is not None,  # waited once, shared
                                     (g.unit_fqn, f"{_REDUCE} (a bucket of {len(paths)} "
                                                  "groups from here on)"))
    for launch in launches:
        launch.pending = pending
        launch.bucket = flat
    return launches
