"""No optimizer is silently wrong on sharded parameters, torch's
clip_grad_norm_ gives the global norm, and loss scaling skips the same steps
on every rank (see [Note: optimizers on sharded parameters], [Note:
torch.nn.utils.clip_grad_norm_] and [Note: loss scaling] in _torch_hooks.py).

Each world size runs ONE multi-process launch; the ranks return what every
case did, and the tests assert on it (on every rank: a check that raised on
some ranks only would leave the others in a collective).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

import fsdp_compose
from fsdp_compose import fully_shard
from fsdp_compose._group._row_dtensor import local_of

from . import _support
from ._support import compare_with_reference, rows, shard, sharded_range
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
    before = [rows(p).detach().clone() for p in model.parameters()]  # this rank's rows
    try:
        opt = make()
        loss = model(x).square().mean()
        loss.backward()
        opt.step((lambda: model(x).square().mean()) if closure else None)
        return "ok"
    except Exception as e:  # noqa: BLE001 - the test compares the messages
        unchanged = all(torch.equal(a, rows(p)) for a, p in zip(before, model.parameters()))
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
        out[name] = _try_step(model,
                              lambda: getattr(torch.optim, name)(model.parameters(), lr=1e-3))
    out["InheritsStep"] = _try_step(model, lambda: InheritsStep(model.parameters()))
    fsdp_compose.declare_optimizer(Declared, "elementwise")
    out["Declared"] = _try_step(model, lambda: Declared(model.parameters(), lr=1e-3))
    # (the 32x32 weight of the second Linear must be split at world size > 1)
    one = _one_matrix()
    out["split"] = [0 < rows(p).shape[0] < fsdp_compose.param_info(p).shape[0]
                    for p in one.parameters()]
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


@pytest.mark.fast
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


# ------------------------------------------------------------------ loss scaling
# ``p.grad`` of a sharded parameter holds this rank's rows of the averaged
# gradient (a RowParam's local tensor), so an inf in the gradient lands on the
# rank that holds its row only. torch's ShardedGradScaler all-reduces its found-inf flag: every rank
# skips the same steps, as the reference (one process, the unsharded model,
# torch.amp.GradScaler on the global batch) does. fsdp_compose makes
# torch.amp.GradScaler on sharded parameters an error on every rank that
# names ShardedGradScaler ([Note: loss scaling] in _torch_hooks.py). Without
# that guard, GradScaler's check on RowParam gradients runs through DTensor,
# which max-reduces the found-inf flag over the mesh: no rank skips alone.
# One step poisons one element of one gradient (the last element of
# ``layers.1.lin2.weight``, through an autograd Function that writes inf into
# its gradient), the same in every rank and in the reference. Parameters are
# fp32 (the scaler's decisions do not depend on the dtype; scales are powers
# of two).
SCALER_STEPS = 5
INF_STEP = 2
SCALER_ROWS = 4  # rows of the batch per rank
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


class PoisonNet(Net):
    """``Net``, whose ``layers.1.lin2`` can poison its gradient."""

    def __init__(self):
        super().__init__()
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


def _scaled_run(rank: int, world: int, kind: str, mesh=None) -> dict:
    """SCALER_STEPS steps of the sharded model with scaler ``kind``
    ("sharded", "unguarded" or "plain") and of the reference; per step what
    this rank measured. ``mesh``: e.g. HSDP's (2, 2)."""
    torch.manual_seed(0)
    model = PoisonNet()
    ref = copy.deepcopy(model)
    shard(model, **({} if mesh is None else {"mesh": mesh}))
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
    for step in range(SCALER_STEPS):
        for m in (model, ref):
            m.layers[1].lin2.poison = step == INF_STEP
        g = torch.Generator().manual_seed(step)
        x = torch.randn(world, SCALER_ROWS, 3, generator=g)
        y = torch.randn(world, SCALER_ROWS, 1, generator=g)
        scaler.scale((model(x[rank]) - y[rank]).pow(2).mean()).backward()
        ref_scaler.scale((ref(x.reshape(-1, 3)) - y.reshape(-1, 1)).pow(2).mean()).backward()

        scaler.unscale_(opt)
        ref_scaler.unscale_(ref_opt)
        local_inf = any(p.grad is not None and not torch.isfinite(rows(p.grad)).all()
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


class _ScalarNet(nn.Module):
    """A 0-d parameter alone (the one kind of sharded parameter that stays a
    plain row piece; beside a RowParam of its dtype, DTensor's check would
    reduce its flag too, and the guard lets it through)."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return x * self.s


def _scalers(rank: int, world: int) -> dict:
    from fsdp_compose import DivergenceError
    out = {"sharded": _scaled_run(rank, world, "sharded")}
    out["plain"] = _scaled_run(rank, world, "plain")
    if world == 4:
        from torch.distributed.device_mesh import init_device_mesh
        # HSDP (2 replicas x 2 shards): gradients are RowParams placed
        # (Replicate(), RowShard): torch's check reduces over the whole mesh
        out["hsdp"] = _scaled_run(rank, world, "plain", mesh=init_device_mesh("cpu", (2, 2)))
        # tensor parallel inside units (dp 2 x tp 2): gradients are RowParams
        # over the (dp, tp) mesh; an inf in one rank's rows of a TP weight
        from ._tp_net import IN, T, Net, parallelize
        torch.manual_seed(0)
        model = Net()
        parallelize(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = _scaler("plain")
        scaler.scale(model(torch.randn(2, T, IN)).pow(2).mean()).backward()
        w = model.layers[0].attn.q.weight  # (a column-wise weight: RowShard within TP blocks)
        if rank == 0:
            local_of(w.grad).view(-1)[0] = float("inf")
        before = [local_of(p).clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        out["tp"] = {"is_dtensor": isinstance(w.grad, DTensor), "placements": str(w.placements),
                     "stepped": any(not torch.equal(b, local_of(p))
                                    for b, p in zip(before, model.parameters())),
                     "scale": scaler.get_scale()}
    # plain row pieces are left only for 0-d parameters: the guard raises
    torch.manual_seed(0)
    model = _ScalarNet()
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = _scaler("plain")
    scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
    try:
        scaler.unscale_(opt)
        out["plain_pieces"] = None
    except RuntimeError as e:
        out["plain_pieces"] = str(e)
    try:  # last: a DivergenceError stops this process group's models
        out["unguarded"] = _scaled_run(rank, world, "unguarded")
        out["checked"] = None
    except DivergenceError as e:
        out["unguarded"] = None
        out["checked"] = str(e)
    return out


@pytest.fixture(scope="module", params=[2, 4])
def scaled(request):
    return request.param, run_distributed(_scalers, request.param)


def test_sharded_grad_scaler_matches_the_reference_on_every_rank(scaled):
    world, results = scaled
    # the reference skips the inf step and backs off (growth_interval 2: grows
    # after steps 0-1, backs off at 2, grows after 3-4): what every rank must do
    ref = results[0]["sharded"]["steps"]
    assert [s["ref_stepped"] for s in ref] == [i != INF_STEP for i in range(SCALER_STEPS)]
    assert [s["ref_scale"] for s in ref] == [2.0 ** 16, 2.0 ** 17, 2.0 ** 16, 2.0 ** 16, 2.0 ** 17]
    holders = [r for r in range(world) if results[r]["sharded"]["holds_poisoned"]]
    assert len(holders) == 1, holders  # the rank holding the poisoned element
    for rank, r in enumerate(results):
        steps = r["sharded"]["steps"]
        # only the holder's shard has the inf, yet every rank skips that step
        assert [s["local_inf"] for s in steps] == \
            [rank == holders[0] and i == INF_STEP for i in range(SCALER_STEPS)], (rank, steps)
        assert [s["stepped"] for s in steps] == [s["ref_stepped"] for s in steps], (rank, steps)
        assert [s["scale"] for s in steps] == [s["ref_scale"] for s in steps], (rank, steps)
        problems = [p for s in steps for p in s["problems"]]
        assert not problems, (world, rank, problems[:12])


def test_unguarded_grad_scaler_skips_the_same_steps_on_every_rank(scaled):
    """torch.amp.GradScaler without the guard. ``p.grad`` of a split
    parameter is a RowParam DTensor, and DTensor runs GradScaler's inf/nan
    check with a max-reduction of ``found_inf`` over the mesh (as under
    FSDP2): every rank skips the inf step and backs off, as the reference, so
    the step check has no divergence to stop (it did while ``p.grad`` was
    plain rows: the holder alone skipped; the step check itself is tested in
    test_divergence)."""
    world, results = scaled
    holders = [r for r in range(world) if results[r]["sharded"]["holds_poisoned"]]
    assert len(holders) == 1, holders
    for rank, r in enumerate(results):
        assert r["checked"] is None, (rank, r["checked"])
        steps = r["unguarded"]["steps"]
        assert [s["local_inf"] for s in steps] == \
            [rank == holders[0] and i == INF_STEP for i in range(SCALER_STEPS)], (rank, steps)
        assert [s["stepped"] for s in steps] == [s["ref_stepped"] for s in steps] \
            == [i != INF_STEP for i in range(SCALER_STEPS)], (rank, steps)
        assert [s["scale"] for s in steps] == [s["ref_scale"] for s in steps], (rank, steps)
        problems = [p for s in steps for p in s["problems"]]
        assert not problems, (world, rank, problems[:12])


def _assert_steps_as_the_reference(rank: int, steps: list) -> None:
    """Every step of this rank as the reference's: the inf step skipped, the
    same scales, and parameters and gradients alike."""
    assert [s["stepped"] for s in steps] == [s["ref_stepped"] for s in steps] \
        == [i != INF_STEP for i in range(SCALER_STEPS)], (rank, steps)
    assert [s["scale"] for s in steps] == [s["ref_scale"] for s in steps], (rank, steps)
    assert not [p for s in steps for p in s["problems"]], rank


def test_plain_grad_scaler_on_dtensor_gradients_skips_the_same_steps(scaled):
    """torch.amp.GradScaler with fsdp_compose's guard installed: the guard lets
    RowParam gradients through (DTensor reduces the found-inf flag, see the
    test above), and every rank matches the reference."""
    world, results = scaled
    for rank, r in enumerate(results):
        _assert_steps_as_the_reference(rank, r["plain"]["steps"])


def test_plain_grad_scaler_on_hsdp_skips_the_same_steps(scaled):
    """HSDP's gradients are RowParams too: torch's GradScaler matches the
    reference on every rank (the guard raised while they were plain pieces)."""
    world, results = scaled
    if world != 4:
        pytest.skip("HSDP needs 4 ranks")
    for rank, r in enumerate(results):
        _assert_steps_as_the_reference(rank, r["hsdp"]["steps"])


def test_plain_grad_scaler_on_tp_gradients_skips_on_every_rank(scaled):
    """Tensor parallel inside units (dp 2 x tp 2): gradients are RowParams on
    the (dp, tp) mesh, so torch's GradScaler reduces found-inf over both
    dims: an inf in rank 0's rows alone makes every rank skip and back off."""
    world, results = scaled
    if world != 4:
        pytest.skip("dp x tp needs 4 ranks")
    for rank, r in enumerate(results):
        tp = r["tp"]
        assert tp["is_dtensor"] and "within 2 TP blocks" in tp["placements"], (rank, tp)
        assert not tp["stepped"] and tp["scale"] == SCALER["init_scale"] * 0.5, (rank, tp)


def test_plain_grad_scaler_on_plain_pieces_raises_on_every_rank(scaled):
    """The guard, where gradients are still plain row pieces (a 0-d
    parameter): every rank raises at the first unscale_, naming a split
    parameter and the fix."""
    world, results = scaled
    for rank, r in enumerate(results):
        msg = r["plain_pieces"]
        assert msg is not None, (rank, "no error")
        for want in (f"[rank {rank}]", "GradScaler on sharded parameters", "split over ranks",
                     "ShardedGradScaler"):
            assert want in msg, (rank, want, msg)
