"""What a user can observe of gradients, against DDP or plain PyTorch, every step.

- a parameter no rank produced a gradient for keeps ``p.grad is None`` (an
  unused submodule, a unit whose output is dropped, a unit that did not run);
  one used on some ranks only gets the rank average (DDP with
  ``find_unused_parameters=True``), also through buckets, HSDP (with and
  without the all-reduce) and a low-precision reduce;
- ``requires_grad_(False)`` / ``(True)`` after fully_shard is honoured, also
  for parameters frozen when the unit was sharded;
- optimizers over parts of a unit, zeroed at different times; ``p.grad`` set
  by the user;
- accumulation without ``zero_grad``, ``set_to_none=False``, several
  backwards per step, ``set_requires_gradient_sync(False)`` /
  ``set_requires_all_reduce(False)`` with a unit that runs in some
  microbatches only, ``set_is_last_backward(False)``;
- activation checkpointing around a unit, reentrant (the unit's collectives
  in backward must follow the rank-independent orders) or not; 0-dim
  parameters (the flat path at world size 1).

All scenarios of one world size share one launch (``_support.Scenarios``);
each is its own test. A scenario that raises fails its test with the
traceback of the rank that raised first, at once.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy

from fsdp_compose._group import _grad_path

from ._grad_nets import D, Blk, FreezeNet, adamw, batch, shard_units
from ._support import Scenarios, compare_step, compare_with_reference

STEPS = 4


class UnusedNet(nn.Module):
    """``a.l2``: output unused on every rank (part of a unit); ``b``: output
    used on rank 0 only, on even steps only; ``c``: runs, output unused on
    every rank; ``d``: runs on odd steps only; ``e``: runs under ``torch.no_grad()`` (a no-grad
    island never recomputed). ``ac``: ``a`` under activation checkpointing."""

    def __init__(self, scalar=False, ac=None):
        super().__init__()
        self.inp = nn.Linear(3, D)
        self.a, self.b, self.c, self.d, self.e = (Blk(scalar) for _ in range(5))
        self.out = nn.Linear(D, 1)
        self.ac = ac

    def forward(self, x, rank, step):
        h = self.inp(x)
        if self.ac is None:
            h = self.a(h, use_l2=False)
        else:
            h = checkpoint(self.a, h, False, use_reentrant=self.ac == "reentrant")
        hb = self.b(h)
        self.c(h)
        with torch.no_grad():
            h = h + self.e(h)
        if rank == 0 and step % 2 == 0:
            h = hb
        if step % 2 == 1:
            h = self.d(h)
        return self.out(h)


# ------------------------------------------------ 1. no gradient on any rank
def unused_vs_ddp(rank, world, mode="none", per_unit=False, flat_at_1=False, mesh=None,
                  mp=None, atol=1e-6, rtol=1e-5, toggle=False):
    """UnusedNet against DDP(find_unused_parameters=True). ``mode``: none /
    keep (zero_grad(set_to_none=False)) / twice (two backwards per step, no
    zero_grad between) / no_all_reduce (HSDP: the first of the two without
    the all-reduce). With two, ``d`` runs in one of them; ``toggle``: the
    first reduces in buckets, the second per unit."""
    torch.manual_seed(0)
    model = UnusedNet()
    ddp = DDP(copy.deepcopy(model), find_unused_parameters=True)
    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if flat_at_1 else {}
    if mesh is not None:
        kw["mesh"] = mesh
    if mp is not None:
        kw["mp_policy"] = mp
    shard_units(model, [model.a, model.b, model.c, model.d, model.e], per_unit, **kw)
    shard_world = mesh.size(mesh.ndim - 1) if mesh is not None else world
    opt, ref_opt = adamw(model.parameters()), adamw(ddp.parameters())
    problems = []
    for step in range(STEPS):
        for micro in range(2 if mode in ("twice", "no_all_reduce") else 1):
            if mode == "no_all_reduce":
                model.set_requires_all_reduce(micro == 1)
            if toggle:
                model.set_reduce_scatter_bucket_bytes(0 if micro == 1 else 1 << 20)
            x, y = batch(step, rank, micro)
            for m in (model, ddp):  # (d runs in one of two microbatches)
                (m(x, rank, step + micro) - y).pow(2).mean().backward()
        problems += compare_step(model, ddp.module, opt, ref_opt, f"step {step}",
                                 set_to_none=mode != "keep", rtol=rtol, atol=atol,
                                 shard_world=shard_world)
    return problems


# ------------------------------------------------------ 2. freezing after sharding
def global_step(model, ref, step, rank, world, micro=0, fwd=None):
    """Our loss on this rank's batch; the reference's on every rank's (each
    with its rank's control flow), averaged."""
    fwd = fwd or (lambda m, x, r: m(x))
    x, y = batch(step, rank, micro)
    (fwd(model, x, rank) - y).pow(2).mean().backward()
    ref_loss = 0
    for r in range(world):
        xr, yr = batch(step, r, micro)
        ref_loss = ref_loss + (fwd(ref, xr, r) - yr).pow(2).mean() / world
    ref_loss.backward()


