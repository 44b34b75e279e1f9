"""Numerical parity of ``fully_shard`` training with a single-process reference.

Every scenario follows the same recipe, on every rank:

* seed, build the model, ``copy.deepcopy`` it into a *reference* before
  sharding, then ``fully_shard`` the original (sub-units first, root last);
* optimizers for both (ours built after sharding, over the flat views);
* per step a global batch (seeded, identical on all ranks): each rank runs its
  own contiguous slice through the sharded model, the reference runs the whole
  global batch (or, for rank-dependent losses, every rank's slice with that
  rank's loss, averaged over ranks) in one process;
* checks, every step: each rank's local loss against the reference's loss on
  that slice, the all-reduced mean loss against the reference loss, every
  sharded gradient and (after the optimizer step) every sharded parameter
  against the same ``param_info(p).local_range`` slice of the flattened
  reference, plus optional ``clip_grad_norm_`` and eval (``no_grad``) checks.

All scenarios of one world size run in one launch of ``world_size`` processes
(starting processes is the expensive part on small machines); each scenario
gets a fresh model.  A failing scenario stops its launch, and the scenarios
after it are re-run in a new launch, so every test reports its own result.

Self-check without the core library: ``FSDP_PARITY_MOCK=1`` replaces
``fully_shard`` by plain data parallelism (full parameters, gradients
all-reduced and averaged); every scenario must pass that way too, which
validates the references, the batch slicing and the comparisons themselves.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ._dist import DistributedError, run_distributed
from ._pieces import expected_shape
from ._support import Scenarios, compare_with_reference, rows, two_lanes_forced

WORLD_SIZES = (1, 2, 4)
GLOBAL_BATCH = 8  # divisible by every world size
STEPS = 6
ATOL = 1e-5
RTOL = 1e-5
MOCK = os.environ.get("FSDP_PARITY_MOCK") == "1"


# --------------------------------------------------------------------------
# The implementation under test (or the data-parallel mock)
# --------------------------------------------------------------------------


class _Real:
    """fsdp_compose, imported lazily so the harness tests run without it."""

    flat = True

    def __init__(self):
        import fsdp_compose

        self.fc = fsdp_compose

    def fully_shard(self, m, **kw):
        return self.fc.fully_shard(m, **kw)

    def prepare(self, model):
        pass

    def info(self, p) -> Tuple[str, Tuple[int, ...], Tuple[int, int]]:
        i = self.fc.param_info(p)
        return i.fqn, tuple(i.shape), (int(i.local_range[0]), int(i.local_range[1]))

    def after_backward(self, model, ws):
        pass

    def clip(self, params, max_norm, norm_type):
        return self.fc.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def is_fsdp(self, m, cls) -> Optional[str]:
        if not isinstance(m, self.fc.FSDPModule):
            return f"{type(m).__name__} is not an FSDPModule after fully_shard"
        if not isinstance(m, cls):
            return f"{type(m).__name__} is no longer a {cls.__name__} after fully_shard"
        return None


class _Mock:
    """Plain data parallelism with the same interface: full params, averaged grads."""

    flat = False

    def fully_shard(self, m, **kw):
        return m

    def prepare(self, model):
        self.names = {id(p): n for n, p in model.named_parameters()}

    def info(self, p):
        return self.names[id(p)], tuple(p.shape), (0, p.numel())

    def after_backward(self, model, ws):
        for p in model.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad /= ws

    def clip(self, params, max_norm, norm_type):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def is_fsdp(self, m, cls):
        return None


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


class Inner(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Block(nn.Module):
    """A unit with a sub-unit (``inner``) and params of its own."""

    def __init__(self, d, h):
        super().__init__()
        self.inner = Inner(d)
        self.lin1 = nn.Linear(d, h)
        self.lin2 = nn.Linear(h, d)

    def forward(self, x):
        return x + self.lin2(torch.relu(self.lin1(self.inner(x))))


class MLP(nn.Module):
    def __init__(self, din=8, d=16, h=32, dout=4, nblocks=3):
        super().__init__()
        self.inp = nn.Linear(din, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(nblocks))
        self.out = nn.Linear(d, dout)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def shard_mlp(rafs):
    def shard(m, impl):
        for b in m.blocks:
            impl.fully_shard(b.inner, reshard_after_forward=rafs)
            impl.fully_shard(b, reshard_after_forward=rafs)
        impl.fully_shard(m, reshard_after_forward=rafs)
        return [(m, MLP)] + [(b, Block) for b in m.blocks] + [(b.inner, Inner) for b in m.blocks]

    return shard


class Scalar(nn.Module):
    """A unit holding one tiny parameter: ``x * p`` or ``x + p``."""

    def __init__(self, n, mul):
        super().__init__()
        self.p = nn.Parameter(torch.randn(n))
        self.mul = mul

    def forward(self, x):
        return x * self.p if self.mul else x + self.p


class Uneven(nn.Module):
    """Odd sizes everywhere; ``s1`` (1 element) and ``v3`` (3 elements) are
    alone in their units, so at world size 2 resp. 4 some rank holds none of
    them."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 13)
        self.s1 = Scalar(1, mul=True)
        self.b = nn.Linear(13, 5)
        self.c = nn.Linear(5, 3)
        self.v3 = Scalar(3, mul=False)

    def forward(self, x):
        h = self.s1(torch.tanh(self.a(x)))
        h = torch.tanh(self.b(h))
        return self.v3(self.c(h))


