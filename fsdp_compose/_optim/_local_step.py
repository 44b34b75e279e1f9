"""The optimizer step on local tensors (docs/dtensor-params.md, "Optimizer").

Sharded parameters, their gradients and their optimizer state are RowParam
DTensors (_row_dtensor.py). An optimizer stepping them as DTensors pays
DTensor's dispatch on every foreach and element-wise op (6-8x the plain step
on 200 small parameters, measured). The step needs none of it: an optimizer
that the step pre-hook admits (_torch_hooks.py, [Note: optimizers on sharded
parameters]) is element-wise on this rank's rows, or steps whole pieces.

So, for the length of ``step()``, torch's global step pre-hook swaps each
RowParam in the optimizer's ``param_groups`` for its local tensor (this
rank's rows, a view of the flat shard: the step writes the shard) and hands
the optimizer a state dict keyed by the local tensors, holding the local
tensors of its state; the post-hook swaps them back. The local tensor's
``.grad`` is the gradient's rows at all times: every ``p.grad = g`` on a
RowParam also sets it (``_row_dtensor.mirror_grad``; the same rows, no
memory of its own, and None after ``zero_grad``). State the step creates or
rebinds (the first step's ``exp_avg``...) reaches the user's state dict as
the step writes it, wrapped as RowParams of the parameter's split
(``_LocalState``): what ``optimizer.state_dict()`` and DCP see are DTensors,
as under FSDP2.

The swap is built once per optimizer and reused while nothing it was built
from changed (``_Swap.holds``, C-level identity loops): swap and restore
take about 0.7 us per parameter per step (0.18 ms on 258 parameters), against
~8 us when the swap was built at every step (2.1 ms, which made the foreach
AdamW step 1.2x its cost on plain tensors).

A step that raises leaves the swap in place (torch runs no post-hook then);
the next pre-hook, or ``restore``, undoes it first.

A ``closure`` (Lightning's automatic optimization passes one to every
``step``) runs forward and backward *inside* ``step()``, after the pre-hook:
swapped, its backward would write ``p.grad`` of the user's parameters while
the optimizer reads the local tensors' (None: no update, silently), and its
``zero_grad()`` would clear the wrong ones. So the pre-hook wraps it: the
swap is undone for the closure and made again after it (``wrap_closure``).
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from itertools import chain
from operator import attrgetter, is_

import torch

from .._base import _compat
from .._group import _row_dtensor
from .._group._row_dtensor import RowParam, row_param

_active: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> _Swap in force
_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # optimizer -> its _Swap

_local = attrgetter("_local_tensor")
_grad = attrgetter("grad")


def _same(a, b) -> bool:
    """``a`` and ``b`` hold the same objects in the same order (identity: no
    Tensor ``__eq__``; C loops only)."""
    return len(a) == len(b) and all(map(is_, a, b))


def _contents(dicts) -> tuple:
    """What a change to any of ``dicts`` changes: their sizes and their values
    (identities), flattened with C loops."""
    return (tuple(map(len, dicts)), tuple(chain.from_iterable(map(dict.values, dicts))))


class _LocalState(dict):
    """A RowParam's optimizer state as the step sees it: its values' local
    tensors. Every write the step makes also reaches the user's state dict
    (``Swap.mirror``), so nothing is carried back after the step."""

    __slots__ = ("_swap", "_p")

    def __init__(self, swap: _Swap, p: RowParam, items=()):
        super().__init__(items)
        self._swap, self._p = swap, p

    def __setitem__(self, k, v):
        dict.__setitem__(self, k, v)
        self._swap.mirror(self._p, k, v)

    def __delitem__(self, k):
        dict.__delitem__(self, k)
        self._swap.mirror_del(self._p, k)

    def setdefault(self, k, v=None):
        if k not in self:
            self[k] = v
        return dict.__getitem__(self, k)

    def update(self, *args, **kwargs):
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def pop(self, k, *default):
        if k in self:
            v = dict.__getitem__(self, k)
            del self[k]
            return v
        return dict.pop(self, k, *default)

    def popitem(self):
        k, v = dict.popitem(self)
        self._swap.mirror_del(self._p, k)
        return k, v

    def clear(self):
        for k in list(self):
            del self[k]


class _LocalStates(defaultdict):
    """``optimizer.state`` during the step: keyed by the tensors the step
    sees. A RowParam's entry is a ``_LocalState``; a plain parameter's is the
    user's own dict. New entries (``self.state[p]`` of a parameter without
    state, as torch's ``defaultdict(dict)`` gives them) are made in the
    user's state dict too."""

    __slots__ = ("_swap",)

    def __init__(self, swap: _Swap):
        super().__init__(dict)  # (torch's type for optimizer.state; __missing__ is ours)
        self._swap = swap

    def __missing__(self, key):
        swap = self._swap
        p = swap.by_local.get(id(key))
        if p is None:
            d = swap.dstate[key]  # (a plain parameter: the user's dict, shared)
        else:
            d = _LocalState(swap, p)
            swap.dstate[p]  # (created there too, as defaultdict would)
        swap.dirty = True  # (the user's state dict has a new entry: snapshot again)
        dict.__setitem__(self, key, d)
        return d

    def __setitem__(self, key, value):
        swap = self._swap
        p = swap.by_local.get(id(key))
        if p is None:
            swap.dstate[key] = value
        else:
            swap.dstate[p] = {}
            local = _LocalState(swap, p)
            local.update(value)
            value = local
        swap.dirty = True
        dict.__setitem__(self, key, value)


