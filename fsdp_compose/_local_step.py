"""The optimizer step on local tensors (docs/dtensor-params.md, "Optimizer").

Sharded parameters, their gradients and their optimizer state are RowParam
DTensors (_row_dtensor.py). An optimizer stepping them as DTensors pays
DTensor's dispatch on every foreach and element-wise op (6-8x the plain step
on 200 small parameters, measured). The step needs none of it: an optimizer
that the step pre-hook admits (_torch_hooks.py, [Note: optimizers on sharded
parameters]) is element-wise on this rank's rows, or steps whole pieces.

So, for the length of ``step()``, torch's global step pre-hook swaps each
RowParam in the optimizer's ``param_groups`` for its local tensor (this
rank's rows, a view of the flat shard: the step writes the shard), gives that
tensor the gradient's rows as ``.grad``, and hands the optimizer a state dict
keyed by the local tensors, holding the local tensors of its state. The
post-hook swaps everything back and wraps state the step created (the first
step's ``exp_avg``...) as RowParams of the parameter's split, once: what
``optimizer.state_dict()`` and DCP see are DTensors, as under FSDP2.

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

import torch

from ._row_dtensor import RowParam, local_of, row_param

_active: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Swap:
    __slots__ = ("groups", "dstate", "pairs")

    def __init__(self, opt: torch.optim.Optimizer):
        self.groups: list = []  # (group, its params as the user holds them)
        self.pairs: list = []   # (RowParam parameter, its local tensor)
        self.dstate = opt.state


def swap_in(opt: torch.optim.Optimizer) -> bool:
    """Swap ``opt``'s RowParams for their local tensors; False if it holds none."""
    restore(opt)
    with torch._C.DisableTorchFunctionSubclass():  # (our reads: no RowParam dispatch)
        return _swap_in(opt)


def _swap_in(opt: torch.optim.Optimizer) -> bool:
    swap = _Swap(opt)
    dstate = swap.dstate
    lstate: defaultdict = defaultdict(dict)
    for g in opt.param_groups:
        params = g["params"]
        local = []
        for p in params:
            if isinstance(p, RowParam):
                lt = p._local_tensor
                grad = p.grad
                lt.grad = None if grad is None else local_of(grad)
                swap.pairs.append((p, lt))
                local.append(lt)
                ds = dstate.get(p)
                if ds:
                    lstate[lt] = {k: v._local_tensor if isinstance(v, RowParam) else v
                                  for k, v in ds.items()}
            else:
                local.append(p)
                if p in dstate:
                    lstate[p] = dstate[p]
        swap.groups.append((g, params))
        if swap.pairs:
            g["params"] = local
    if not swap.pairs:
        for g, params in swap.groups:
            g["params"] = params
        return False
    # (state of parameters in no group, e.g. loaded for a group removed since: kept as is)
    opt.state = lstate
    _active[opt] = swap
    return True


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
    """Undo ``swap_in``: the user's parameters, their state (new state wrapped)."""
    swap = _active.pop(opt, None)
    if swap is None:
        return
    with torch._C.DisableTorchFunctionSubclass():
        _restore(opt, swap)


def _restore(opt: torch.optim.Optimizer, swap: _Swap) -> None:
    lstate, dstate = opt.state, swap.dstate
    for g, params in swap.groups:
        g["params"] = params
    for p, lt in swap.pairs:
        ls = lstate.get(lt)
        if ls:
            ds = dstate[p]
            for k, v in ls.items():
                cur = ds.get(k)
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == lt.shape:
                    if not (isinstance(cur, RowParam) and cur._local_tensor is v):
                        ds[k] = row_param(v, p._spec)
                elif cur is not v:
                    ds[k] = v
        lt.grad = None
    for _g, params in swap.groups:  # plain parameters' state the step created
        for p in params:
            if not isinstance(p, RowParam) and p in lstate and p not in dstate:
                dstate[p] = lstate[p]
    opt.state = dstate
