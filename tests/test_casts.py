"""Casting and moving a model after fully_shard (``nn.Module._apply``), as in FSDP2.

``model.to(dtype)`` / ``.double()`` / ``.half()`` / ``.float()`` / ``.cpu()``
and ``to_empty(device=...)`` after ``fully_shard`` cast or move the shards and
whatever derives from them (flat buffers, the compute dtype unless an
mp_policy fixes it, gradients), under each of torch's three ``_apply``
behaviours (``.data`` assignment, overwrite, swap_tensors).

One launch per world size (1, 2, 4) runs every scenario; each compares, step
by step, with a single-process reference model given the same cast and
trained on the global batch (the rank-averaged gradient of ours is the global
batch's gradient). A scenario returns the list of what differed.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from fsdp_compose import (MixedPrecisionPolicy, fully_shard, get_state_dict, param_info,
                          record_schedule)

from . import _support
from ._support import Scenarios, call_by_name, compare_with_reference, rows, shard

ROWS = 8  # global batch, divisible by every world size


class Net(_support.Net):
    """2 blocks of width 6, 2 outputs."""

    def __init__(self):
        super().__init__(out=2)


def built(seed: int = 0, **kw) -> tuple[Net, Net]:
    """(ours, reference): the same initial values; ours sharded."""
    torch.manual_seed(seed)
    m = Net()
    ref = copy.deepcopy(m)
    return shard(m, **kw), ref


def batch(step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, 3, generator=g).to(dtype), torch.randn(ROWS, 2, generator=g).to(dtype)


def backward(model, ref, step, rank, world, dtype=torch.float32, ref_dtype=None):
    x, y = batch(step, dtype)
    n = ROWS // world
    out = model(x[rank * n:(rank + 1) * n])
    # The target in the output's dtype (an mp_policy's param_dtype: the dtype
    # the reference computes in): torch 2.11's mse_loss backward raises on a
    # target of another dtype ("Found dtype Double but expected BFloat16",
    # plain PyTorch too: pytorch/pytorch#94086; 2.13 and 2.14 compute it)
    F.mse_loss(out, y[rank * n:(rank + 1) * n].to(out.dtype)).backward()
    rx, ry = batch(step, ref_dtype or dtype)
    F.mse_loss(ref(rx), ry).backward()


def compare(model, ref, what: str, tol: float = 1e-6, grads: bool = True) -> list[str]:
    """Every sharded parameter (and gradient) against the same piece of the
    reference's, dtypes included; ``tol`` relative and absolute."""
    return compare_with_reference(model, ref, what, grads=grads, rtol=tol, atol=tol)


def train(model, ref, steps, rank, world, dtype, tol, make_opt=None) -> list[str]:
    """Optimizers built now (after the cast), then ``steps`` compared steps."""
    make_opt = make_opt or (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    bad = []
    for step in steps:
        backward(model, ref, step, rank, world, dtype)
        bad += compare(model, ref, f"step {step} grads", tol)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        bad += compare(model, ref, f"step {step} params", tol, grads=False)
    return bad


def weight_dtypes(model) -> list:
    """The dtype of the weight each Linear computes with, recorded by a forward hook."""
    seen = []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.dtype))
    return seen


# ----------------------------------------------------------------- scenarios
def double_before_first_forward(rank, world):
    m, ref = built()
    before = [id(p) for p in m.parameters()]
    m.double()
    ref.double()
    bad = [] if [id(p) for p in m.parameters()] == before else ["parameter objects changed"]
    bad += train(m, ref, range(3), rank, world, torch.float64, 1e-10)
    sd, _ = get_state_dict(m, [], full_state_dict=True)
    want = ref.state_dict()
    if list(sd) != list(want) or any(sd[k].dtype != v.dtype or not torch.allclose(sd[k], v)
                                     for k, v in want.items()):
        bad.append("full state dict differs from the reference's (keys, dtypes or values)")
    return bad