class _Swap:
    """One optimizer's swap: the local parameter lists, the local state, and
    snapshots (object identities) of what they were built from.

    Reused step after step while the snapshots hold (C-level identity loops).
    A change the user makes between steps (a parameter list or its contents,
    ``p.data =``, ``opt.state`` replaced, a state entry set or removed,
    ``load_state_dict``) fails a snapshot and the swap is built again: as
    correct as building it every step, paying for it only on the steps after
    a change."""

    __slots__ = ("groups", "user_lists", "user_params", "local_lists", "pairs", "by_local",
                 "params", "locals", "dstate", "lstate", "snap", "epoch", "dirty",
                 "grads_unchecked", "unmirrored")

    def __init__(self, opt: torch.optim.Optimizer):
        self.groups: list = []       # the param_groups dicts
        self.user_lists: list = []   # their "params" lists, as the user holds them
        self.user_params: list = []  # ... and those lists' contents (tuples)
        self.local_lists: list = []  # the lists the optimizer steps (RowParams -> local)
        self.pairs: list = []        # (RowParam parameter, its local tensor)
        self.by_local: dict = {}     # id(local tensor) -> its RowParam
        self.dstate = opt.state
        self.lstate = _LocalStates(self)
        self.dirty = False
        self.grads_unchecked = True
        self.unmirrored = -1

    def mirror(self, p: RowParam, k, v) -> None:
        """The step set ``state[k] = v`` for RowParam ``p``: the user's state
        gets ``v`` (a tensor of ``p``'s local shape as a RowParam of its split)."""
        ds = self.dstate[p]
        cur = ds.get(k)
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == p._local_tensor.shape:
            if not (isinstance(cur, RowParam) and cur._local_tensor is v):
                ds[k] = row_param(v, p._spec)
        elif cur is not v:
            ds[k] = v
        self.dirty = True

    def mirror_del(self, p: RowParam, k) -> None:
        self.dstate[p].pop(k, None)
        self.dirty = True

    def snapshot(self) -> None:
        """Record what the swap was built from (after building it, and after
        a step that wrote state)."""
        d = self.dstate
        dvals = tuple(d.values())
        self.params = tuple(p for p, _ in self.pairs)
        self.locals = tuple(lt for _, lt in self.pairs)
        self.snap = (tuple(d), dvals) + _contents(dvals)
        self.epoch = _row_dtensor.data_epoch
        self.dirty = False

    def holds(self, opt: torch.optim.Optimizer) -> bool:
        """Whether this swap still matches ``opt`` (see the class docstring)."""
        groups = opt.param_groups
        if (not _same(groups, self.groups) or opt.state is not self.dstate
                or self.epoch != _row_dtensor.data_epoch):
            return False
        if not all(map(is_, [g["params"] for g in groups], self.user_lists)):
            return False
        if not all(map(_same, self.user_lists, self.user_params)):
            return False
        d, snap = self.dstate, self.snap
        dvals = tuple(d.values())
        if not (_same(dvals, snap[1]) and _same(tuple(d), snap[0])):
            return False
        lens, vals = _contents(dvals)
        return (lens == snap[2] and _same(vals, snap[3])
                and _same(tuple(map(_local, self.params)), self.locals))