def shard_uneven(m, impl):
    for sub in (m.a, m.s1, m.b, m.v3):
        impl.fully_shard(sub)
    impl.fully_shard(m)  # root owns c
    return [(m, Uneven), (m.a, nn.Linear), (m.s1, Scalar)]


class HalfFrozen(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.frozen = nn.Linear(d, d)
        self.train_lin = nn.Linear(d, d)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return torch.tanh(self.train_lin(torch.relu(self.frozen(x))))


class FrozenNet(nn.Module):
    """``stem`` is a fully frozen first unit (its output needs no grad),
    ``mid_frozen`` a fully frozen unit that gradients flow *through*,
    ``halfblk`` a unit with one frozen and one trainable Linear."""

    def __init__(self, din=6, d=12, dout=3):
        super().__init__()
        self.stem = nn.Linear(din, d)
        self.mid = nn.Linear(d, d)
        self.mid_frozen = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        self.halfblk = HalfFrozen(d)
        self.head = nn.Linear(d, dout)
        self.stem.requires_grad_(False)
        self.mid_frozen.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        h = torch.tanh(self.mid(h))
        h = self.mid_frozen(h)
        h = self.halfblk(h)
        return self.head(h)


def shard_frozen(m, impl):
    impl.fully_shard(m.stem)
    impl.fully_shard(m.mid_frozen)
    impl.fully_shard(m.halfblk)
    impl.fully_shard(m)
    return [(m, FrozenNet), (m.halfblk, HalfFrozen)]


class MixedUnit(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.f64 = nn.Linear(d, d).double()
        self.f32 = nn.Linear(d, d)

    def forward(self, x):
        h = torch.tanh(self.f64(x.double())).float()
        return torch.tanh(self.f32(h))


class MixedNet(nn.Module):
    def __init__(self, din=6, d=8, dout=2):
        super().__init__()
        self.inp = nn.Linear(din, d)
        self.mixed = MixedUnit(d)
        self.out = nn.Linear(d, dout)
        self.scale64 = nn.Parameter(torch.randn(dout, dtype=torch.float64))  # root: mixed too

    def forward(self, x):
        h = self.mixed(self.inp(x))
        return (self.out(h).double() * self.scale64).float()


def shard_mixed(m, impl):
    impl.fully_shard(m.mixed)
    impl.fully_shard(m)
    return [(m, MixedNet), (m.mixed, MixedUnit)]


class TiedLM(nn.Module):
    def __init__(self, vocab=11, d=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tok):
        h = self.embed(tok)
        h = h + self.body(h)
        return self.head(h)


def shard_tied(m, impl):
    impl.fully_shard(m.body)
    impl.fully_shard([m.embed, m.head])
    impl.fully_shard(m)
    return [(m, TiedLM), (m.embed, nn.Embedding), (m.head, nn.Linear)]


class _WithKw:
    """An implementation whose fully_shard always gets ``kw`` too."""

    def __init__(self, impl, **kw):
        self._impl, self._kw = impl, kw

    def fully_shard(self, m, **kw):
        return self._impl.fully_shard(m, **self._kw, **kw)


def tensor_layout(shard):
    """``shard`` with every unit at ``shard_granularity="tensor"`` (each
    parameter whole on one rank; the other ranks hold an empty piece)."""
    def f(m, impl):
        return shard(m, _WithKw(impl, shard_granularity="tensor") if impl.flat else impl)

    return f


def uneven_pieces(shard):
    """``shard`` with every row layout forced to uneven pieces (what a big
    group gets over hundreds of ranks, docs/design.md "Row-granular shards at
    scale": boundaries at the rows nearest the even share; on gloo its
    in-place collectives, never bucketed) at these small world sizes."""
    def f(m, impl):
        if not impl.flat:
            return shard(m, impl)
        from fsdp_compose._plan import _layout
        _layout.FORCE_EVEN = False
        try:
            out = shard(m, impl)
        finally:
            _layout.FORCE_EVEN = None
        if dist.get_world_size() > 1:  # (the scenario would not test what it says)
            from fsdp_compose._base._registry import unit_of
            units = {id(u): u for u in map(unit_of, m.modules()) if u is not None}
            assert not all(g.layout.even for u in units.values() for g in u.groups)
        return out

    return f


def padded_pieces(shard):
    """``uneven_pieces``, with the collectives every backend but gloo runs:
    one equal-size all-gather / reduce-scatter per bucket, every piece
    padded to its group's largest through a staging buffer ([Note: padded
    collectives] in fsdp_compose/_comm/_collectives.py), here on gloo with real
    data (the groups are built while ``PAD_UNEVEN_ON_GLOO`` is set)."""
    def f(m, impl):
        if not impl.flat:
            return shard(m, impl)
        from fsdp_compose._comm import _collectives
        _collectives.PAD_UNEVEN_ON_GLOO = True
        try:
            out = uneven_pieces(shard)(m, impl)
        finally:
            _collectives.PAD_UNEVEN_ON_GLOO = False
        if dist.get_world_size() > 1:
            from fsdp_compose._base._registry import unit_of
            units = {id(u): u for u in map(unit_of, m.modules()) if u is not None}
            assert any(g.padded() for u in units.values() for g in u.groups)
        return out

    return f


def two_lanes(shard):
    """``uneven_pieces`` in two lanes wherever they are better at all
    ([Note: lanes] in fsdp_compose/_plan/_layout.py: what a group whose rows
    are coarse against the share gets over thousands of ranks): every rank's
    shard is a piece of each lane, two ranges of the flat, so the padded
    collectives run (on gloo too), with real data."""
    def f(m, impl):
        if not impl.flat:
            return shard(m, impl)
        with two_lanes_forced():
            out = uneven_pieces(shard)(m, impl)
        if dist.get_world_size() > 1:
            from fsdp_compose._base._registry import unit_of
            units = {id(u): u for u in map(unit_of, m.modules()) if u is not None}
            groups = [g for u in units.values() for g in u.groups]
            assert any(g.layout.lanes for g in groups)
            assert all(g.padded() for g in groups if g.layout.lanes)
        return out

    return f


class Twice(nn.Module):
    def __init__(self, din=6, d=16, dout=3):
        super().__init__()
        self.inp = nn.Linear(din, d)
        self.shared = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        self.out = nn.Linear(d, dout)

    def forward(self, x):
        h = self.inp(x)
        h = self.shared(h)
        h = self.shared(h * 0.5 + 1.0)
        return self.out(h)


def shard_twice(rafs):
    def shard(m, impl):
        impl.fully_shard(m.shared, reshard_after_forward=rafs)
        impl.fully_shard(m, reshard_after_forward=rafs)
        return [(m, Twice), (m.shared, nn.Sequential)]

    return shard


class SideNet(nn.Module):
    """``side`` runs on every rank; its output reaches the loss only when
    ``use_side`` (rank 0)."""

    def __init__(self, din=6, d=16, dout=3):
        super().__init__()
        self.trunk = nn.Linear(din, d)
        self.side = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        self.head = nn.Linear(d, dout)

    def forward(self, x, use_side=True):
        h = torch.tanh(self.trunk(x))
        s = self.side(h)
        if use_side:
            h = h + s
        return self.head(h)


class Gate(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.use = True

    def forward(self, x):
        if self.use:
            return x + torch.tanh(self.lin(x))
        return x * 1.0  # params untouched on this rank


class BranchNet(nn.Module):
    """``gate``'s forward runs on every rank but uses its params only when
    ``use`` (rank 0): a rank-dependent branch inside a unit."""

    def __init__(self, din=6, d=16, dout=3):
        super().__init__()
        self.trunk = nn.Linear(din, d)
        self.gate = Gate(d)
        self.head = nn.Linear(d, dout)

    def forward(self, x, use=True):
        self.gate.use = use
        return self.head(self.gate(torch.tanh(self.trunk(x))))


def shard_side(rafs=None):
    """``rafs`` for the rank-dependent unit.  With True, rank 0's backward
    needs ``side``/``gate`` all-gathered again while a rank whose backward
    never reaches the unit must still take part in that all-gather: the
    library promises backward collectives in an order every rank can follow.
    With False, what is left is the final callback's zero-filled
    reduce-scatter for the unit that produced no gradient on that rank."""

    def shard(m, impl):
        unit = m.side if isinstance(m, SideNet) else m.gate
        impl.fully_shard(unit, reshard_after_forward=rafs)
        impl.fully_shard(m)
        return [(m, type(m)), (unit, type(unit))]

    return shard


# --------------------------------------------------------------------------
# Data and losses
# --------------------------------------------------------------------------


def regression_data(din, dout):
    def data(step):
        g = torch.Generator().manual_seed(1234 + step)
        return (torch.randn(GLOBAL_BATCH, din, generator=g),
                torch.randn(GLOBAL_BATCH, dout, generator=g))

    return data


def token_data(vocab=11, seq=5):
    def data(step):
        g = torch.Generator().manual_seed(4321 + step)
        return (torch.randint(0, vocab, (GLOBAL_BATCH, seq), generator=g),
                torch.randint(0, vocab, (GLOBAL_BATCH, seq), generator=g))

    return data


def mse_loss(model, batch, rank):
    x, y = batch
    return F.mse_loss(model(x), y)


def lm_loss(model, batch, rank):
    tok, tgt = batch
    logits = model(tok)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def rank0_only_loss(model, batch, rank):
    x, y = batch
    return F.mse_loss(model(x, rank == 0), y)


def eval_first(model, batch):
    return model(batch[0])


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


# --------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------


@dataclass
class Scenario:
    build: Callable[[], nn.Module]
    shard: Callable  # (model, impl) -> [(module, expected class), ...]
    opt: Callable
    data: Callable[[int], tuple]
    loss: Callable  # (model, batch, rank) -> scalar, mean over the batch
    # reference = mean over ranks of loss(ref, slice_r, r) instead of
    # loss(ref, global batch): for rank-dependent losses
    per_rank_ref: bool = False
    steps: int = STEPS
    clip: Optional[Tuple[float, float]] = None  # (max_norm, norm_type)
    eval_after: Sequence[int] = ()  # -1 = before the first step
    eval_fn: Callable = eval_first


SCENARIOS: Dict[str, Scenario] = {
    "mlp_nested_sgd_reshard": Scenario(MLP, shard_mlp(True), sgd, regression_data(8, 4),
                                       mse_loss),
    "mlp_nested_sgd_no_reshard": Scenario(MLP, shard_mlp(False), sgd, regression_data(8, 4),
                                          mse_loss),
    "mlp_nested_adamw_reshard": Scenario(MLP, shard_mlp(True), adamw, regression_data(8, 4),
                                         mse_loss),
    "mlp_nested_adamw_no_reshard": Scenario(MLP, shard_mlp(False), adamw, regression_data(8, 4),
                                            mse_loss),
    "mlp_clip_grad_norm_l2": Scenario(MLP, shard_mlp(True), sgd, regression_data(8, 4), mse_loss,
                                      clip=(0.05, 2.0)),
    "mlp_clip_grad_norm_inf": Scenario(MLP, shard_mlp(False), adamw, regression_data(8, 4),
                                       mse_loss, clip=(0.01, math.inf)),
    "uneven_padding": Scenario(Uneven, shard_uneven, sgd, regression_data(7, 3), mse_loss),
    "frozen_and_half_frozen": Scenario(FrozenNet, shard_frozen, adamw, regression_data(6, 3),
                                       mse_loss),
    "mixed_dtype_unit": Scenario(MixedNet, shard_mixed, sgd, regression_data(6, 2), mse_loss),
    "tied_embedding_list_unit": Scenario(TiedLM, shard_tied, adamw, token_data(), lm_loss),
    "unit_called_twice_reshard": Scenario(Twice, shard_twice(True), sgd, regression_data(6, 3),
                                          mse_loss),
    "unit_called_twice_no_reshard": Scenario(Twice, shard_twice(False), sgd, regression_data(6, 3),
                                             mse_loss),
    "eval_no_grad_between_steps_reshard": Scenario(MLP, shard_mlp(True), adamw,
                                                   regression_data(8, 4), mse_loss,
                                                   eval_after=(-1, 0, 2, 5)),
    "eval_no_grad_between_steps_no_reshard": Scenario(MLP, shard_mlp(False), sgd,
                                                      regression_data(8, 4), mse_loss,
                                                      eval_after=(-1, 1, 3, 5)),
    "tensor_mlp_nested_adamw_reshard": Scenario(MLP, tensor_layout(shard_mlp(True)), adamw,
                                                regression_data(8, 4), mse_loss),
    "tensor_mlp_clip_grad_norm_l2": Scenario(MLP, tensor_layout(shard_mlp(False)), sgd,
                                             regression_data(8, 4), mse_loss, clip=(0.05, 2.0)),
    "tensor_uneven_padding": Scenario(Uneven, tensor_layout(shard_uneven), adamw,
                                      regression_data(7, 3), mse_loss),
    "tensor_tied_embedding_list_unit": Scenario(TiedLM, tensor_layout(shard_tied), adamw,
                                                token_data(), lm_loss),
    "tensor_mixed_dtype_unit": Scenario(MixedNet, tensor_layout(shard_mixed), sgd,
                                        regression_data(6, 2), mse_loss),
    "uneven_pieces_mlp_nested_adamw_reshard": Scenario(MLP, uneven_pieces(shard_mlp(True)), adamw,
                                                       regression_data(8, 4), mse_loss),
    "uneven_pieces_mlp_clip_grad_norm_l2": Scenario(MLP, uneven_pieces(shard_mlp(False)), sgd,
                                                    regression_data(8, 4), mse_loss,
                                                    clip=(0.05, 2.0)),
    "uneven_pieces_uneven_padding": Scenario(Uneven, uneven_pieces(shard_uneven), adamw,
                                             regression_data(7, 3), mse_loss),
    "uneven_pieces_tied_embedding_list_unit": Scenario(TiedLM, uneven_pieces(shard_tied), adamw,
                                                       token_data(), lm_loss),
    "uneven_pieces_mixed_dtype_unit": Scenario(MixedNet, uneven_pieces(shard_mixed), sgd,
                                               regression_data(6, 2), mse_loss),
    "uneven_pieces_frozen_and_half_frozen": Scenario(FrozenNet, uneven_pieces(shard_frozen),
                                                     adamw, regression_data(6, 3), mse_loss),
    "padded_pieces_mlp_nested_adamw_reshard": Scenario(MLP, padded_pieces(shard_mlp(True)), adamw,
                                                       regression_data(8, 4), mse_loss),
    "padded_pieces_tied_embedding_list_unit": Scenario(TiedLM, padded_pieces(shard_tied), adamw,
                                                       token_data(), lm_loss),
    "padded_pieces_mixed_dtype_unit": Scenario(MixedNet, padded_pieces(shard_mixed), sgd,
                                               regression_data(6, 2), mse_loss),
    "padded_pieces_frozen_and_half_frozen": Scenario(FrozenNet, padded_pieces(shard_frozen),
                                                     adamw, regression_data(6, 3), mse_loss),
    "two_lanes_mlp_nested_adamw_reshard": Scenario(MLP, two_lanes(shard_mlp(True)), adamw,
                                                   regression_data(8, 4), mse_loss),
    "two_lanes_mixed_dtype_unit": Scenario(MixedNet, two_lanes(shard_mixed), sgd,
                                           regression_data(6, 2), mse_loss),
    "two_lanes_frozen_and_half_frozen": Scenario(FrozenNet, two_lanes(shard_frozen),
                                                 adamw, regression_data(6, 3), mse_loss),
    "unit_output_used_on_rank0_only_reshard": Scenario(SideNet, shard_side(True), sgd,
                                                       regression_data(6, 3), rank0_only_loss,
                                                       per_rank_ref=True),
    "unit_output_used_on_rank0_only_no_reshard": Scenario(SideNet, shard_side(False), adamw,
                                                          regression_data(6, 3), rank0_only_loss,
                                                          per_rank_ref=True),
    "unit_params_used_on_rank0_only_reshard": Scenario(BranchNet, shard_side(True), adamw,
                                                       regression_data(6, 3), rank0_only_loss,
                                                       per_rank_ref=True),
    "unit_params_used_on_rank0_only_no_reshard": Scenario(BranchNet, shard_side(False), sgd,
                                                          regression_data(6, 3), rank0_only_loss,
                                                          per_rank_ref=True),
}


# --------------------------------------------------------------------------
# The per-rank driver
# --------------------------------------------------------------------------


def _slice(batch, rank, ws):
    n = batch[0].shape[0] // ws
    return tuple(t[rank * n:(rank + 1) * n] for t in batch)


def _sync_check(problems: List[str], what: str) -> None:
    """Collective: every rank raises the same error listing every rank's problems."""
    if dist.get_world_size() == 1:
        gathered = [problems]
    else:
        flag = torch.tensor([len(problems)])
        dist.all_reduce(flag)  # cheap common case: nobody has anything to say
        if flag.item() == 0:
            return
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, problems)
    lines = []
    for r, probs in enumerate(gathered):
        for p in probs[:12]:
            lines.append(f"  rank {r}: {p}")
        if len(probs) > 12:
            lines.append(f"  rank {r}: ... and {len(probs) - 12} more")
    if lines:
        raise AssertionError(f"{what}:\n" + "\n".join(lines))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def _diff(tag, ours, exp) -> str:
    if ours.shape != exp.shape or ours.dtype != exp.dtype:
        return (f"{tag}: got {tuple(ours.shape)} {ours.dtype}, "
                f"expected {tuple(exp.shape)} {exp.dtype}")
    d = (ours.double() - exp.double()).abs()
    i = int(d.argmax()) if d.numel() else 0
    return (f"{tag}: max abs diff {d.max().item():.3e} at local index {i} "
            f"(got {ours.reshape(-1)[i].item():.8g}, expected {exp.reshape(-1)[i].item():.8g})")


def _structure_checks(model, ref, units, impl, rank, ws) -> None:
    problems = []
    ours = list(model.named_parameters())
    theirs = dict(ref.named_parameters())
    if [n for n, _ in ours] != list(theirs):
        problems.append(f"parameter names changed: {[n for n, _ in ours]} != {list(theirs)}")
    for mod, cls in units:
        msg = impl.is_fsdp(mod, cls)
        if msg:
            problems.append(msg)
    ranges = {}
    for name, p in ours:
        if name not in theirs:
            continue
        r = theirs[name]
        try:
            fqn, shape, (s, e) = impl.info(p)
        except Exception as ex:  # noqa: BLE001
            problems.append(f"param_info({name}) raised {type(ex).__name__}: {ex}")
            continue
        ranges[name] = (s, e)
        if fqn != name:
            problems.append(f"param_info fqn {fqn!r} != name {name!r}")
        if shape != tuple(r.shape):
            problems.append(f"{name}: param_info shape {shape} != {tuple(r.shape)}")
        if not (0 <= s <= e <= r.numel()):
            problems.append(f"{name}: local_range {(s, e)} outside [0, {r.numel()}]")
        want = expected_shape(r.shape, (s, e), ws)
        if impl.flat and tuple(rows(p).shape) != want:
            problems.append(f"{name}: sharded param has local shape {tuple(rows(p).shape)}, "
                            f"local_range {(s, e)} at world size {ws} wants {want}")
        # FSDP2's parameter contract: a DTensor of the global shape where it is split
        if impl.flat and ws > 1 and r.dim() > 0:
            from torch.distributed.tensor import DTensor
            if not isinstance(p, DTensor) or tuple(p.shape) != tuple(r.shape):
                problems.append(f"{name}: sharded param is {type(p).__name__} of shape "
                                f"{tuple(p.shape)}, wants a DTensor of {tuple(r.shape)}")
        if p.dtype != r.dtype:
            problems.append(f"{name}: dtype {p.dtype} != {r.dtype}")
        if p.requires_grad != r.requires_grad:
            problems.append(f"{name}: requires_grad {p.requires_grad} != {r.requires_grad}")
    _sync_check(problems, "structure after fully_shard")
    # The local ranges of all ranks tile each parameter exactly, in rank order.
    if impl.flat:
        if ws == 1:
            all_ranges = [ranges]
        else:
            all_ranges = [None] * ws
            dist.all_gather_object(all_ranges, ranges)
        for name, r in theirs.items():
            got = [rr.get(name) for rr in all_ranges]
            if any(g is None for g in got):
                continue  # reported above
            pos = 0
            for g in got:
                if g[0] != g[1] and g[0] != pos:
                    problems.append(f"{name}: local ranges {got} do not tile [0, {r.numel()})")
                    break
                pos = g[1] if g[0] != g[1] else pos
            else:
                if sum(e - s for s, e in got) != r.numel():
                    problems.append(f"{name}: local ranges {got} do not tile [0, {r.numel()})")
        _sync_check(problems, "param_info local ranges")


def _compare_params(model, ref, impl, step, grads: bool, ws: int) -> List[str]:
    """The gradients (``grads``) or else the parameters against the reference's
    pieces (the mock holds whole parameters)."""
    return compare_with_reference(
        model, ref, f"step {step}", grads=grads, params=not grads, rtol=RTOL, atol=ATOL,
        shard_world=ws, local_range=lambda p: impl.info(p)[2],
        piece=None if impl.flat else (lambda full, p: full.detach()))


def _check_scalar(tag, got: float, exp: float, problems: List[str], rtol=RTOL):
    if not math.isclose(got, exp, rel_tol=rtol, abs_tol=1e-7):
        problems.append(f"{tag}: got {got!r}, reference {exp!r}")


def run_scenario(name: str, rank: int, ws: int, impl) -> None:
    sc = SCENARIOS[name]
    torch.manual_seed(0)
    model = sc.build()
    ref = copy.deepcopy(model)
    units = sc.shard(model, impl)
    impl.prepare(model)
    _structure_checks(model, ref, units, impl, rank, ws)

    opt = sc.opt([p for p in model.parameters() if p.requires_grad])
    ref_opt = sc.opt([p for p in ref.parameters() if p.requires_grad])
    clipped_once = False

    def eval_check(step):
        batch = sc.data(10_000 + step)  # the whole global batch on every rank
        model.eval()
        ref.eval()
        with torch.no_grad():
            ours = sc.eval_fn(model, batch)
            exp = sc.eval_fn(ref, batch)
        model.train()
        ref.train()
        probs = [] if _close(ours, exp) else [_diff(f"eval output after step {step}", ours, exp)]
        _sync_check(probs, f"{name}: eval forward under no_grad")

    if -1 in sc.eval_after:
        eval_check(-1)
    for step in range(sc.steps):
        batch = sc.data(step)
        local = _slice(batch, rank, ws)
        loss = sc.loss(model, local, rank)
        loss.backward()
        impl.after_backward(model, ws)

        with torch.no_grad():
            ref_local = sc.loss(ref, local, rank).item()
        if sc.per_rank_ref:
            ref_loss = sum(sc.loss(ref, _slice(batch, r, ws), r) for r in range(ws)) / ws
        else:
            ref_loss = sc.loss(ref, batch, 0)
        ref_loss.backward()

        problems = []
        _check_scalar(f"step {step} local loss", loss.item(), ref_local, problems)
        mean = loss.detach().double().reshape(1).clone()
        if ws > 1:
            dist.all_reduce(mean)
        _check_scalar(f"step {step} loss averaged over ranks", mean.item() / ws, ref_loss.item(),
                      problems)
        if sc.clip is not None:
            max_norm, norm_type = sc.clip
            norm = impl.clip(list(model.parameters()), max_norm, norm_type)
            ref_norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm,
                                                      norm_type=norm_type)
            clipped_once |= ref_norm.item() > max_norm
            _check_scalar(f"step {step} clip_grad_norm_ total norm", float(norm), ref_norm.item(),
                          problems)
        problems += _compare_params(model, ref, impl, step, grads=True, ws=ws)
        _sync_check(problems, f"{name}: loss / gradients")

        opt.step()
        ref_opt.step()
        _sync_check(_compare_params(model, ref, impl, step, grads=False, ws=ws),
                    f"{name}: parameters after the optimizer step")
        opt.zero_grad()
        ref_opt.zero_grad()
        if step in sc.eval_after:
            eval_check(step)
    if sc.clip is not None:
        assert clipped_once, "test bug: max_norm never clipped; lower it"


# --------------------------------------------------------------------------
# Batched launches: every selected scenario of one world size in one launch
# --------------------------------------------------------------------------


def _run_one(name, rank, ws):
    run_scenario(name, rank, ws, _Mock() if MOCK else _Real())


_LAUNCHES = Scenarios(_run_one, timeout=lambda n: 90 + 15 * n)


@pytest.fixture(scope="module")
def parity_results(request):
    """(world size, scenario) -> None (pass) or the failure text; one launch
    per world size runs the scenarios this session selected."""
    selected = defaultdict(list)
    for item in request.session.items:
        cs = getattr(item, "callspec", None)
        if cs is not None and getattr(item, "originalname", None) == "test_parity" \
                and item.module.__name__ == __name__:
            selected[cs.params["world_size"]].append(cs.params["scenario"])

    def get(ws, name):
        status, val = _LAUNCHES.outcome(ws, name, selected.get(ws) or [name])
        return None if status == "ok" else val

    return get


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_parity(scenario, world_size, parity_results):
    failure = parity_results(world_size, scenario)
    if failure is not None:
        pytest.fail(failure, pytrace=False)


# --------------------------------------------------------------------------
# The harness itself
# --------------------------------------------------------------------------


def _harness_ok(rank, ws):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return (rank, t.item(), torch.get_num_threads())


def _harness_fail(rank, ws):
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    t = torch.ones(1)
    dist.all_reduce(t)  # the peer is gone: gloo raises, the harness picks rank 1
    return rank


def _harness_hang(rank, ws):
    if rank == 1:
        time.sleep(3600)
    dist.barrier()


def test_harness_returns_per_rank_values():
    assert run_distributed(_harness_ok, 2) == [(0, 3.0, 1), (1, 3.0, 1)]


def test_harness_reraises_first_failing_rank():
    with pytest.raises(DistributedError, match="deliberate failure on rank 1") as ei:
        run_distributed(_harness_fail, 2)
    assert ei.value.rank == 1 and ei.value.exc_type == "ValueError"
    assert "_harness_fail" in str(ei.value)  # the traceback text is in the message


def test_harness_kills_on_timeout():
    """Rank 1 sleeps for an hour, rank 0 waits for it in a barrier: the
    harness kills both at its deadline (else this test hangs, or fails with
    rank 0's barrier timeout instead) and shows where each one was."""
    from ._dist import _start_method

    timeout = 3 if _start_method() == "fork" else 20  # spawned children take seconds to start
    with pytest.raises(DistributedError, match="did not finish within") as ei:
        run_distributed(_harness_hang, 2, timeout=timeout)
    assert str(ei.value).count("still running; its stacks") == 2, str(ei.value)
    assert "_harness_hang" in str(ei.value)  # where the ranks were stuck
