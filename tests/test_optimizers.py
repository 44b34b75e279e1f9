"""No optimizer is silently wrong on sharded parameters, and torch's
clip_grad_norm_ gives the global norm (see [Note: optimizers on sharded
parameters] and [Note: torch.nn.utils.clip_grad_norm_] in _torch_hooks.py).

Each world size runs ONE multi-process launch; the ranks return what every
case did, and the tests assert on it (on every rank: a check that raised on
some ranks only would leave the others in a collective).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fsdp_compose
from fsdp_compose import fully_shard

from . import _support
from ._support import shard
from ._dist import run_distributed

ELEMENTWISE = ["SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "RMSprop", "NAdam", "RAdam",
               "Adamax", "Rprop", "ASGD"]


class Net(_support.Net):
    """2 blocks of width 8, hidden 16."""

    def __init__(self):
        super().__init__(2, 8, hidden=16)


def _sharded_net() -> Net:
    torch.manual_seed(0)
    return shard(Net())


class OwnStep(torch.optim.SGD):
    """Unknown to fsdp_compose: it overrides step."""

    @torch.no_grad()
    def step(self, closure=None):
        return super().step(closure)


class InheritsStep(torch.optim.AdamW):
    """Inherits AdamW's step: element-wise."""


class Declared(torch.optim.SGD):
    @torch.no_grad()
    def step(self, closure=None):
        return super().step(closure)


def _try_step(model: nn.Module, make, closure: bool = False) -> str:
    """One step of a fresh optimizer; 'ok', or the error (shards must be untouched)."""
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt = make()
        loss = model(x).square().mean()
        loss.backward()
        opt.step((lambda: model(x).square().mean()) if closure else None)
        return "ok"
    except Exception as e:  # noqa: BLE001 - the test compares the messages
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        return f"{type(e).__name__}{'' if unchanged else ' (shards written)'}: {e}"
    finally:
        for p in model.parameters():
            p.grad = None


def _one_matrix() -> nn.Module:
    """A unit holding one 32x32 matrix: at 2 and 4 ranks its rows are split."""
    torch.manual_seed(0)
    return fully_shard(nn.Sequential(nn.Linear(3, 32, bias=False), nn.ReLU(),
                                     nn.Linear(32, 1, bias=False)))


def _guard(rank, world):
    model = _sharded_net()
    out = {}
    for name in ELEMENTWISE:
        out[name] = _try_step(model, lambda: getattr(torch.optim, name)(model.parameters(), lr=1e-3))
    out["InheritsStep"] = _try_step(model, lambda: InheritsStep(model.parameters()))
    fsdp_compose.declare_optimizer(Declared, "elementwise")
    out["Declared"] = _try_step(model, lambda: Declared(model.parameters(), lr=1e-3))
    # (the 32x32 weight of the second Linear must be split at world size > 1)
    one = _one_matrix()
    out["split"] = [0 < p.shape[0] < fsdp_compose.param_info(p).shape[0] for p in one.parameters()]
    out["LBFGS"] = _try_step(one, lambda: torch.optim.LBFGS(one.parameters(), max_iter=2),
                             closure=True)
    out["Adafactor"] = _try_step(one, lambda: torch.optim.Adafactor(one.parameters()))
    matrices = [p for p in one.parameters() if p.ndim == 2]
    out["Muon"] = _try_step(one, lambda: torch.optim.Muon(matrices))
    out["OwnStep"] = _try_step(one, lambda: OwnStep(one.parameters(), lr=1e-3))
    # an optimizer that passed once is re-checked when its parameters change
    opt = torch.optim.Adafactor([nn.Parameter(torch.ones(2, 2))])
    opt.step()
    opt.add_param_group({"params": list(one.parameters())})
    out["Adafactor, group added"] = _try_step(one, lambda: opt)
    return out


@pytest.fixture(scope="module", params=[1, 2, 4])
def guard(request):
    return request.param, run_distributed(_guard, request.param)


def test_elementwise_optimizers_run(guard):
    world, results = guard
    for r in results:
        for name in ELEMENTWISE + ["InheritsStep", "Declared"]:
            assert r[name] == "ok", (world, name, r[name])


@pytest.mark.parametrize("name, needles", [
    ("LBFGS", ["LBFGS reduces over all parameters", "cannot step sharded parameters"]),
    ("Adafactor", ["Adafactor needs whole tensors", "shard_granularity='tensor'"]),
    ("Muon", ["Muon needs whole tensors", "shard_granularity='tensor'"]),
    ("OwnStep", ["does not know whether OwnStep is element-wise",
                 "declare_optimizer(OwnStep, 'elementwise')"]),
    ("Adafactor, group added", ["Adafactor needs whole tensors"]),
])
def test_optimizers_needing_whole_tensors_raise_on_every_rank(guard, name, needles):
    world, results = guard
    if world > 1:  # the case the guard is for: some rank holds part of a matrix's rows
        assert any(any(r["split"]) for r in results), [r["split"] for r in results]
    for rank, r in enumerate(results):
        if world == 1:  # nothing is split: every optimizer is exact
            assert r[name] == "ok", (name, r[name])
            continue
        msg = r[name]
        assert msg.startswith("RuntimeError: fsdp_compose"), (rank, name, msg)
        assert f"[rank {rank}]" in msg and "parameter '" in msg, msg
        for needle in needles:
            assert needle in msg, (rank, name, msg)


def test_declare_optimizer_rejects_bad_input():
    with pytest.raises(ValueError, match="kind must be one of"):
        fsdp_compose.declare_optimizer(torch.optim.SGD, "rowwise")
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        fsdp_compose.declare_optimizer(nn.Linear, "elementwise")


# --------------------------------------------------------------------------- clip
def _torch_clip(rank, world, max_norm):
    torch.manual_seed(0)
    ref = Net()
    model = shard(copy.deepcopy(ref))
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))  # same on every rank
    for m in (ref, model):
        m(x).square().mean().backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    got = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    # the global norm after clipping, without clipping again
    after = fsdp_compose.clip_grad_norm_(model.parameters(), float("inf"))
    want_after = fsdp_compose.clip_grad_norm_(ref.parameters(), float("inf"))
    # a reference to torch's own function taken before fully_shard: loud
    f = torch.nn.utils.clip_grad.clip_grad_norm_
    early = f.__wrapped__ if getattr(f, "_fsdp_compose_dispatch", False) else f
    try:
        early(model.parameters(), max_norm)
        stale = "no error"
    except RuntimeError as e:
        stale = str(e)
    return float(want), float(got), float(after), float(want_after), stale


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("max_norm", [0.05, 100.0])
def test_torch_clip_grad_norm_is_global(world, max_norm):
    for want, got, after, want_after, stale in run_distributed(_torch_clip, world, max_norm):
        assert got == pytest.approx(want, rel=1e-5)
        assert after == pytest.approx(want_after, rel=1e-5)
        assert after == pytest.approx(min(want, max_norm), rel=1e-4)
        if world == 1:  # every rank holds every element: torch's norm is right
            assert stale == "no error"
        else:
            assert "reference taken before the first fully_shard" in stale, stale
