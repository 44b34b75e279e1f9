"""Where a rank holds no rows of a parameter: ``p.grad`` and the optimizer, against DDP.

With the row layout a small parameter (a bias, a norm weight, a 0-d
temperature) sits wholly on one rank; with ``shard_granularity="tensor"``
every parameter does. Under DDP every rank sees the same pattern of
``p.grad is None``: set wherever any rank produced a gradient for the
parameter, None where none did. So must we: on a rank that holds none of
the parameter, ``p.grad`` is an empty gradient of its piece's shape
``(0, *shape[1:])`` (docs/design.md, "Row-granular shards").

Every scenario trains the sharded model next to
``DistributedDataParallel(find_unused_parameters=True)`` over a copy, each
rank on its own batch, and records per step, per parameter, whether
``p.grad`` is None, after backward and again after ``optimizer.step()``. The
model has parameters

- used on every rank (``a``, ``out``, the 0-d ``temp``), one of them frozen
  in some scenarios;
- unused on every rank (``a.l2``: part of a unit that runs; ``c``: a unit
  that never runs; ``d``: a unit whose output is dropped);
- used on some ranks only (``b``: rank 0 only, on even steps only).

The tests assert that the patterns are the same on every rank and equal
DDP's, that at least one parameter of each kind has an empty piece on some
rank (so the check can fail), that an empty gradient is not a view that
keeps a gradient shard alive, and that the gradients, the parameters after
each step and the optimizer state (element-wise optimizers: created for an
empty piece too, empty, with the same ``step``) are DDP's. Optimizers:
AdamW, SGD with momentum with ``zero_grad(set_to_none=False)`` and
``clip_grad_norm_``, every other element-wise ``torch.optim`` optimizer,
gradient accumulation (``set_requires_gradient_sync``), frozen parameters,
``ShardedGradScaler``, a container of optimizers (torchtitan's
``OptimizersContainer``), and the tensor layout (most ranks hold 0 rows of each
parameter) with AdamW, Muon + AdamW and Adafactor (these two do not see the
empty gradients: [Note: optimizers on sharded parameters]).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_compose import fully_shard, param_info

from ._pieces import local_piece
from ._support import (OptimizerContainer, Scenarios, _value_problem, compare_with_reference,
                       rows)

D = 6
STEPS = 4


class Blk(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.l2 = nn.Linear(D, D)

    def forward(self, x, use_l2=True):
        h = self.norm(torch.tanh(self.l1(x)))
        return x + (self.l2(h) if use_l2 else h)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, D)
        self.a, self.b, self.c, self.d = Blk(), Blk(), Blk(), Blk()
        self.out = nn.Linear(D, 1)
        self.temp = nn.Parameter(torch.tensor(0.7))

    def forward(self, x, rank, step, use_b=True):
        h = self.a(self.inp(x), use_l2=False)
        if use_b and rank == 0 and step % 2 == 0:
            h = self.b(h)
        self.d(h)  # output dropped
        return self.out(h) * self.temp


# the parameters of each kind (by name prefix)
KINDS = {"used": ("inp.", "a.l1.", "a.norm.", "out.", "temp"),
         "unused": ("a.l2.", "c.", "d."),
         "partly used": ("b.",)}


def kind_of(name: str) -> str:
    return next(k for k, prefixes in KINDS.items() if name.startswith(prefixes))


def batch(step, rank, micro=0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)


def build(granularity="row", freeze=()):
    torch.manual_seed(0)
    model = Net()
    for name, p in model.named_parameters():
        if name in freeze:
            p.requires_grad_(False)
    ddp = DDP(copy.deepcopy(model), find_unused_parameters=True)
    for unit in (model.a, model.b, model.c, model.d):
        fully_shard(unit, shard_granularity=granularity)
    fully_shard(model, shard_granularity=granularity)
    return model, ddp


def none_pattern(model) -> tuple:
    return tuple(p.grad is None for p in model.parameters())


def empty_pieces(model) -> list[str]:
    """Names of the parameters this rank holds none of (another rank does)."""
    return [n for n, p in model.named_parameters()
            if rows(p).numel() == 0 and param_info(p).shape.numel() > 0]


def state_problems(opt, ref_opt, model, ref, tag) -> list[str]:
    """``opt``'s state of each parameter against ``ref_opt``'s: the same keys;
    per-element tensors (our side: the piece's shape, as ``p``) the matching
    piece (empty where this rank holds none of it); the rest (``step``...)
    equal."""
    out = []
    theirs = dict(ref.named_parameters())
    mine = {p for g in opt.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        if p not in mine:
            continue
        r = theirs[name]
        s, rs = opt.state.get(p, {}), ref_opt.state.get(r, {})
        if list(s) != list(rs):
            out.append(f"{tag} {name} ({tuple(p.shape)}): optimizer state keys {list(s)}, "
                       f"DDP {list(rs)}")
            continue
        for k, rv in rs.items():
            v = s[k]
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape == p.shape:
                msg = _value_problem(v, local_piece(rv, param_info(p).local_range), 1e-5, 1e-6)
            elif isinstance(rv, torch.Tensor):
                msg = _value_problem(v, rv, 1e-5, 1e-6)
            else:
                msg = None if v == rv else f"{v!r}, DDP {rv!r}"
            if msg:
                out.append(f"{tag} {name} state {k!r}: {msg}")
    return out


def train(rank, world, make_opts, *, granularity="row", set_to_none=True, max_norm=None,
          micros=1, freeze=(), scaler=False, check_state=True, steps=STEPS):
    """``make_opts(params)``: a list of optimizers. Returns (patterns, DDP's
    patterns, problems, empty pieces): a pattern per step after backward and
    after the step, and one after the last ``zero_grad``."""
    model, ddp = build(granularity, freeze)
    opts, ref_opts = make_opts(list(model.parameters())), make_opts(list(ddp.module.parameters()))
    if scaler:
        kw = dict(init_scale=2.0 ** 8, growth_interval=2)
        sc, ref_sc = ShardedGradScaler(device="cpu", **kw), torch.amp.GradScaler("cpu", **kw)
    patterns, ref_patterns, problems = [], [], []
    for step in range(steps):
        tag = f"step {step}"
        for micro in range(micros):
            last = micro == micros - 1
            model.set_requires_gradient_sync(last)
            x, y = batch(step, rank, micro)
            for m in (model, ddp):
                def fwd():
                    loss = (m(x, rank, step + micro) - y).pow(2).mean()
                    if scaler:
                        loss = (sc if m is model else ref_sc).scale(loss)
                    loss.backward()
                if m is ddp and not last:
                    with ddp.no_sync():
                        fwd()
                else:
                    fwd()
        patterns.append(none_pattern(model))
        ref_patterns.append(none_pattern(ddp.module))
        if scaler:
            for s, os in ((sc, opts), (ref_sc, ref_opts)):
                for o in os:
                    s.unscale_(o)
        problems += compare_with_reference(model, ddp.module, tag, params=False)
        problems += [f"{tag} {n}: its empty gradient keeps "
                     f"{rows(p.grad).untyped_storage().nbytes()} bytes alive"
                     for n, p in model.named_parameters()
                     if p.grad is not None and rows(p).numel() == 0
                     and rows(p.grad).untyped_storage().nbytes() > 0]
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # routed to ours
            ref_norm = torch.nn.utils.clip_grad_norm_(ddp.module.parameters(), max_norm)
            if not torch.allclose(norm, ref_norm, rtol=1e-5):
                problems.append(f"{tag} clip norm {norm.item()} vs DDP {ref_norm.item()}")
        for s, os in ((sc, opts), (ref_sc, ref_opts)) if scaler else ((None, opts),
                                                                        (None, ref_opts)):
            for o in os:
                s.step(o) if s is not None else o.step()
            if s is not None:
                s.update()
        if scaler and sc.get_scale() != ref_sc.get_scale():
            problems.append(f"{tag} scale {sc.get_scale()}, DDP {ref_sc.get_scale()}")
        patterns.append(none_pattern(model))
        ref_patterns.append(none_pattern(ddp.module))
        problems += compare_with_reference(model, ddp.module, tag + " (after the step)")
        if check_state:
            for o, ro in zip(opts, ref_opts):
                for i, ri in (zip(o.optimizers, ro.optimizers) if isinstance(o, OptimizerContainer)
                              else [(o, ro)]):
                    problems += state_problems(i, ri, model, ddp.module, tag)
        for o in opts + ref_opts:
            o.zero_grad(set_to_none=set_to_none)
    patterns.append(none_pattern(model))
    ref_patterns.append(none_pattern(ddp.module))
    return patterns, ref_patterns, problems, empty_pieces(model)


def adamw(params):
    # weight decay and momentum: a zero gradient would move a parameter, None does not
    return [torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)]


def sgd(params):
    return [torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.1)]


def muon_adamw(params):
    return [torch.optim.Muon([p for p in params if p.ndim == 2], lr=0.02),
            *adamw([p for p in params if p.ndim != 2])]


def adafactor(params):
    return [torch.optim.Adafactor(params, lr=0.05)]


def container(params):
    """AdamW over the 2-D weights and SGD over the rest, in a container; the
    state is compared through the optimizers it holds."""
    inner = [*adamw([p for p in params if p.ndim == 2]),
             *sgd([p for p in params if p.ndim != 2])]
    return [OptimizerContainer(params, inner)]


ELEMENTWISE = ("Adam", "Adagrad", "Adadelta", "RMSprop", "NAdam", "RAdam", "Adamax", "Rprop",
               "ASGD")


def every_elementwise(rank, world):
    """Two steps of each; the patterns of all, in turn."""
    out = ([], [], [], [])
    for name in ELEMENTWISE:
        pats, ref_pats, problems, empty = train(
            rank, world, lambda ps: [getattr(torch.optim, name)(ps, lr=0.05)], steps=2)
        out[0].extend(pats)
        out[1].extend(ref_pats)
        out[2].extend(f"{name}: {p}" for p in problems)
        out[3][:] = empty
    return out


SCENARIOS = {
    "adamw": lambda r, w: train(r, w, adamw),
    "sgd_momentum_keep_clip": lambda r, w: train(r, w, sgd, set_to_none=False, max_norm=0.05),
    "every_elementwise": every_elementwise,
    "accumulation": lambda r, w: train(r, w, adamw, micros=2),
    "accumulation_keep": lambda r, w: train(r, w, sgd, micros=2, set_to_none=False),
    "frozen": lambda r, w: train(r, w, adamw, freeze=("a.norm.weight", "b.l1.bias",
                                                       "out.bias", "temp")),
    "sharded_grad_scaler": lambda r, w: train(r, w, adamw, scaler=True),
    "optimizer_container": lambda r, w: train(r, w, container),
    "tensor_adamw": lambda r, w: train(r, w, adamw, granularity="tensor"),
    "tensor_sgd_keep_clip": lambda r, w: train(r, w, sgd, granularity="tensor",
                                               set_to_none=False, max_norm=0.05),
    # whole-tensor optimizers keep no state where a rank holds none of a parameter
    "tensor_muon_adamw": lambda r, w: train(r, w, muon_adamw, granularity="tensor",
                                            check_state=False),
    "tensor_adafactor": lambda r, w: train(r, w, adafactor, granularity="tensor",
                                           check_state=False),
}


def _run_one(name, rank, world):
    return SCENARIOS[name](rank, world)


_LAUNCHES = Scenarios(_run_one, timeout=300)


@pytest.mark.parametrize("world,name", [(w, n) for w in (2, 4) for n in SCENARIOS])
def test_grad_none_pattern_is_ddps_on_every_rank(world, name):
    per_rank = _LAUNCHES.results(world, name, list(SCENARIOS))
    names = [n for n, _ in Net().named_parameters()]
    lines = []
    for rank, (patterns, ref_patterns, problems, _) in enumerate(per_rank):
        lines += [f"rank {rank}: {p}" for p in problems[:12]]
        if len(patterns) != len(ref_patterns):
            lines.append(f"rank {rank}: {len(patterns)} patterns, DDP {len(ref_patterns)}")
        for i, (got, want) in enumerate(zip(patterns, ref_patterns)):
            if got != want:
                diff = [f"{n}: {'None' if g else 'set'} (DDP {'None' if w else 'set'})"
                        for n, g, w in zip(names, got, want) if g != w]
                lines.append(f"rank {rank}, pattern {i} (2 per step): {diff}")
                break
        if patterns != per_rank[0][0]:
            lines.append(f"rank {rank}'s None pattern differs from rank 0's")
    assert not lines, f"{name!r}, world size {world}:\n" + "\n".join(lines)
    # the check can fail: some rank holds none of a parameter of every kind
    empty = {n for _, _, _, e in per_rank for n in e}
    for kind in KINDS:
        assert any(kind_of(n) == kind for n in empty), (kind, sorted(empty))
