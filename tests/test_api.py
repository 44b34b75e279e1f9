"""FSDPModule semantics, clear errors for bad input, collective counts.

Each group of checks runs in ONE multi-process launch (a module-scoped
fixture) and the tests assert on what the ranks returned.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp_compose
from fsdp_compose import FSDPModule, comm_stats, fully_shard, param_info, reset_comm_stats

from ._dist import run_distributed
# (test_streams imports Net and per_unit_collectives from here)
from ._support import Block, Net, per_unit_collectives, raised, rows, shard


# --------------------------------------------------------------------- errors
def _errors(rank, world):
    out = {}

    m = Net()
    fully_shard(m.layers[0])
    out["twice"] = raised(lambda: fully_shard(m.layers[0]))
    fully_shard(m.layers[1])
    fully_shard(m)  # now every unit has its FQN
    out["twice_named"] = raised(lambda: fully_shard(m.layers[1]))

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x):
            return self.head(self.embed(x))

    t = Tied()
    fully_shard(t.embed)
    out["tied_across_units"] = raised(lambda: fully_shard(t.head))

    with torch.device("meta"):
        meta = Net()
    shard(meta)
    out["meta"] = raised(lambda: meta(torch.randn(2, 3)))

    mesh3d = init_device_mesh("cpu", (1, 1, world), mesh_dim_names=("a", "rep", "shard"))
    out["mesh_3d"] = raised(lambda: fully_shard(Net(), mesh=mesh3d))
    out["raf_not_divisor"] = raised(lambda: fully_shard(Net(), reshard_after_forward=world + 1))
    out["mp_policy_type"] = raised(lambda: fully_shard(Net(), mp_policy=torch.bfloat16))
    out["mp_policy_int_dtype"] = raised(
        lambda: fully_shard(Net(), mp_policy=fsdp_compose.MixedPrecisionPolicy(
            param_dtype=torch.int8)))
    out["offload_type"] = raised(lambda: fully_shard(Net(), offload_policy=True))

    # (a Parameter of another module is fine: one model-wide set may go to every call)
    out["ignored_not_param"] = raised(lambda: fully_shard(Net(), ignored_params=[torch.zeros(3)]))
    out["mesh_type"] = raised(lambda: fully_shard(Net(), mesh="dp"))

    out["module_list"] = raised(lambda: fully_shard(Net().layers))

    moved = shard(Net())
    moved.layers[0].lin1.to(torch.float64)  # a module inside a unit: its shard is not cast
    out["moved_after"] = raised(lambda: moved(torch.randn(2, 3)))

    out["param_info_plain"] = raised(lambda: param_info(nn.Parameter(torch.zeros(2))))

    knobs = shard(Net())
    out["prefetch_depth_negative"] = raised(lambda: knobs.layers[0].set_prefetch_depth(-1))
    out["bucket_negative"] = raised(lambda: knobs.layers[0].set_reduce_scatter_bucket_bytes(-1))
    out["gather_bucket_negative"] = raised(lambda: knobs.set_all_gather_bucket_bytes(-1))
    out["gather_bucket_float"] = raised(lambda: knobs.set_all_gather_bucket_bytes(1.5))
    out["gather_bucket_bool"] = raised(lambda: knobs.set_all_gather_bucket_bytes(True))
    out["bucket_bool"] = raised(lambda: knobs.set_reduce_scatter_bucket_bytes(True))
    out["prefetch_not_sharded"] = raised(
        lambda: knobs.layers[0].set_modules_to_forward_prefetch([knobs.inp]))
    out["deepcopy"] = raised(lambda: copy.deepcopy(knobs))
    out["forward_method_missing"] = raised(
        lambda: fsdp_compose.register_fsdp_forward_method(knobs.layers[1], "generate"))

    # a root-only setting on another unit: never silently ignored
    early = shard(Net())
    early.layers[1].set_prefetch_depth(2)  # the root is not known yet: checked at lazy init
    out["root_setting_before_init"] = raised(lambda: early(torch.randn(2, 3)))
    late = shard(Net())
    late(torch.randn(2, 3)).sum().backward()
    out["root_setting_after_init"] = raised(lambda: late.layers[0].set_is_last_backward(False))
    late.set_is_last_backward(True)  # on the root: fine
    # No collective above: without this, a rank can finish and take the store
    # down while another still creates its (single-rank) mesh groups through it.
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def errors():
    return run_distributed(_errors, 2)[0]


@pytest.mark.parametrize("case,exc,needles", [
    ("twice", "ValueError", ["unit 'Block'", "already applied", "once per module"]),
    ("twice_named", "ValueError", ["unit 'layers.1'", "already applied"]),
    ("tied_across_units", "ValueError", ["'weight'", "another unit, the one made by "
                                         "fully_shard(Embedding)",
                                         "fully_shard([module_a, module_b])"]),
    ("meta", "RuntimeError", ["layers.0.lin1.weight", "meta device",
                              "fsdp_compose.materialize(model)", "model.to_empty(device=...)",
                              "README, 'Building on the meta device'"]),
    ("mesh_3d", "ValueError", ["1-D", "2-D (replicate, shard)", "mesh['dp']"]),
    ("raf_not_divisor", "ValueError", ["Net", "reshard_after_forward=",
                                       "divides the shard world size"]),
    ("mp_policy_type", "TypeError", ["Net", "MixedPrecisionPolicy", "torch.bfloat16"]),
    ("mp_policy_int_dtype", "ValueError", ["param_dtype", "floating-point", "torch.int8"]),
    ("offload_type", "TypeError", ["CPUOffloadPolicy()", "True"]),
    ("ignored_not_param", "ValueError", ["not an nn.Parameter", "(3,)"]),
    ("mesh_type", "TypeError", ["mesh must be a DeviceMesh (or a ProcessGroup)", "str"]),
    ("module_list", "ValueError", ["ModuleList", "each block"]),
    ("moved_after", "RuntimeError", ["unit 'layers.0'", "'layers.0.lin1.weight'",
                                     "the module fully_shard was applied to"]),
    ("param_info_plain", "ValueError", ["not a parameter sharded by fully_shard"]),
    ("prefetch_depth_negative", "ValueError", ["unit 'layers.0'", "int >= 0", "-1"]),
    ("bucket_negative", "ValueError", ["unit 'layers.0'", "int >= 0 (bytes)", "-1"]),
    ("gather_bucket_negative", "ValueError", ["unit '<root>'", "int >= 0 (bytes)", "-1"]),
    ("gather_bucket_float", "ValueError", ["unit '<root>'", "int >= 0 (bytes)", "1.5"]),
    ("gather_bucket_bool", "ValueError", ["unit '<root>'", "int >= 0 (bytes)", "True"]),
    ("bucket_bool", "ValueError", ["unit '<root>'", "int >= 0 (bytes)", "True"]),
    ("prefetch_not_sharded", "ValueError", ["Linear is not sharded", "fully_shard was applied"]),
    ("forward_method_missing", "ValueError", ["unit 'layers.1'", "'generate'"]),
    ("deepcopy", "TypeError", ["unit '<root>'", "copy.deepcopy", "before fully_shard"]),
    ("root_setting_before_init", "ValueError",
     ["unit 'layers.1'", "set_prefetch_depth() was called", "not the root", "would be ignored",
      "model.set_prefetch_depth(...)"]),
    ("root_setting_after_init", "ValueError",
     ["unit 'layers.0'", "set_is_last_backward()", "root unit '<root>'",
      "model.set_is_last_backward(...)"]),
])
def test_clear_errors(errors, case, exc, needles):
    got_exc, msg = errors[case]
    assert got_exc == exc, (case, got_exc, msg)
    for needle in needles:
        assert needle in msg, f"{case}: {needle!r} not in {msg!r}"
    assert "[rank" in msg or case in ("param_info_plain", "prefetch_not_sharded"), msg


# ---------------------------------------------------------- module semantics
def _semantics(rank, world):
    torch.manual_seed(0)
    m = Net(n=2)
    ref = copy.deepcopy(m)
    names_before = [n for n, _ in m.named_parameters()]
    shard(m)
    out = {
        "is_fsdp": isinstance(m, FSDPModule) and isinstance(m.layers[0], FSDPModule),
        "keeps_class": isinstance(m, Net) and isinstance(m.layers[1], Block),
        "inner_plain": not isinstance(m.layers[0].lin1, FSDPModule),
        "names_same": [n for n, _ in m.named_parameters()] == names_before,
        # DTensors of the global shape over row pieces: the original ndim and
        # trailing dims, this rank's rows
        "same_ndim": all(isinstance(p, DTensor) and p.shape == r.shape
                         and rows(p).dim() == r.dim() and rows(p).shape[1:] == r.shape[1:]
                         for p, r in zip(m.parameters(), ref.parameters())),
        "local_numel": sum(rows(p).numel() for p in m.parameters()),
        "global_numel": sum(param_info(p).numel for p in m.parameters()),
    }
    # every local piece is the matching slice of the original parameter
    rp = dict(ref.named_parameters())
    out["slices_match"] = all(
        torch.equal(rows(p).detach(), rp[n].detach()[slice(*param_info(p).rows)])
        and torch.equal(rows(p).detach().flatten(),
                        rp[n].detach().flatten()[slice(*param_info(p).local_range)])
        for n, p in m.named_parameters())
    sharded = dict(m.named_parameters())
    # unshard() installs full-shape views with the full values; reshard() undoes it
    m.layers[1].unshard()
    out["unsharded_full"] = all(
        torch.equal(getattr(m.layers[1], a).weight, getattr(ref.layers[1], a).weight)
        for a in ("lin1", "lin2"))
    m.layers[1].reshard()
    out["resharded"] = m.layers[1].lin1.weight is sharded["layers.1.lin1.weight"]
    h = m.layers[0].unshard(async_op=True)
    h.wait()
    out["async_unshard"] = m.layers[0].lin2.weight.shape == ref.layers[0].lin2.weight.shape
    m.layers[0].reshard()
    # forward output equals the reference; eval under no_grad leaves all sharded
    x = torch.randn(4, 3)
    with torch.no_grad():
        out["eval_equal"] = torch.allclose(m(x), ref(x), atol=1e-6)
    out["sharded_after_eval"] = all(
        p is q and rows(p).shape[0] == param_info(p).rows[1] - param_info(p).rows[0]
        for p, q in zip(m.parameters(), sharded.values()))
    # a ProcessGroup as the mesh: the same as the default mesh over the same ranks
    torch.manual_seed(1)
    a = Net()
    b = copy.deepcopy(a)
    fully_shard(a, mesh=dist.group.WORLD)
    fully_shard(b)
    a(x).sum().backward()
    b(x).sum().backward()
    out["process_group_mesh"] = all(
        (p.grad is None and q.grad is None) or torch.equal(rows(p.grad), rows(q.grad))
        for p, q in zip(a.parameters(), b.parameters()))
    return out


@pytest.fixture(scope="module")
def semantics():
    return run_distributed(_semantics, 2)


@pytest.mark.parametrize("key", ["is_fsdp", "keeps_class", "inner_plain", "names_same",
                                 "same_ndim", "slices_match", "unsharded_full", "resharded",
                                 "async_unshard", "eval_equal", "sharded_after_eval",
                                 "process_group_mesh"])
def test_semantics(semantics, key):
    assert all(r[key] for r in semantics), [r[key] for r in semantics]


def test_local_pieces_partition_the_model(semantics):
    # the ranks' pieces add up to the model (no element held twice or lost)
    assert sum(r["local_numel"] for r in semantics) == semantics[0]["global_numel"]
    assert semantics[0]["global_numel"] == sum(p.numel() for p in Net(n=2).parameters())


# --------------------------------------------------------- collective counts
def _counts(rank, world, raf, switch_to=None, per_unit=True):
    torch.manual_seed(0)
    m = shard(Net(n=4), root={}, reshard_after_forward=raf)  # the root: the default
    if per_unit:
        per_unit_collectives(m)
    if switch_to is not None:
        m.set_reshard_after_forward(switch_to)  # recursive: every block
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    per_step = []
    for _ in range(2):
        reset_comm_stats()
        m(torch.randn(4, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        s = comm_stats()
        per_step.append((s.all_gather_calls, s.reduce_scatter_calls, s.all_reduce_calls))
    return per_step


# Step 1's forward agrees on the forward order (docs/design.md, "Units
# skipped on some ranks"): one 8-byte min all-reduce per unit forward start
# and end after the root's (5 units: 9), and one to label checkpoint regions.
_AGREE = 2 * 5 - 1 + 1


@pytest.mark.parametrize("raf,per_unit,expected", [
    # per unit, 4 blocks + root: forward gathers 5; with resharding, backward
    # regathers the 4 blocks; every unit reduce-scatters once
    (True, True, [(9, 5, _AGREE), (9, 5, 0)]),
    (False, True, [(5, 5, _AGREE), (5, 5, 0)]),
    # default 1 MiB buckets; the whole model is 3,104 bytes at 2 ranks (blocks
    # 184 padded floats, root 40), so a bucket takes every unit it may:
    # step 1's forward has no recorded order yet and gathers per unit (5);
    # backward gathers the 4 resharded blocks as ONE bucket (raf=True) or
    # nothing (raf=False); step 2's forward gathers all 5 as one bucket (every
    # unit was resharded after backward). Every backward: one reduce-scatter.
    (True, False, [(5 + 1, 1, _AGREE), (1 + 1, 1, 0)]),
    (False, False, [(5, 1, _AGREE), (1, 1, 0)]),
])
def test_collective_counts(raf, per_unit, expected):
    for per_step in run_distributed(_counts, 2, raf, None, per_unit):
        assert per_step == expected


def test_set_reshard_after_forward_changes_the_schedule():
    for per_step in run_distributed(_counts, 2, True, False):
        assert per_step == [(5, 5, _AGREE), (5, 5, 0)]


@pytest.mark.parametrize("per_unit", [True, False])
def test_world_size_one_issues_no_collectives(per_unit):
    assert run_distributed(_counts, 1, True, None, per_unit)[0] == [(0, 0, 0), (0, 0, 0)]


# ----------------------------------------- world size 1: plain PyTorch's path
def _world_one(rank, world):
    torch.manual_seed(0)
    m = Net(n=2)
    ref = copy.deepcopy(m)
    shard(m)
    m.layers[1].lin2.weight.requires_grad_(False)
    ref.layers[1].lin2.weight.requires_grad_(False)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    out = {"equal": True}
    for step in range(2):
        x = torch.randn(4, 3)
        for model, o in ((m, opt), (ref, ref_opt)):
            model(x).sum().backward()
            if step == 0:
                grads = [p.grad for p in model.parameters()]
            o.step()
            o.zero_grad()
        out["equal"] &= all(torch.equal(p, q) for p, q in zip(m.parameters(), ref.parameters()))
    ps = list(m.parameters())
    out["shapes"] = [tuple(p.shape) for p in ps] == [tuple(q.shape) for q in ref.parameters()]
    out["leaves"] = all(isinstance(p, nn.Parameter) and p.is_leaf for p in ps)
    # each gradient is its own tensor (autograd's), not a view of a flat gradient
    out["own_grads"] = all(g is None or g._base is None for g in grads)
    out["frozen_no_grad"] = m.layers[1].lin2.weight.grad is None
    out["hooks"] = [len(u._forward_pre_hooks) + len(u._forward_hooks)
                    for u in (m.layers[0], m.layers[1], m)]
    info = param_info(m.layers[0].lin1.weight)
    out["info"] = (info.fqn, tuple(info.shape), tuple(info.local_range))
    with torch.no_grad():  # an inner unit called directly, and unshard / reshard on it
        h = torch.randn(4, 6)
        out["direct_call"] = torch.equal(m.layers[0](h), ref.layers[0](h))
        m.layers[0].unshard()
        same = m.layers[0].lin1.weight is ps[2]
        m.layers[0].reshard()
        out["unshard_same_params"] = same and m.layers[0].lin1.weight is ps[2]
    return out


def test_world_size_one_is_plain_pytorch():
    r = run_distributed(_world_one, 1)[0]
    assert r["equal"]                      # bitwise: same kernels, same order
    assert r["shapes"] and r["leaves"] and r["own_grads"] and r["frozen_no_grad"]
    assert r["hooks"] == [0, 0, 2]         # blocks: none; the root keeps its two
    assert r["info"] == ("layers.0.lin1.weight", (13, 6), (0, 78))
    assert r["direct_call"] and r["unshard_same_params"]


def _world_one_compositions(rank, world):
    """Passive units (no hooks) under activation checkpointing around them,
    after an inner unit was the root of its own first call, and next to a unit
    that casts (keeps its hooks): training equals plain PyTorch's."""
    from torch.utils.checkpoint import checkpoint
    out = {}
    for case in ("reentrant", "non_reentrant", "inner_root_first", "one_unit_casts"):
        torch.manual_seed(0)
        m = Net(n=3)
        ref = copy.deepcopy(m)
        for i, layer in enumerate(m.layers):
            cast = case == "one_unit_casts" and i == 1
            fully_shard(layer, mp_policy=fsdp_compose.MixedPrecisionPolicy(
                param_dtype=torch.float64, output_dtype=torch.float32) if cast else None)
        fully_shard(m)
        if case == "inner_root_first":
            with torch.no_grad():
                m.layers[1](torch.randn(2, 6))
        if case in ("reentrant", "non_reentrant"):
            for mod in (m, ref):
                def forward(x, mod=mod):
                    two = lambda y: mod.layers[1](mod.layers[0](y))  # noqa: E731
                    x = checkpoint(two, mod.inp(x), use_reentrant=case == "reentrant")
                    return mod.out(mod.layers[2](x))
                mod.forward = forward
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
        ok = True
        for _ in range(3):
            x = torch.randn(4, 3)
            for mod, o in ((m, opt), (ref, ref_opt)):
                mod(x).pow(2).sum().backward()
                o.step()
                o.zero_grad()
            ok &= all(p.shape == q.shape and torch.allclose(p, q, atol=1e-6)
                      for p, q in zip(m.parameters(), ref.parameters()))
        out[case] = ok
    return out


def test_world_size_one_compositions():
    r = run_distributed(_world_one_compositions, 1)[0]
    assert r == dict.fromkeys(("reentrant", "non_reentrant", "inner_root_first",
                               "one_unit_casts"), True)


# ------------------------------------------- eval calls never see stale shards
def _eval_after_update(rank, world):
    torch.manual_seed(0)
    m = Net(n=2)
    ref = copy.deepcopy(m)
    shard(m)
    m(torch.randn(4, 3)).sum().backward()  # a training step records the order
    m.zero_grad()
    h = torch.randn(4, 6)
    with torch.no_grad():
        m.layers[0](h)  # an inner unit called directly, in eval
        for p, q in zip(m.parameters(), ref.parameters()):  # an in-place update,
            p.add_(0.5)                                     # like optimizer.step()
            q.add_(0.5)
        return torch.allclose(m.layers[1](h), ref.layers[1](h), atol=1e-6)


def test_eval_call_after_update_sees_new_parameters():
    assert all(run_distributed(_eval_after_update, 2))
