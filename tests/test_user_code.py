"""What ordinary user code does with a sharded model, compared with plain PyTorch.

- outputs of any pytree-like type passed between units (dataclasses, dict
  subclasses, NamedTuples, tuples, nested) survive backward, also with an
  output-casting mp_policy;
- forward-mode and functional AD (``torch.func.jvp`` on the very first
  forward, ``torch.autograd.forward_ad``, ``vmap``, ``torch.func.grad``);
- one model-wide ``ignored_params`` set passed to every ``fully_shard`` call;
- ``clip_grad_norm_`` with torch's ``error_if_nonfinite`` and ``foreach``:
  every rank raises on a non-finite global norm, none is left in a collective.

One launch per world size (1, 2, 4); each scenario compares with a plain
PyTorch reference on the global batch and returns what differed.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections import OrderedDict
from typing import NamedTuple

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp_compose
from fsdp_compose import MixedPrecisionPolicy, fully_shard

from ._support import Scenarios, call_by_name, compare_with_reference, range_or_whole, rows

ROWS = 8


def batch(step: int, din: int = 4, dout: int = 2):
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(ROWS, din, generator=g), torch.randn(ROWS, dout, generator=g)


def mine(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def compare(model, ref, what: str, tol: float = 1e-5, grads: bool = True) -> list[str]:
    """As the reference; an ignored parameter (not sharded) whole."""
    return compare_with_reference(model, ref, what, grads=grads, rtol=tol, atol=tol,
                                  local_range=range_or_whole)


def parity(model, ref, rank, world, steps=3, tol=1e-5) -> list[str]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    bad = []
    for step in range(steps):
        x, y = batch(step)
        F.mse_loss(model(mine(x, rank, world)), mine(y, rank, world)).backward()
        F.mse_loss(ref(x), y).backward()
        bad += compare(model, ref, f"step {step}", tol)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return bad


# --------------------------------------------------------- pytree outputs
@dataclasses.dataclass
class DataOut:
    hidden: torch.Tensor
    gate: torch.Tensor
    layer: int = 0  # not a tensor
    cache: list = dataclasses.field(default_factory=list)
    extra: torch.Tensor | None = dataclasses.field(default=None, init=False)


class PairOut(NamedTuple):
    hidden: torch.Tensor
    gate: torch.Tensor


class ModelOutputLike(OrderedDict):
    """An OrderedDict subclass nobody registered with torch's pytree."""


class Producer(nn.Module):
    """A unit that returns its two tensors inside ``kind`` of container."""

    def __init__(self, kind: str, d: int = 6):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(d, d)
        self.gate_lin = nn.Linear(d, d)

    def forward(self, x):
        h, g = torch.tanh(self.lin(x)), torch.sigmoid(self.gate_lin(x))
        if self.kind == "dataclass":
            out = DataOut(h, g, cache=[h * 0])
            out.extra = g * 2
            return out
        if self.kind == "namedtuple":
            return PairOut(h, g)
        if self.kind == "tuple":
            return h, g
        if self.kind == "dict_subclass":
            return ModelOutputLike(hidden=h, gate=g)
        return [{"deep": DataOut(h, g)}]  # nested


def unpack(out):
    if isinstance(out, DataOut):
        return out.hidden + out.cache[0], out.gate + out.extra
    if isinstance(out, (PairOut, tuple)):
        return out
    if isinstance(out, dict):
        return out["hidden"], out["gate"]
    d = out[0]["deep"]
    return d.hidden, d.gate


class Chain(nn.Module):
    def __init__(self, kind: str, d: int = 6):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.producer = Producer(kind, d)
        self.out = nn.Linear(d, 2)

    def forward(self, x):
        h, g = unpack(self.producer(self.inp(x)))
        return self.out((h * g).float())


def pytree_outputs(rank, world):
    bad = []
    for kind in ("dataclass", "namedtuple", "tuple", "dict_subclass", "nested"):
        for mp in (None, MixedPrecisionPolicy(output_dtype=torch.float64)):
            torch.manual_seed(0)
            m = Chain(kind)
            ref = copy.deepcopy(m)
            fully_shard(m.producer, reshard_after_forward=True, mp_policy=mp)
            fully_shard(m)
            if mp is not None:  # the reference casts the producer's outputs the same way
                ref.producer.register_forward_hook(lambda mod, a, out: _to64(out))
                dtypes = []  # (a hook added after fully_shard's sees the cast output)
                m.producer.register_forward_hook(
                    lambda mod, a, out: dtypes.extend(t.dtype for t in unpack(out)))
            try:
                bad += [f"{kind} {mp is not None}: {b}" for b in parity(m, ref, rank, world)]
            except RuntimeError as e:
                bad.append(f"{kind} {mp is not None}: raised {e}")
                continue
            if mp is not None and set(dtypes) != {torch.float64}:
                bad.append(f"{kind}: output_dtype not applied inside the container: {dtypes}")
    return bad


def _to64(out):
    return fsdp_compose._base._compat.tree_map_tensors(lambda t: t.double(), out)


# ------------------------------------------------------ forward-mode AD
class Net(nn.Module):
    def __init__(self, d: int = 6):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))
        self.out = nn.Linear(d, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.blocks(self.inp(x))))


def built(seed=0, **kw):
    torch.manual_seed(seed)
    m = Net()
    ref = copy.deepcopy(m)
    fully_shard(m.blocks, **kw)
    fully_shard(m, **kw)
    return m, ref


def _close(a, b, tol=1e-5):
    return torch.allclose(a, b, rtol=tol, atol=tol)