def double_with_grads_after_training(rank, world):
    """A cast after lazy init, with p.grad set: _apply casts the gradients too."""
    m, ref = built(1)
    bad = train(m, ref, range(2), rank, world, torch.float32, 1e-5)
    backward(m, ref, 2, rank, world)
    m.to(torch.float64)
    ref.to(torch.float64)
    bad += compare(m, ref, "gradients cast by .to()", 1e-6)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt.step()
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()
    bad += compare(m, ref, "step on the cast gradients", 1e-6, grads=False)
    bad += train(m, ref, range(3, 5), rank, world, torch.float64, 1e-6)
    return bad


def bf16_half_and_back(rank, world):
    m, ref = built(2)
    m.to(torch.bfloat16)
    ref.to(torch.bfloat16)
    bad = compare(m, ref, "after .to(bfloat16)", 0.0, grads=False)
    x = batch(0, torch.bfloat16)[0]
    with torch.no_grad():
        if not torch.allclose(m(x).float(), ref(x).float(), rtol=1e-2, atol=1e-2):
            bad.append("bf16 eval forward differs")
    backward(m, ref, 0, rank, world, torch.bfloat16)
    bad += compare(m, ref, "bf16 gradients", 5e-2)
    m.zero_grad()
    ref.zero_grad()
    m.half()
    ref.half()
    bad += compare(m, ref, "after .half()", 0.0, grads=False)
    m.float()
    ref.float()
    bad += compare(m, ref, "after .float()", 0.0, grads=False)
    bad += train(m, ref, range(1, 3), rank, world, torch.float32, 1e-5)
    return bad