def freeze(rank, world, per_unit=False, flat_at_1=False, scalar=False):
    """Steps 1-2: ``layers.0.l1.weight`` (part of a unit), all of ``layers.1``
    and ``out.bias`` (part of the root) frozen; step 3 on: all trainable again,
    including ``layers.2``, frozen since before fully_shard."""
    torch.manual_seed(0)
    model = FreezeNet(scalar)
    model.layers[2].requires_grad_(False)
    ref = copy.deepcopy(model)
    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if flat_at_1 else {}
    shard_units(model, list(model.layers), per_unit, **kw)
    opt, ref_opt = adamw(model.parameters()), adamw(ref.parameters())
    problems = []
    for step in range(5):
        for m in (model, ref):
            if step == 1:
                m.layers[0].l1.weight.requires_grad_(False)
                m.layers[1].requires_grad_(False)
                m.out.bias.requires_grad_(False)
            if step == 3:
                m.requires_grad_(True)
        global_step(model, ref, step, rank, world)
        problems += compare_step(model, ref, opt, ref_opt, f"step {step}", shard_world=world)
    return problems


# ----------------------------------------------- 3. optimizers over parts of units
def partial_optimizers(rank, world, per_unit=False, flat_at_1=False):
    """Weights and biases in two optimizers: the weights' stepped and zeroed
    every step, the biases' every other step (their gradients accumulate over
    two); then an optimizer over ``layers.0`` only, the rest accumulating."""
    torch.manual_seed(0)
    model = FreezeNet()
    ref = copy.deepcopy(model)
    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if flat_at_1 else {}
    shard_units(model, list(model.layers), per_unit, **kw)

    def split(m):
        ws = [p for n, p in m.named_parameters() if n.endswith("weight")]
        bs = [p for n, p in m.named_parameters() if n.endswith("bias")]
        return adamw(ws), torch.optim.SGD(bs, lr=0.05)

    ours, theirs = split(model), split(ref)
    problems = []
    for step in range(4):
        global_step(model, ref, step, rank, world)
        problems += compare_with_reference(model, ref, f"step {step}", params=False,
                                           shard_world=world)
        for (w, b) in (ours, theirs):
            w.step()
            w.zero_grad()
            if step % 2 == 1:
                b.step()
                b.zero_grad()
        problems += compare_with_reference(model, ref, f"step {step}", grads=False,
                                           shard_world=world)
    sub, ref_sub = adamw(model.layers[0].parameters()), adamw(ref.layers[0].parameters())
    for step in range(4, 7):
        global_step(model, ref, step, rank, world)
        problems += compare_with_reference(model, ref, f"step {step}", params=False,
                                           shard_world=world)
        for o in (sub, ref_sub):
            o.step()
            o.zero_grad()
        problems += compare_with_reference(model, ref, f"step {step}", grads=False,
                                           shard_world=world)
    return problems


