"""Loss scaling on sharded gradients: every rank must skip the same steps.

``p.grad`` of a sharded parameter is this rank's rows of the averaged
gradient, so an inf/nan in the gradient lands on the rank that holds its row
only. A scaler that looks for non-finite values in the gradients this rank
holds (``torch.amp.GradScaler``) then skips ``optimizer.step()`` and backs off
its scale on that rank alone; torch's
``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` all-reduces
the found-inf flag over the process group, so every rank decides alike.

One step of the run below poisons one element of one gradient (the last
element of ``layers.1.lin2.weight``, through an autograd Function that writes
inf into its gradient): the same element on every rank and in the reference,
a single process stepping the unsharded model with ``torch.amp.GradScaler``
on the global batch. Parameters are fp32, so the comparison is tight (the
scaler's decisions do not depend on the dtype; scales are powers of two).

fsdp_compose makes ``torch.amp.GradScaler`` on sharded parameters an error
on every rank that names ``ShardedGradScaler`` ([Note: loss scaling] in
fsdp_compose/_torch_hooks.py); the "unguarded" run bypasses that guard to
measure the divergence it prevents, with the step check off
(FSDP_COMPOSE_STEP_CHECK=0); with the step check on (the default) the same
run raises a DivergenceError on every rank at the forward after the skipped
step.

Each world size runs ONE multi-process launch doing every scaler; the ranks
return what they measured and the tests assert on it.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from . import _support
from ._dist import run_distributed
from ._support import compare_with_reference, sharded_range, shard

STEPS = 5
INF_STEP = 2
ROWS = 4  # rows of the batch per rank
SCALER = dict(init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
POISONED = "layers.1.lin2.weight"


class _PoisonGrad(torch.autograd.Function):
    """Identity forward; backward writes inf into the last element of the
    gradient (of the full-shape weight, before any reduction)."""

    @staticmethod
    def forward(ctx, w):
        return w.clone()

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g.view(-1)[-1] = float("inf")
        return g


class PoisonableLinear(nn.Linear):
    poison = False  # set on the instance for the step that overflows

    def forward(self, x):
        w = _PoisonGrad.apply(self.weight) if self.poison else self.weight
        return F.linear(x, w, self.bias)


class Net(_support.Net):
    """2 blocks of width 8, hidden 16; ``layers.1.lin2`` can poison its gradient."""

    def __init__(self):
        super().__init__(2, 8, hidden=16)
        old = self.layers[1].lin2
        new = PoisonableLinear(old.in_features, old.out_features)
        with torch.no_grad():
            new.weight.copy_(old.weight)
            new.bias.copy_(old.bias)
        self.layers[1].lin2 = new


def _scaler(kind: str):
    if kind == "sharded":
        return ShardedGradScaler("cpu", **SCALER)
    if kind == "unguarded":  # torch's own unscale_, without fsdp_compose's guard
        base = torch.amp.GradScaler
        unguarded = type("Unguarded", (base,),
                         {"unscale_": getattr(base.unscale_, "__wrapped__", base.unscale_)})
        return unguarded("cpu", **SCALER)
    return torch.amp.GradScaler("cpu", **SCALER)


def _run(rank: int, world: int, kind: str) -> dict:
    """STEPS steps of the sharded model with scaler ``kind`` ("sharded",
    "unguarded" or "plain") and of the reference; per step what this rank
    measured."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler, ref_scaler = _scaler(kind), torch.amp.GradScaler("cpu", **SCALER)
    steps_taken = [0, 0]
    opt.register_step_post_hook(lambda *a: steps_taken.__setitem__(0, steps_taken[0] + 1))
    ref_opt.register_step_post_hook(lambda *a: steps_taken.__setitem__(1, steps_taken[1] + 1))

    poisoned = dict(model.named_parameters())[POISONED]
    a, b = sharded_range(poisoned)
    n = dict(ref.named_parameters())[POISONED].numel()
    out = {"holds_poisoned": a <= n - 1 < b, "steps": []}
    for step in range(STEPS):
        for m in (model, ref):
            m.layers[1].lin2.poison = step == INF_STEP
        g = torch.Generator().manual_seed(step)
        x = torch.randn(world, ROWS, 3, generator=g)
        y = torch.randn(world, ROWS, 1, generator=g)
        scaler.scale((model(x[rank]) - y[rank]).pow(2).mean()).backward()
        ref_scaler.scale((ref(x.reshape(-1, 3)) - y.reshape(-1, 1)).pow(2).mean()).backward()

        scaler.unscale_(opt)
        ref_scaler.unscale_(ref_opt)
        local_inf = any(p.grad is not None and not torch.isfinite(p.grad).all()
                        for p in model.parameters())
        problems = compare_with_reference(model, ref, f"step {step}", params=False)
        before = steps_taken[:]
        scaler.step(opt)
        ref_scaler.step(ref_opt)
        scaler.update()
        ref_scaler.update()
        problems += compare_with_reference(model, ref, f"step {step}", grads=False)
        opt.zero_grad()
        ref_opt.zero_grad()
        out["steps"].append({
            "local_inf": local_inf,
            "stepped": steps_taken[0] > before[0],
            "ref_stepped": steps_taken[1] > before[1],
            "scale": scaler.get_scale(),
            "ref_scale": ref_scaler.get_scale(),
            "problems": problems,
        })
    return out


