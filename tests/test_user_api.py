"""A sharded model is freed with its last reference; an optimizer built before
fully_shard is refused at its first step; set_unshard_in_backward(False)
saves the backward all-gather of a unit whose backward needs no parameters
(an embedding) and trains as DDP does.
"""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_compose import (CPUOffloadPolicy, MixedPrecisionPolicy, clip_grad_norm_, comm_stats,
                          fully_shard, materialize, reset_comm_stats)

from fsdp_compose._plan import _layout

from ._dist import run_distributed
from ._grad_nets import FreezeNet, adamw, batch, shard_units
from ._support import compare_step, raised


# ------------------------------------------------------------ 9. memory release
def _freed(rank, world, setting):
    torch.manual_seed(0)
    model = FreezeNet()
    kw = {}
    if setting == "mp_offload":
        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
              "offload_policy": CPUOffloadPolicy(pin_memory=False)}
    if setting == "hsdp" and world > 1:
        kw = {"mesh": init_device_mesh("cpu", (2, world // 2))}
    shard_units(model, list(model.layers), per_unit=setting == "per_unit", **kw)
    if setting == "keep_gathered":
        model.set_reshard_after_backward(False)
    opt = adamw(model.parameters())
    for step in range(2):
        x, y = batch(step, rank)
        out = model(x)
        (out - y).pow(2).mean().backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        model(x)  # an eval forward too
    model.state_dict()
    refs = {"model": weakref.ref(model), "unit module": weakref.ref(model.layers[1]),
            "parameter": weakref.ref(model.layers[1].l1.weight),
            "shard": weakref.ref(model.layers[1]._unit().groups[0].shard)}
    del model, opt, out
    gc.collect()
    return sorted(name for name, r in refs.items() if r() is not None)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("setting", ["bucketed", "per_unit", "mp_offload", "hsdp",
                                     "keep_gathered"])
def test_sharded_model_is_freed(world, setting):
    assert run_distributed(_freed, world, setting) == [[]] * world


# --------------------------------------- 11. an optimizer built before fully_shard
def _early_optimizer(rank, world):
    out = {}
    torch.manual_seed(0)
    model = FreezeNet()
    early = adamw(model.parameters())
    shard_units(model, list(model.layers), per_unit=False)
    x, y = batch(0, rank)
    (model(x) - y).pow(2).mean().backward()
    out["early"] = raised(early.step)
    late = adamw(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    out["late"] = raised(late.step)
    out["late_moves"] = not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # a param group added later is checked too
    late.add_param_group({"params": [early.param_groups[0]["params"][0]]})
    out["added"] = raised(late.step)

    # before materialize: the meta-device sharded Parameters are replaced too
    with torch.device("meta"):
        meta = FreezeNet()
    shard_units(meta, list(meta.layers), per_unit=False)
    before_materialize = adamw(meta.parameters())
    materialize(meta, device="cpu")
    (meta(x) - y).pow(2).mean().backward()
    out["meta"] = raised(before_materialize.step)

    # before load_state_dict(assign=True) into a model on meta: replaced too
    sd = meta.state_dict()  # (this rank's RowParams: the same layout)
    with torch.device("meta"):
        assigned = FreezeNet()
    shard_units(assigned, list(assigned.layers), per_unit=False)
    before_assign = adamw(assigned.parameters())
    assigned.load_state_dict(sd, assign=True)
    (assigned(x) - y).pow(2).mean().backward()
    out["assign"] = raised(before_assign.step)
    out["assign_late"] = raised(adamw(assigned.parameters()).step)

    plain = nn.Linear(2, 2)  # optimizers of unsharded models are left alone
    out["plain"] = raised(adamw(plain.parameters()).step)
    return out


@pytest.fixture(scope="module")
def early_optimizer():
    return run_distributed(_early_optimizer, 2)


def test_optimizer_built_before_fully_shard_is_refused(early_optimizer):
    for rank, out in enumerate(early_optimizer):  # on every rank: no rank left waiting
        kind, msg = out["early"]
        assert kind == "RuntimeError", out["early"]
        for needle in (f"[rank {rank}]", "AdamW", "16 parameter(s)", "'inp.weight'",
                       "'layers.0.l1.weight'", "'layers.1.l1.bias'", "and 8 more",
                       "after fully_shard",
                       "model.parameters()"):
            assert needle in msg, (needle, msg)
        kind, msg = out["meta"]
        assert kind == "RuntimeError" and "'inp.weight'" in msg \
            and "materialize" in msg, out["meta"]
        kind, msg = out["assign"]
        assert kind == "RuntimeError" and "'inp.weight'" in msg \
            and "load_state_dict(assign=True)" in msg, out["assign"]
        assert out["assign_late"] == ("no error", ""), out["assign_late"]
        assert out["late"] == ("no error", "") and out["late_moves"]
        assert out["added"][0] == "RuntimeError" and "1 parameter(s)" in out["added"][1]
        assert out["plain"] == ("no error", "")


# -------------------------------------------------- 13. set_unshard_in_backward
class EmbedNet(nn.Module):
    def __init__(self, vocab=13, d=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(d, 1)

    def forward(self, tok):
        h = self.embed(tok).mean(1)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def _unshard_in_backward(rank, world, per_unit, skip):
    torch.manual_seed(0)
    model = EmbedNet()
    ddp = DDP(copy.deepcopy(model)) if world > 1 else copy.deepcopy(model)
    ref = ddp.module if world > 1 else ddp
    shard_units(model, [model.embed, *model.layers], per_unit)
    if skip:
        model.embed.set_unshard_in_backward(False)
    opt, ref_opt = adamw(model.parameters()), adamw(ddp.parameters())
    problems, counts = [], []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        tok, y = torch.randint(0, 13, (4, 5), generator=g), torch.randn(4, 1, generator=g)
        reset_comm_stats()
        (model(tok) - y).pow(2).mean().backward()
        s = comm_stats()
        counts.append((s.all_gather_calls, s.all_gather_bytes))
        (ddp(tok) - y).pow(2).mean().backward()
        problems += compare_step(model, ref, opt, ref_opt, f"step {step}", shard_world=world)
    return problems, counts


def _both_settings(rank, world, per_unit):
    return {skip: _unshard_in_backward(rank, world, per_unit, skip) for skip in (False, True)}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("per_unit", [True, False], ids=["per_unit", "bucketed"])
def test_set_unshard_in_backward(world, per_unit):
    for out in run_distributed(_both_settings, world, per_unit):
        (p_all, gathers_all), (p_skip, gathers_skip) = out[False], out[True]
        assert p_all == [] and p_skip == []
        if world == 1:
            assert gathers_all == gathers_skip == [(0, 0)] * 3
            continue
        # the embedding's unsharded size (13 x 6 floats, laid out for the ranks)
        embed_bytes = _layout.plan([_layout.Slot(13, 6)], world, 4, "row").numel * 4
        for (calls_all, bytes_all), (calls_skip, bytes_skip) in zip(gathers_all, gathers_skip):
            assert bytes_all - bytes_skip == embed_bytes
            if per_unit:  # 4 in forward, 3 in backward (the root is kept) vs 2
                assert (calls_all, calls_skip) == (7, 6)


# ------------------------------------------------ what is attached to torch
def _installs(rank, world):
    import torch.amp
    from torch.nn.utils import clip_grad

    import fsdp_compose

    class Custom(torch.optim.SGD):  # an optimizer we do not know: needs whole tensors
        def step(self, closure=None):
            return super().step(closure)

    def step_raises():
        torch.manual_seed(0)
        m = nn.Linear(8, 8)
        fully_shard(m)
        m(torch.randn(2, 8)).sum().backward()
        return raised(lambda: Custom(m.parameters(), lr=0.1).step())[0] != "no error"

    names = lambda: (nn.utils.clip_grad_norm_, clip_grad.clip_grad_norm_,  # noqa: E731
                     nn.utils.get_total_norm, torch.amp.GradScaler.unscale_,
                     clip_grad._clip_grads_with_norm_)
    out = {"installed": step_raises()}
    patched = names()
    fsdp_compose.install_torch_hooks(False)
    originals = names()
    out["off"] = step_raises()  # (its fully_shard installs nothing)
    ours = ("_fsdp_compose_dispatch", "_fsdp_compose_guard")
    out["restored"] = [a is not b and not any(hasattr(b, n) for n in ours)
                       for a, b in zip(patched, originals)]
    fsdp_compose.install_torch_hooks()
    out["again"] = step_raises()
    out["repatched"] = [n is not o for n, o in zip(names(), originals)]
    return out


def test_torch_hooks_are_one_reversible_install():
    """The optimizer check, the clip and get_total_norm routing, the guard
    of torch's clip helper and GradScaler's: installed by fully_shard, all
    removed by install_torch_hooks(False) (torch's own functions back, no
    global optimizer hook: an unknown optimizer over split parameters steps
    silently), installed again by install_torch_hooks()."""
    for res in run_distributed(_installs, 2):
        assert res["installed"] and not res["off"] and res["again"], res
        assert res["restored"] == [True] * 5 and res["repatched"] == [True] * 5, res
