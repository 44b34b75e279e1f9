"""Units whose forward runs on some ranks only, against DDP(find_unused_parameters=True).

- a mixture-of-experts layer with each expert its own unit, top-1 routing
  restricted by a rule that differs by rank and step (an expert used on one
  rank and not on another in every step; a rank that runs no expert of a
  layer at all; an expert no rank used in the first step), one MoE layer a
  unit itself (its experts nested in it), buckets on and off, a non-reentrant
  and a reentrant checkpoint around the MoE layers, reshard_after_forward
  False, HSDP;
- a data-dependent branch (``if x.sum() > 0``) around a unit called 0, 1 or 2
  times, differing by rank;
- every step: each rank's loss, then every sharded parameter after AdamW,
  against DDP on the same per-rank data; an eval forward under no_grad too;
- a unit order that changes by rank after the order was learned: a clear
  error on that rank before any collective; with
  ``set_forward_order_dynamic(True)`` the same model trains as DDP.

See docs/design.md, "Units skipped on some ranks".
"""
from __future__ import annotations

import copy
import functools
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from fsdp_compose import comm_stats, fully_shard, param_info, reset_comm_stats

from ._dist import DistributedError, run_distributed
from ._pieces import local_piece
from ._support import rows as local_rows

D = 8
E = 4
STEPS = 6
ATOL, RTOL = 1e-5, 1e-5


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class MoE(nn.Module):
    """Top-1 routing: row i goes to expert ``allowed[i % len(allowed)]``, weighted
    by the gate's probability of it among ``allowed`` (none: no expert runs).
    Every allowed expert runs (given enough rows), none other."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E)
        self.experts = nn.ModuleList(Expert() for _ in range(E))

    def forward(self, x, allowed):
        if not allowed:  # no expert here; the router runs on every rank, as in a real MoE
            return x + 0.0 * self.gate(x).sum(dim=-1, keepdim=True)
        mask = torch.full((E,), float("-inf"))
        mask[list(allowed)] = 0.0
        probs = torch.softmax(self.gate(x) + mask, dim=-1)  # (rows, E)
        top = torch.tensor([allowed[i % len(allowed)] for i in range(x.shape[0])])
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (top == e).nonzero().squeeze(1)
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]) * probs[rows, e:e + 1])
        return x + out


class MoENet(nn.Module):
    def __init__(self, ac=None):
        super().__init__()
        self.inp = nn.Linear(3, D)
        self.moe1 = MoE()
        self.moe2 = MoE()
        self.out = nn.Linear(D, 1)
        self.ac = ac

    def forward(self, x, allowed):
        h = self.inp(x)
        for moe in (self.moe1, self.moe2):
            if self.ac is None:
                h = moe(h, allowed)
            else:
                h = checkpoint(moe, h, allowed, use_reentrant=self.ac == "reentrant")
        return self.out(h)


def allowed(rank: int, step: int) -> tuple:
    """The experts this rank may route to: two, shifting with rank and step (so
    an expert one rank uses is unused on another, and expert 3 on no rank of 2
    in step 0), or none (no expert of either MoE layer runs on this rank)."""
    if (rank + step) % 5 == 4:
        return ()
    return ((rank + step) % E, (rank + step + 1) % E)


def batch(step, rank, rows=6):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, 3, generator=g), torch.randn(rows, 1, generator=g)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def param_problems(model, ref, shard_world, tag) -> list[str]:
    out, theirs = [], dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = local_piece(theirs[name], param_info(p).local_range, shard_world)
        mine = local_rows(p).detach()  # this rank's rows
        if not torch.allclose(mine, want, rtol=RTOL, atol=ATOL):
            out.append(f"{tag} {name}: param off by {(mine - want).abs().max():.2e}")
    return out


def train_vs_ddp(rank, world, model, shard, fwd, steps=STEPS, mesh=None, buckets=True,
                 dynamic=False, eval_every_step=True) -> list[str]:
    """``shard(model)`` trained against DDP on the same per-rank batches;
    ``fwd(m, x, rank, step)`` is the forward, with whatever rank- and
    data-dependent control flow."""
    ddp = DDP(copy.deepcopy(model), find_unused_parameters=True)
    ddp.module.ac = None  # (checkpointing changes no value; DDP and reentrant do not mix)
    shard(model)
    if not buckets:
        model.set_all_gather_bucket_bytes(0)
        model.set_reduce_scatter_bucket_bytes(0)
    if dynamic:
        model.set_forward_order_dynamic(True)
    shard_world = mesh.size(mesh.ndim - 1) if mesh is not None else world
    opt, ref_opt = adamw(model.parameters()), adamw(ddp.parameters())
    problems = []
    for step in range(steps):
        x, y = batch(step, rank)
        loss = (fwd(model, x, rank, step) - y).pow(2).mean()
        ref_loss = (fwd(ddp, x, rank, step) - y).pow(2).mean()
        if not torch.allclose(loss, ref_loss, rtol=RTOL, atol=ATOL):
            problems.append(f"step {step} loss {loss.item()} vs DDP {ref_loss.item()}")
        loss.backward()
        ref_loss.backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        problems += param_problems(model, ddp.module, shard_world, f"step {step}")
        if eval_every_step:  # an eval forward, also with units skipped here
            with torch.no_grad():
                ex, _ = batch(step + 100, rank)
                got = fwd(model, ex, rank, step + 1)
                want = fwd(ddp.module, ex, rank, step + 1)
            if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
                problems.append(f"step {step} eval output off by {(got - want).abs().max():.2e}")
    return problems


# ------------------------------------------------------------ mixture of experts
def moe(rank, world, buckets=True, ac=None, raf=None, mesh=None):
    torch.manual_seed(0)
    model = MoENet(ac)
    kw = {"mesh": mesh} if mesh is not None else {}
    if raf is not None:
        kw["reshard_after_forward"] = raf

    def shard(m):
        for layer in (m.moe1, m.moe2):
            for expert in layer.experts:
                fully_shard(expert, **kw)
        fully_shard(m.moe2, **kw)  # a unit holding units: experts nested in it
        fully_shard(m, **kw)

    return train_vs_ddp(rank, world, model, shard,
                        lambda m, x, r, s: m(x, allowed(r, s)), mesh=mesh, buckets=buckets)


# ------------------------------------------------------- data-dependent branch
class Blk(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class BranchNet(nn.Module):
    """``extra`` runs once if the input's sum is positive, twice if its first
    column's sum is positive too (a unit called twice), else not at all."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, D)
        self.body1 = Blk()
        self.extra = Blk()
        self.body2 = Blk()
        self.out = nn.Linear(D, 1)

    def forward(self, x):
        h = self.body1(self.inp(x))
        if x.sum() > 0:
            h = self.extra(h)
            if x[:, 0].sum() > 0:
                h = self.extra(h)
        return self.out(self.body2(h))