def _both(rank: int, world: int) -> dict:
    import os

    from fsdp_compose import DivergenceError
    out = {"sharded": _run(rank, world, "sharded")}
    os.environ["FSDP_COMPOSE_STEP_CHECK"] = "0"  # the hazard itself (read at lazy init)
    try:
        out["unguarded"] = _run(rank, world, "unguarded")
    finally:
        del os.environ["FSDP_COMPOSE_STEP_CHECK"]
    try:
        _run(rank, world, "plain")
        out["plain"] = None
    except RuntimeError as e:
        out["plain"] = str(e)
    try:  # last: a DivergenceError stops this process group's models
        _run(rank, world, "unguarded")
        out["checked"] = None
    except DivergenceError as e:
        out["checked"] = str(e)
    return out


@pytest.fixture(scope="module", params=[2, 4])
def measured(request):
    return request.param, run_distributed(_both, request.param)


def _setup_holds(world, results):
    """The rank holding the poisoned element (exactly one does)."""
    holders = [r for r in range(world) if results[r]["sharded"]["holds_poisoned"]]
    assert len(holders) == 1, holders
    return holders[0]


def test_reference_skips_the_inf_step_and_backs_off(measured):
    world, results = measured
    ref = results[0]["sharded"]["steps"]
    assert [s["ref_stepped"] for s in ref] == [i != INF_STEP for i in range(STEPS)]
    # growth_interval 2: grows after steps 0-1, backs off at 2, grows after 3-4
    assert [s["ref_scale"] for s in ref] == [2.0 ** 16, 2.0 ** 17, 2.0 ** 16, 2.0 ** 16, 2.0 ** 17]


def test_sharded_grad_scaler_matches_the_reference_on_every_rank(measured):
    world, results = measured
    holder = _setup_holds(world, results)
    for rank, r in enumerate(results):
        steps = r["sharded"]["steps"]
        # only the holder's shard has the inf, yet every rank skips that step
        assert [s["local_inf"] for s in steps] == \
            [rank == holder and i == INF_STEP for i in range(STEPS)], (rank, steps)
        assert [s["stepped"] for s in steps] == [s["ref_stepped"] for s in steps], (rank, steps)
        assert [s["scale"] for s in steps] == [s["ref_scale"] for s in steps], (rank, steps)
        problems = [p for s in steps for p in s["problems"]]
        assert not problems, (world, rank, problems[:12])


def test_the_step_check_stops_the_unguarded_divergence_on_every_rank(measured):
    """With the step check (the default), the rank that skipped the step
    meets the others at the next forward's check with one optimizer step
    less: every rank raises instead of training on differently."""
    world, results = measured
    for rank, r in enumerate(results):
        assert r["checked"] is not None and "optimizer steps so far" in r["checked"], \
            (rank, r["checked"])


def test_torch_grad_scaler_without_the_guard_diverges_across_ranks(measured):
    """Documents torch's ``torch.amp.GradScaler`` on sharded gradients (the
    hazard the README warns about), not a behaviour of fsdp_compose: the inf
    lands in the rows of the rank that holds them; that rank alone skips the
    step and backs off its scale (as the reference does), the others step
    with their finite rows and keep growing theirs."""
    world, results = measured
    holder = _setup_holds(world, results)
    for rank, r in enumerate(results):
        steps = r["unguarded"]["steps"]
        assert [s["local_inf"] for s in steps] == \
            [rank == holder and i == INF_STEP for i in range(STEPS)], (rank, steps)
        assert [s["stepped"] for s in steps] == \
            [rank != holder or i != INF_STEP for i in range(STEPS)], (rank, steps)
        want = [16, 17, 16, 16, 17] if rank == holder else [16, 17, 17, 18, 18]
        assert [s["scale"] for s in steps] == [2.0 ** e for e in want], (rank, steps)
        # the ranks that stepped leave the reference's parameters at the inf
        # step; the holder's rows follow at the next step (its forward uses
        # the others' rows)
        bad = [i for i, s in enumerate(steps) if any(" param " in p for p in s["problems"])]
        first = INF_STEP + (rank == holder)
        assert bad == list(range(first, STEPS)), (rank, bad)
    scales = [r["unguarded"]["steps"][INF_STEP]["scale"] for r in results]
    assert len(set(scales)) == 2, scales


def test_plain_grad_scaler_on_sharded_parameters_raises_on_every_rank(measured):
    """The guard: every rank raises at the first unscale_ (before any step),
    naming a split parameter and the fix."""
    world, results = measured
    for rank, r in enumerate(results):
        msg = r["plain"]
        assert msg is not None, (rank, "no error")
        for want in (f"[rank {rank}]", "GradScaler on sharded parameters", "split over ranks",
                     "ShardedGradScaler"):
            assert want in msg, (rank, want, msg)