def mp_policy_keeps_compute_dtype(rank, world):
    """param_dtype=bf16 fixes the compute dtype: .double() casts the master only."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    m, ref = built(3, mp_policy=mp)
    m.double()
    seen = weight_dtypes(m)
    bf16_ref = copy.deepcopy(ref).to(torch.bfloat16)  # what the unit computes with
    backward(m, bf16_ref, 0, rank, world, torch.float64, ref_dtype=torch.bfloat16)
    bad = [] if seen and set(seen) == {torch.bfloat16} else [f"computed with {set(seen)}"]
    if any(p.dtype != torch.float64 or (p.grad is not None and p.grad.dtype != torch.float64)
           for p in m.parameters()):
        bad.append("master parameters / gradients are not float64")
    ref.double()
    for p, r in zip(m.parameters(), bf16_ref.parameters()):  # bf16 grads, reduced in fp32
        a, b = param_info(p).local_range
        if p.grad is None:  # (empty where this rank holds no rows of it)
            bad.append(f"{param_info(p).fqn} grad is None")
            continue
        g = rows(p.grad)
        if not torch.allclose(g, r.grad.double().reshape(-1)[a:b].view_as(g),
                              rtol=2e-2, atol=2e-2):
            bad.append(f"{param_info(p).fqn} grad differs")
    return bad


def mp_model_cast_to_param_dtype(rank, world):
    """The master cast away from the policy's param_dtype and back: at world
    size 1 the units start passive (direct groups, forward hooks removed at
    lazy init), need their hooks again to compute in fp32 from a bf16 master,
    and are passive again after .float()."""
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, cast_forward_inputs=False)
    m, ref = built(4, mp_policy=mp)
    bad = train(m, ref, range(1), rank, world, torch.float32, 1e-5)  # lazy init ran
    m.to(torch.bfloat16)   # master bf16, computes in fp32: units with a cast again
    seen = weight_dtypes(m)
    ref32 = copy.deepcopy(ref).to(torch.bfloat16).float()
    with record_schedule() as cast_after:
        backward(m, ref32, 1, rank, world, torch.float32)
    # the same schedule as a model cast before fully_shard (lazy init ran again)
    torch.manual_seed(4)
    fresh = shard(Net().to(torch.bfloat16), mp_policy=mp)
    with record_schedule() as cast_before:
        backward(fresh, copy.deepcopy(ref32), 1, rank, world, torch.float32)
    if cast_after != cast_before:
        bad.append(f"schedule after the cast {cast_after} != cast before {cast_before}")
    if not seen or set(seen) != {torch.float32}:
        bad.append(f"bf16 master computed with {set(seen)}")
    for p, r in zip(m.parameters(), ref32.parameters()):
        a, b = param_info(p).local_range
        if p.grad is None:  # (empty where this rank holds no rows of it)
            bad.append(f"{param_info(p).fqn} grad is None")
            continue
        g = rows(p.grad)
        want = r.grad.reshape(-1)[a:b].to(torch.bfloat16).view_as(g)
        if g.dtype != torch.bfloat16 or not torch.allclose(g.float(), want.float(),
                                                           rtol=1e-2, atol=1e-2):
            bad.append(f"{param_info(p).fqn} grad {p.grad.dtype} differs")
    m.zero_grad()
    m.float()
    ref32.zero_grad()
    bad += train(m, ref32, range(2, 4), rank, world, torch.float32, 1e-5)
    return bad


def to_empty_after_meta(rank, world):
    """meta build, fully_shard, to_empty, load: the alternative to materialize."""
    torch.manual_seed(5)
    ref = Net()
    with torch.device("meta"):
        m = Net()
    shard(m)
    m.to_empty(device="cpu")  # (new Parameter objects, as in plain PyTorch from meta)
    bad = [f"{n} still on meta" for n, p in m.named_parameters() if p.is_meta]
    m.load_state_dict(ref.state_dict())
    bad += compare(m, ref, "loaded", 0.0, grads=False)
    bad += train(m, ref, range(3), rank, world, torch.float32, 1e-5)
    return bad


def overwrite_on_conversion(rank, world):
    """torch.__future__ overwrite: _apply puts new Parameters in the slots;
    but it swaps the contents of DTensor Parameters (the sharded ones above
    world size 1), keeping the objects, whatever the flag."""
    m, ref = built(6)
    old = list(m.parameters())
    swapped = [isinstance(p, DTensor) for p in old]
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        m.double()
        ref.double()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    kept = [p is o for p, o in zip(m.parameters(), old)]
    bad = [] if kept == swapped else [f"objects kept {kept}, expected {swapped}"]
    if any(swapped) != (world > 1):
        bad.append(f"DTensor parameters {swapped} at world size {world}")
    bad += train(m, ref, range(3), rank, world, torch.float64, 1e-10)
    return bad


def swap_on_conversion(rank, world):
    """torch.__future__ swap_tensors: refuses tensors with weak references."""
    m, ref = built(7)
    bad = train(m, ref, range(1), rank, world, torch.float32, 1e-5)
    backward(m, ref, 1, rank, world)  # p.grad set: views of our gradient shard
    old = list(m.parameters())
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        m.double()
        ref.double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    bad += [] if all(p is o for p, o in zip(m.parameters(), old)) else ["objects replaced"]
    bad += compare(m, ref, "swapped gradients", 1e-6)
    m.zero_grad()
    ref.zero_grad()
    bad += train(m, ref, range(2, 4), rank, world, torch.float64, 1e-6)  # (fp32 step before)
    return bad


def no_op_moves(rank, world):
    """.cpu(), .to('cpu'), .float() on an fp32 CPU model change nothing."""
    m, ref = built(8)
    bad = train(m, ref, range(1), rank, world, torch.float32, 1e-5)
    ptrs = [rows(p).untyped_storage().data_ptr() for p in m.parameters()]
    ids = [id(p) for p in m.parameters()]
    m.cpu().to("cpu").float().to(torch.device("cpu"), torch.float32)
    if [rows(p).untyped_storage().data_ptr() for p in m.parameters()] != ptrs or \
            [id(p) for p in m.parameters()] != ids:
        bad.append("a no-op move re-made the shards")
    bad += train(m, ref, range(1, 3), rank, world, torch.float32, 1e-5)
    return bad


def accumulate_then_cast(rank, world):
    """A gradient accumulated without sync is cast with the model, as p.grad is."""
    m, ref = built(9)
    m.set_requires_gradient_sync(False)
    backward(m, ref, 0, rank, world)
    m.double()
    ref.double()
    m.set_requires_gradient_sync(True)
    backward(m, ref, 1, rank, world, torch.float64)
    return compare(m, ref, "accumulated over a cast", 1e-6)


def cast_inside_a_unit(rank, world):
    """Only a module inside a unit cast: an error naming the parameters."""
    m, _ = built(10)
    m.layers[0].lin1.double()  # a plain module inside unit layers.0: not ours to see
    try:
        m(batch(0)[0])
    except RuntimeError as e:
        msg = str(e)
        want = ["layers.0.lin1.weight", "the module fully_shard was applied to"]
        return [f"{w!r} not in {msg!r}" for w in want if w not in msg]
    return ["no error"]


def _change_inside(lin: nn.Linear, how: str) -> None:
    with torch.no_grad():
        if how == "double":
            lin.double()
        elif how == "data":
            lin.weight.data = lin.weight.detach().clone()
        elif how == "to_empty":
            lin.to_empty(device="cpu")
        else:  # a new Parameter object in the module
            lin.weight = nn.Parameter(lin.weight.detach().clone())


def changed_inside_a_unit_after_training(rank, world):
    """After training, a module inside a unit cast, moved, or its parameter's
    .data or object replaced: the next forward raises, naming the parameter
    (else the optimizer would step a copy no all-gather reads). At world size
    1 (nothing sharded: the Parameters are autograd's own, plain PyTorch) a
    replaced .data trains as it would there."""
    if world == 1:
        m, ref = built(11)
        bad = train(m, ref, [0], rank, world, torch.float32, 1e-6)
        _change_inside(m.layers[0].lin1, "data")
        _change_inside(ref.layers[0].lin1, "data")
        return bad + train(m, ref, [1, 2], rank, world, torch.float32, 1e-6)
    bad = []
    for how in ("double", "data", "to_empty", "new_parameter"):
        m, ref = built(11)
        train(m, ref, [0], rank, world, torch.float32, 1e-6)
        _change_inside(m.layers[0].lin1, how)
        try:
            m(batch(1)[0])
        except RuntimeError as e:
            msg = str(e)
            want = ["layers.0.lin1.weight", "the module fully_shard was applied to"]
            bad += [f"{how}: {w!r} not in {msg!r}" for w in want if w not in msg]
        else:
            bad.append(f"{how}: no error")
    return bad


def partial_list_unit(rank, world):
    """One module of a list unit cast alone: the other keeps the old dtype."""
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)

        def forward(self, x):
            return self.b(self.a(x))

    t = Pair()
    fully_shard([t.a, t.b])
    fully_shard(t)  # names the list unit's parameters
    try:
        t.a.double()
    except ValueError as e:
        msg = str(e)
        want = ["only some of this unit's parameters", "'b.weight' (torch.float32",
                "the module fully_shard was applied to"]
        return [f"{w!r} not in {msg!r}" for w in want if w not in msg]
    return ["no error"]


SCENARIOS = [double_before_first_forward, double_with_grads_after_training, bf16_half_and_back,
             mp_policy_keeps_compute_dtype, mp_model_cast_to_param_dtype, to_empty_after_meta,
             overwrite_on_conversion, swap_on_conversion, no_op_moves, accumulate_then_cast,
             cast_inside_a_unit, changed_inside_a_unit_after_training, partial_list_unit]


NAMES = [fn.__name__ for fn in SCENARIOS]
_LAUNCHES = Scenarios(functools.partial(call_by_name, SCENARIOS), timeout=240)


@pytest.mark.parametrize("scenario", NAMES)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_cast_after_fully_shard(world, scenario):
    _LAUNCHES.assert_no_problems(world, scenario, NAMES)