# ---------------------------- accumulation: a unit in some microbatches only
def unsynced_unit(rank, world, per_unit=False):
    """Four microbatches, sync off for the first three; ``layers.1`` runs in
    the first microbatch only. Its gradient from that microbatch belongs to
    this step (DDP's no_sync keeps it in p.grad until the synced backward)."""
    torch.manual_seed(0)
    model = FreezeNet()
    ref = copy.deepcopy(model)
    shard_units(model, list(model.layers), per_unit)
    opt, ref_opt = adamw(model.parameters()), adamw(ref.parameters())

    def fwd(micro):
        return lambda m, x, r: m(x, skip=() if micro == 0 else (1,))

    problems = []
    for step in range(3):
        for micro in range(4):
            model.set_requires_gradient_sync(micro == 3)
            global_step(model, ref, step, rank, world, micro, fwd(micro))
        problems += compare_step(model, ref, opt, ref_opt, f"step {step}", shard_world=world)
    return problems


def unused_vs_one(rank, world, ac=None, scalar=False, no_sync=False, per_unit=False,
                  last_in_flight=False, user_grads=False):
    """UnusedNet against one process looping over every rank's batch and
    control flow: under activation checkpointing (``a``), with 0-dim
    parameters (``scalar``), over two microbatches the first of which does
    not sync gradients (flags of both count) or leaves its last reduction in
    flight (``set_is_last_backward(False)``: folded by the next backward), or
    with ``p.grad`` of ``b`` and ``c`` set by the user before each backward
    (their own tensors, added into)."""
    torch.manual_seed(0)
    model = UnusedNet(scalar, ac)
    ref = copy.deepcopy(model)
    shard_units(model, [model.a, model.b, model.c, model.d, model.e], per_unit)
    opt, ref_opt = adamw(model.parameters()), adamw(ref.parameters())
    problems = []
    for step in range(STEPS):
        micros = 2 if no_sync or last_in_flight else 1
        if user_grads:
            for m in (model, ref):
                for p in [*m.b.parameters(), *m.c.l2.parameters()]:
                    p.grad = torch.full_like(p, 0.01 * (step + 1))
        for micro in range(micros):
            if no_sync:
                model.set_requires_gradient_sync(micro == micros - 1)
            if last_in_flight:
                model.set_is_last_backward(micro == micros - 1)
            # the second microbatch: what ran on even steps runs on odd ones
            global_step(model, ref, step, rank, world, micro,
                        lambda m, x, r: m(x, r, step + micro) / micros)
        problems += compare_step(model, ref, opt, ref_opt, f"step {step}", shard_world=world)
    return problems


# --------------------------------------------------------------------- runner
def separate_flags(fn):
    """``fn`` with every flat gradient's used-flags in an all-reduce of their
    own (as for flat gradients above INLINE_FLAGS_BYTES; these are small)."""
    def run(*args, **kw):
        with _grad_path.inline_flags_limit(0):
            return fn(*args, **kw)
    return run