def signed_batch_fwd(m, x, rank, step):
    """Flip the batch's signs by rank and step, so the branch differs by rank
    (in step 0: rank 0 calls ``extra`` twice, rank 1 not at all)."""
    s = 1.0 if (rank + step) % 2 == 0 else -1.0
    x = x.abs() * s
    if (rank + step) % 4 == 2:
        x = torch.cat([-x[:, :1], x[:, 1:]], dim=1) * 3
    return m(x)


def branch(rank, world, buckets=True):
    torch.manual_seed(0)
    model = BranchNet()

    def shard(m):
        for blk in (m.body1, m.extra, m.body2):
            fully_shard(blk)
        fully_shard(m)

    return train_vs_ddp(rank, world, model, shard, signed_batch_fwd, buckets=buckets)


# ------------------------------------------------------ an order that changes
class SwapNet(nn.Module):
    """``a`` then ``b``, or ``b`` then ``a`` where ``swap``."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, D)
        self.a = Blk()
        self.b = Blk()
        self.out = nn.Linear(D, 1)

    def forward(self, x, swap):
        h = self.inp(x)
        h = self.a(self.b(h)) if swap else self.b(self.a(h))
        return self.out(h)


def swap_rule(rank, step):
    return step >= 1 and rank % 2 == 1


def _shard_swap(m):
    fully_shard(m.a)
    fully_shard(m.b)
    fully_shard(m)


def swap_dynamic(rank, world, buckets=True):
    torch.manual_seed(0)
    return train_vs_ddp(rank, world, SwapNet(), _shard_swap,
                        lambda m, x, r, s: m(x, swap_rule(r, s)), buckets=buckets, dynamic=True)


def swap_on_every_rank(rank, world):
    """Every rank swaps at step 1: every rank raises the same error, before
    any collective (then the ranks are still in step: a barrier passes)."""
    torch.manual_seed(0)
    model = SwapNet()
    _shard_swap(model)
    x, y = batch(0, rank)
    model(x, False).sum().backward()
    try:
        model(x, True)
    except RuntimeError as e:
        msg = str(e)
        dist.barrier()
        need = ("unit 'a'", f"rank {rank}", "set_forward_order_dynamic(True)", "+a -a +b -b")
        return [f"missing {n!r} in: {msg}" for n in need if n not in msg]
    return ["no error for an order that changed on every rank"]


def swap_on_one_rank(rank, world):
    """Rank 1 swaps at step 1: it raises (the others then fail on its closed
    connections, never hang)."""
    torch.manual_seed(0)
    model = SwapNet()
    _shard_swap(model)
    for step in range(2):
        x, y = batch(step, rank)
        (model(x, swap_rule(rank, step)) - y).pow(2).mean().backward()
    return "trained"


# ------------------------------------------------------------- the harness
def _scenarios(world: int) -> dict:
    out = {}
    for buckets in (False, True):
        tag = "bucketed" if buckets else "per_unit"
        out[f"moe_{tag}"] = functools.partial(moe, buckets=buckets)
        out[f"branch_{tag}"] = functools.partial(branch, buckets=buckets)
        out[f"swap_dynamic_{tag}"] = functools.partial(swap_dynamic, buckets=buckets)
    out["moe_checkpoint"] = functools.partial(moe, buckets=False, ac="non_reentrant")
    out["moe_reentrant"] = functools.partial(moe, buckets=False, ac="reentrant")
    out["moe_keep_after_forward"] = functools.partial(moe, buckets=True, raf=False)
    out["swap_on_every_rank"] = swap_on_every_rank
    if world == 4:
        out["moe_hsdp"] = ("hsdp", functools.partial(moe, buckets=False))
        out["moe_reshard_to_2"] = functools.partial(moe, buckets=False, raf=2)
    return out


def _run_all(rank, world, names):
    results = {}
    scenarios = _scenarios(world)
    for name in names:
        fn = scenarios[name]
        try:
            if isinstance(fn, tuple):  # HSDP: (replicate 2, shard world/2)
                mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
                results[name] = fn[1](rank, world, mesh=mesh)
            else:
                results[name] = fn(rank, world)
        except Exception:  # noqa: BLE001 - reported per scenario
            results[name] = [traceback.format_exc()]
            dist.barrier()  # (a scenario that raised on every rank alike)
    return results


@functools.lru_cache(maxsize=None)
def _results(world: int):
    try:
        return run_distributed(_run_all, world, tuple(_scenarios(world)), timeout=180)
    except DistributedError as e:  # (once: not one launch, and timeout, per test)
        return e


@pytest.mark.parametrize("world,name", [(w, n) for w in (2, 4) for n in _scenarios(w)])
def test_skipped_units(world, name):
    results = _results(world)
    if isinstance(results, DistributedError):
        raise results
    for rank, per_rank in enumerate(results):
        assert per_rank[name] == [], f"rank {rank}: " + "\n".join(per_rank[name][:12])


def test_order_changed_on_one_rank_is_an_error_there():
    with pytest.raises(DistributedError) as info:
        run_distributed(swap_on_one_rank, 2, timeout=60)
    err = info.value
    assert err.rank == 1, err
    assert "set_forward_order_dynamic(True)" in str(err) and "unit 'a'" in str(err), err


def _costs(rank, world):
    """One step's collectives with all experts used on every rank and with
    some skipped on some ranks (the extra all-gathers and zero-filled
    reduce-scatters), and the first step's all-reduces."""
    out = {}
    for name, rule in (("all used", lambda r, s: tuple(range(E))), ("skipped", allowed)):
        torch.manual_seed(0)
        m = MoENet()
        for layer in (m.moe1, m.moe2):
            for expert in layer.experts:
                fully_shard(expert)
        fully_shard(m)
        m.set_all_gather_bucket_bytes(0)
        m.set_reduce_scatter_bucket_bytes(0)
        counts = []
        for step in range(3):
            x, y = batch(step, rank)
            reset_comm_stats()
            (m(x, tuple(range(E)) if step == 0 else rule(rank, step)) - y).pow(2).mean().backward()
            s = comm_stats()
            counts.append((s.all_gather_calls, s.reduce_scatter_calls, s.all_reduce_calls))
        out[name] = counts
    return out


def test_what_skipping_costs():
    """Per step, per unit: the same collectives whether or not a rank runs an
    expert (8 experts + the root, resharded after forward: 9 forward and 8
    backward all-gathers, 9 reduce-scatters); the first step adds one small
    all-reduce per unit forward event, and one for the checkpoint regions."""
    res = run_distributed(_costs, 2, timeout=60)
    for per_rank in res:
        assert per_rank["all used"] == per_rank["skipped"], per_rank
        first, later = per_rank["all used"][0], per_rank["all used"][1:]
        assert first[:2] == later[0][:2] and later[0][2] == 0, per_rank
        assert first[2] == 2 * 9 - 1 + 1, per_rank