def forward_mode_ad(rank, world):
    bad = []
    m, ref = built(1)
    x, _ = batch(0)
    t = torch.ones_like(x)
    # the very first forward of the model is a jvp (lazy init inside the transform)
    out, tan = torch.func.jvp(m, (x,), (t,))
    want, want_tan = torch.func.jvp(ref, (x,), (t,))
    if not (_close(out, want) and _close(tan, want_tan)):
        bad.append("torch.func.jvp on the first forward differs")
    bad += parity(m, ref, rank, world, steps=2)  # trains as usual afterwards
    out, tan = torch.func.jvp(m, (x,), (t,))
    want, want_tan = torch.func.jvp(ref, (x,), (t,))
    if not (_close(out, want) and _close(tan, want_tan)):
        bad.append("torch.func.jvp after training differs")
    with fwAD.dual_level():
        d = fwAD.make_dual(x, t)
        got = fwAD.unpack_dual(m(d)).tangent
        want_fw = fwAD.unpack_dual(ref(d)).tangent
    if not _close(got, want_fw):
        bad.append("torch.autograd.forward_ad differs")
    if not _close(torch.func.vmap(m)(x), torch.func.vmap(ref)(x)):
        bad.append("torch.func.vmap differs")
    gx = torch.func.grad(lambda v: m(v).sum())(x)
    if not _close(gx, torch.func.grad(lambda v: ref(v).sum())(x)):
        bad.append("torch.func.grad differs")
    bad += [f"after the transforms: {b}" for b in parity(m, ref, rank, world, steps=1)]
    return bad


# ------------------------------------------------ model-wide ignored_params
def model_wide_ignored(rank, world):
    torch.manual_seed(2)
    m = Net()
    ref = copy.deepcopy(m)
    ignored = {m.out.weight, m.blocks[0].bias}  # one set for the whole model
    kept = {id(p): tuple(p.shape) for p in ignored}
    fully_shard(m.blocks, ignored_params=ignored)
    fully_shard(m, ignored_params=ignored)
    bad = []
    for p in ignored:
        if p not in set(m.parameters()) or tuple(p.shape) != kept[id(p)]:
            bad.append(f"ignored parameter {tuple(p.shape)} was replaced or reshaped")
        if p in fsdp_compose._base._registry.SHARDED:
            bad.append(f"ignored parameter {tuple(p.shape)} was sharded")
    # every rank sees the same batch: an ignored parameter's (unreduced) gradient
    # then equals the reference's, as do the sharded ones
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        x, y = batch(step)
        F.mse_loss(m(x), y).backward()
        F.mse_loss(ref(x), y).backward()
        bad += compare(m, ref, f"step {step}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return bad


# ----------------------------------------------------------- clip_grad_norm_
def clip_arguments(rank, world):
    bad = []
    for norm_type in (2.0, math.inf):
        for foreach in (None, True, False):
            m, ref = built(3)
            x, y = batch(0)
            F.mse_loss(m(mine(x, rank, world)), mine(y, rank, world)).backward()
            F.mse_loss(ref(x), y).backward()
            total = fsdp_compose.clip_grad_norm_(m.parameters(), 0.05, norm_type,
                                                 error_if_nonfinite=True, foreach=foreach)
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type,
                                                  error_if_nonfinite=True, foreach=foreach)
            if not _close(total, want):
                bad.append(f"norm {norm_type} foreach={foreach}: {total} != {want}")
            bad += compare(m, ref, f"clipped, norm {norm_type} foreach={foreach}")
    # one rank's gradient non-finite: every rank raises, after the same collectives
    for norm_type in (2.0, math.inf):
        for poison in (float("nan"), float("inf")):
            m, _ = built(4)
            x, y = batch(0)
            F.mse_loss(m(mine(x, rank, world)), mine(y, rank, world)).backward()
            # (this rank's rows of the gradients: a RowParam's local tensor)
            held = [p for p in m.parameters() if p.grad is not None and rows(p.grad).numel()]
            if rank == world - 1:
                rows(held[-1].grad).view(-1)[0] = poison
            before = [None if p.grad is None else rows(p.grad).clone() for p in m.parameters()]
            try:
                fsdp_compose.clip_grad_norm_(m.parameters(), 0.05, norm_type,
                                             error_if_nonfinite=True)
                bad.append(f"norm {norm_type}, {poison} on rank {world - 1}: no error")
            except RuntimeError as e:
                if "non-finite" not in str(e) or "error_if_nonfinite=False" not in str(e):
                    bad.append(f"unexpected error: {e}")
            if not all((p.grad is None and g is None) or torch.equal(rows(p.grad), g)
                       or rows(p.grad).isnan().any() for p, g in zip(m.parameters(), before)):
                bad.append("gradients were scaled before raising")
            if world > 1:  # every rank is out of clip's collectives: this one matches
                flag = torch.ones(1)
                dist.all_reduce(flag)
                if flag.item() != world:
                    bad.append("ranks out of step after the error")
            # without the flag the non-finite norm is returned on every rank
            total = fsdp_compose.clip_grad_norm_(m.parameters(), 0.05, norm_type)
            if bool(torch.isfinite(total)):
                bad.append(f"norm {norm_type}, {poison} on one rank: finite total {total}")
    return bad


SCENARIOS = [pytree_outputs, forward_mode_ad, model_wide_ignored, clip_arguments]


NAMES = [fn.__name__ for fn in SCENARIOS]
_LAUNCHES = Scenarios(functools.partial(call_by_name, SCENARIOS), timeout=240)


@pytest.mark.parametrize("scenario", NAMES)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_user_code(world, scenario):
    _LAUNCHES.assert_no_problems(world, scenario, NAMES)