def _scenarios(world: int) -> dict:
    out = {}
    # per unit, flags in their own all-reduce
    for mode in ("none", "twice"):
        out[f"unused_{mode}_separate_flags"] = separate_flags(
            functools.partial(unused_vs_ddp, mode=mode, per_unit=True))
    out["unused_no_sync_separate_flags"] = separate_flags(
        functools.partial(unused_vs_one, no_sync=True, per_unit=True))
    out["unused_reentrant_separate_flags"] = separate_flags(
        functools.partial(unused_vs_one, ac="reentrant", per_unit=True))
    for per_unit in (False, True):
        tag = "per_unit" if per_unit else "bucketed"
        for mode in ("none", "keep", "twice"):
            out[f"unused_{mode}_{tag}"] = functools.partial(unused_vs_ddp, mode=mode,
                                                            per_unit=per_unit)
        out[f"freeze_{tag}"] = functools.partial(freeze, per_unit=per_unit)
        out[f"partial_optimizers_{tag}"] = functools.partial(partial_optimizers,
                                                             per_unit=per_unit)
        out[f"unsynced_unit_{tag}"] = functools.partial(unsynced_unit, per_unit=per_unit)
        out[f"unused_no_sync_{tag}"] = functools.partial(unused_vs_one, no_sync=True,
                                                         per_unit=per_unit)
        out[f"unused_last_in_flight_{tag}"] = functools.partial(
            unused_vs_one, last_in_flight=True, per_unit=per_unit)
        out[f"unused_user_grads_{tag}"] = functools.partial(unused_vs_one, user_grads=True,
                                                            per_unit=per_unit)
        for ac in ("reentrant", "non_reentrant"):
            out[f"unused_{ac}_{tag}"] = functools.partial(unused_vs_one, ac=ac,
                                                          per_unit=per_unit)
    out["unused_scalar"] = functools.partial(unused_vs_one, scalar=True)
    out["unused_scalar_no_sync"] = functools.partial(unused_vs_one, scalar=True, no_sync=True)
    out["freeze_scalar"] = functools.partial(freeze, scalar=True)
    if world == 1:  # the flat path at world size 1 (offload: not a direct group)
        out["unused_flat_at_1"] = functools.partial(unused_vs_ddp, flat_at_1=True)
        out["unused_keep_flat_at_1"] = functools.partial(unused_vs_ddp, mode="keep",
                                                         flat_at_1=True)
        out["freeze_flat_at_1"] = functools.partial(freeze, flat_at_1=True)
        out["partial_optimizers_flat_at_1"] = functools.partial(partial_optimizers,
                                                                flat_at_1=True)
    else:
        out["unused_reduce_bf16"] = functools.partial(
            unused_vs_ddp, mp=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),
            atol=2e-2, rtol=2e-2)
        out["unused_reduce_bf16_per_unit"] = functools.partial(
            unused_vs_ddp, per_unit=True, mp=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),
            atol=2e-2, rtol=2e-2)
        for per_unit in (False, True):
            tag = "per_unit" if per_unit else "bucketed"
            out[f"unused_hsdp_{tag}"] = ("hsdp", functools.partial(unused_vs_ddp,
                                                                   per_unit=per_unit))
            out[f"unused_hsdp_no_all_reduce_{tag}"] = ("hsdp", functools.partial(
                unused_vs_ddp, mode="no_all_reduce", per_unit=per_unit))
        out["unused_hsdp_separate_flags"] = ("hsdp", separate_flags(
            functools.partial(unused_vs_ddp, per_unit=True)))
        out["unused_hsdp_no_all_reduce_separate_flags"] = ("hsdp", separate_flags(
            functools.partial(unused_vs_ddp, mode="no_all_reduce", per_unit=True)))
        # the partial sum of a bucket (flags inline) completed per unit (flags apart)
        out["unused_hsdp_no_all_reduce_mixed_flags"] = ("hsdp", separate_flags(
            functools.partial(unused_vs_ddp, mode="no_all_reduce", toggle=True)))
    return out


def _run_one(name, rank, world):
    fn = _scenarios(world)[name]
    if isinstance(fn, tuple):  # HSDP: (replicate 2, shard world/2)
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
        return fn[1](rank, world, mesh=mesh)
    return fn(rank, world)


_LAUNCHES = Scenarios(_run_one, timeout=240)


@pytest.mark.parametrize("world,name", [(w, n) for w in (1, 2, 4) for n in _scenarios(w)])
def test_gradient_semantics(world, name):
    _LAUNCHES.assert_no_problems(world, name, list(_scenarios(world)))