def swap_in(opt: torch.optim.Optimizer) -> bool:
    """Swap ``opt``'s RowParams for their local tensors; False if it holds none."""
    restore(opt)
    with _compat.no_subclass_dispatch():  # (our reads: no RowParam dispatch)
        swap = _plans.get(opt)
        if swap is None or not swap.holds(opt):
            swap = _build(opt)
            if swap is None:
                _plans.pop(opt, None)
                return False
            _plans[opt] = swap
        for g, local in zip(swap.groups, swap.local_lists):
            g["params"] = local
        if swap.grads_unchecked or swap.unmirrored != _row_dtensor.grad_unmirrored:
            # (a new swap, or a gradient the setter could not mirror: set each
            # one here, where torch's own check raises for one that does not fit)
            for lt, g in zip(swap.locals, map(_grad, swap.params)):
                lt.grad = g if g is None else g._local_tensor
            swap.grads_unchecked = False
            swap.unmirrored = _row_dtensor.grad_unmirrored
        opt.state = swap.lstate
        _active[opt] = swap
        return True


def _build(opt: torch.optim.Optimizer) -> _Swap | None:
    swap = _Swap(opt)
    dstate, lstate = swap.dstate, swap.lstate
    for g in opt.param_groups:
        params = g["params"]
        local = []
        for p in params:
            if isinstance(p, RowParam):
                lt = p._local_tensor
                swap.pairs.append((p, lt))
                swap.by_local[id(lt)] = p
                local.append(lt)
                ds = dstate.get(p)
                if ds:
                    dict.__setitem__(lstate, lt, _LocalState(swap, p, (
                        (k, v._local_tensor if isinstance(v, RowParam) else v)
                        for k, v in ds.items())))
            else:
                local.append(p)
                if p in dstate:
                    dict.__setitem__(lstate, p, dstate[p])
        swap.groups.append(g)
        swap.user_lists.append(params)
        swap.user_params.append(tuple(params))
        swap.local_lists.append(local)
    if not swap.pairs:
        return None
    # (state of parameters in no group, e.g. loaded for a group removed since: kept as is)
    swap.snapshot()
    return swap


def wrap_closure(opt: torch.optim.Optimizer, args: tuple, kwargs: dict):
    """``(args, kwargs)`` of ``opt.step`` (``args[0]`` is the optimizer, as
    torch's step hooks get them) with its closure, if any, run unswapped."""
    if len(args) > 1 and callable(args[1]):
        closure, where = args[1], "args"
    elif callable(kwargs.get("closure")):
        closure, where = kwargs["closure"], "kwargs"
    else:
        return None

    def unswapped():
        restore(opt)
        try:
            return closure()
        finally:
            swap_in(opt)

    if where == "args":
        return (args[0], unswapped) + tuple(args[2:]), kwargs
    return args, {**kwargs, "closure": unswapped}


def restore(opt: torch.optim.Optimizer) -> None:
    """Undo ``swap_in``: the user's parameters and state dict (the step's
    writes are in it already)."""
    swap = _active.pop(opt, None)
    if swap is None:
        return
    with _compat.no_subclass_dispatch():
        for g, params in zip(swap.groups, swap.user_lists):
            g["params"] = params
        if opt.state is not swap.lstate:  # (the step replaced opt.state itself)
            _carry_back(opt.state, swap)
            _plans.pop(opt, None)
        opt.state = swap.dstate
        if swap.dirty:
            swap.snapshot()


def _carry_back(lstate: dict, swap: _Swap) -> None:
    """A state dict the step put in place of the swap's: its entries back
    into the user's (per-row tensors wrapped as RowParams of the split)."""
    for p, lt in swap.pairs:
        for k, v in (lstate.get(lt) or {}).items():
            swap.mirror(p, k, v)
    for params in swap.user_lists:
        for p in params:
            if not isinstance(p, RowParam) and p in lstate:
                swap.dstate[p] = lstate[p]
