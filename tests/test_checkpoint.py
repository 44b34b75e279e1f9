"""Checkpoints: sharded state dicts through DCP, resharding, interop, full state
dicts, optimizer state, and meta-device init.

Three multi-process launches (2, then 1, then 4 ranks; module-scoped fixture)
run every scenario; the tests assert on what the ranks returned. Every rank
also trains a single-process reference model on the same global batches, and
results are compared with it step by step.

The model (tests/_checkpoint_net.py) has what makes checkpoints hard: a tied
embedding/head (one list unit), a float64 parameter next to float32 ones and
a frozen parameter in the root unit, a buffer, parameters whose rows are
split across ranks, and ranks that hold no rows of a parameter (an empty
gradient and empty optimizer state for it). Both layouts (row and tensor
granularity) save, and load each other's and FSDP2's checkpoints at 1, 2
and 4 ranks.
"""
from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import tempfile
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_compose
from fsdp_compose import comm_stats, fully_shard, get_state_dict, reset_comm_stats, set_state_dict

from ._checkpoint_net import Net, make_optim, ours_fresh, shard_fsdp2, shard_ours, train
from ._dist import run_distributed
from ._support import rows

SAVE_AT, STEPS = 3, 6
RTOL, ATOL = 1e-5, 1e-6


def global_losses(per_rank: list[list[float]]) -> list[float]:
    return [sum(xs) / len(xs) for xs in zip(*per_rank)]


def reference(steps) -> tuple[Net, torch.optim.Optimizer, list[float]]:
    torch.manual_seed(0)
    ref = Net()
    opt = make_optim(ref)
    return ref, opt, train(ref, opt, steps, 0, 1)


def local_snapshot(model, opt) -> dict:
    """This rank's parameter shards and optimizer state, by FQN (exact copies
    of the local tensors: this rank's rows)."""
    params = {n: rows(p).detach().clone() for n, p in model.named_parameters()}
    state = {}
    for n, p in model.named_parameters():
        for k, v in opt.state.get(p, {}).items():
            state[f"{n}/{k}"] = rows(v).clone() if isinstance(v, torch.Tensor) else v
    return {"params": params, "state": state}


def snapshots_equal(a: dict, b: dict) -> list[str]:
    bad = []
    for part in ("params", "state"):
        if a[part].keys() != b[part].keys():
            bad.append(f"{part} keys differ: {sorted(a[part].keys() ^ b[part].keys())}")
            continue
        for k in a[part]:
            x, y = a[part][k], b[part][k]
            if isinstance(x, torch.Tensor):
                if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                    bad.append(f"{part} {k}")
            elif x != y:
                bad.append(f"{part} {k}: {x} != {y}")
    return bad


def resume_ours(path: str, seed: int = 1, granularity: str = "row"):
    """A differently-initialised sharded model, loaded from ``path`` (DCP)."""
    model, opt = ours_fresh(seed, granularity)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    return model, opt


def torch_dsd():
    from torch.distributed.checkpoint import state_dict as dsd
    return dsd


def resume_torch(model, path: str):
    """Load ``path`` into a plain or FSDP2 model with torch's own DCP helpers."""
    dsd = torch_dsd()
    opt = make_optim(model)
    msd, osd = dsd.get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    dsd.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    return opt


def save_torch(model, opt, path: str) -> None:
    msd, osd = torch_dsd().get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


# ------------------------------------------------------ collective counting
_COLLECTIVES = ["all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
                "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
                "reduce_scatter_single", "broadcast", "broadcast_object_list", "barrier",
                "gather", "gather_object", "scatter", "scatter_object_list", "reduce",
                "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
                "monitored_barrier"]


@contextlib.contextmanager
def count_collectives():
    """Counts collectives three ways: our comm_stats, torch's CommDebugMode (every
    c10d op that reaches the dispatcher), and patched torch.distributed functions."""
    from torch.distributed import distributed_c10d
    from torch.distributed.tensor.debug import CommDebugMode
    calls: list[str] = []
    counts = {}

    def counting(name, fn):
        def wrapper(*a, **k):
            calls.append(name)
            return fn(*a, **k)
        return wrapper

    with contextlib.ExitStack() as stack:
        for ns in (dist, distributed_c10d):
            for name in _COLLECTIVES:
                if hasattr(ns, name):
                    stack.enter_context(
                        mock.patch.object(ns, name, counting(name, getattr(ns, name))))
        cdm = stack.enter_context(CommDebugMode())
        reset_comm_stats()
        yield counts
    st = comm_stats()
    counts["ours"] = (st.all_gather_calls + st.reduce_scatter_calls + st.all_reduce_calls
                      + st.all_to_all_calls)
    counts["dispatcher"] = cdm.get_total_counts()
    counts["python"] = len(calls)


# ------------------------------------------------------------ rank bodies
def _check_full(full_msd, full_osd, ref, ref_opt) -> list[str]:
    bad = []
    want_msd, want_osd = torch_dsd().get_state_dict(ref, ref_opt)
    if list(full_msd) != list(want_msd):
        bad.append(f"model keys {list(full_msd)} != {list(want_msd)}")
    for k, v in want_msd.items():
        got = full_msd.get(k)
        if not isinstance(got, torch.Tensor) or got.dtype != v.dtype or got.shape != v.shape \
                or not torch.allclose(got, v, rtol=RTOL, atol=ATOL):
            bad.append(f"model {k}")
    if full_osd["param_groups"] != want_osd["param_groups"]:
        bad.append(f"param_groups {full_osd['param_groups']} != {want_osd['param_groups']}")
    if full_osd["state"].keys() != want_osd["state"].keys():
        bad.append(f"optim state keys {sorted(full_osd['state'])} != {sorted(want_osd['state'])}")
    for fqn, st in want_osd["state"].items():
        for k, v in st.items():
            got = full_osd["state"].get(fqn, {}).get(k)
            if not isinstance(got, torch.Tensor) or got.shape != v.shape or \
                    not torch.allclose(got, v, rtol=RTOL, atol=ATOL):
                bad.append(f"optim {fqn} {k}")
    return bad


def _save_run(rank, world, root):
    out = {}
    ours = os.path.join(root, "ours")
    ref, ref_opt, ref_losses = reference(range(SAVE_AT))
    model, opt = ours_fresh(0)
    out["losses_before"] = train(model, opt, range(SAVE_AT), rank, world)

    # model.state_dict(): FSDP2's form; the values are the parameters (RowParam
    # DTensors over our rows): no collective
    with count_collectives() as sharded_counts:
        sd = model.state_dict()
    out["sharded_counts"] = sharded_counts
    out["sd_dtensors"] = sum(isinstance(v, DTensor) for v in sd.values())
    msd, osd = get_state_dict(model, opt)
    out["form_vs_fsdp2"] = _form_vs_fsdp2(model, msd, osd, rank, world)
    with count_collectives() as full_counts:  # the counters do see collectives
        full_msd, full_osd = get_state_dict(model, opt, full_state_dict=True)
        dist.barrier()  # (ours go through our own handle on torch's function)
    out["full_counts"] = full_counts
    out["sd_types"] = sorted({type(v).__name__ for v in sd.values()})
    out["sd_keys"] = list(sd) == list(ref.state_dict())
    out["full_vs_ref"] = _check_full(full_msd, full_osd, ref, ref_opt)
    off_msd, off_osd = get_state_dict(model, opt, full_state_dict=True, cpu_offload=True)
    if rank == 0:
        out["offload_vs_ref"] = _check_full(off_msd, off_osd, ref, ref_opt)
    else:
        out["offload_vs_ref"] = [] if (off_msd, off_osd) == ({}, {}) else ["rank 1 kept data"]

    # save (sharded, through DCP), then go on: the uninterrupted run
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ours)
    at_save = local_snapshot(model, opt)

    # optimizer + model round trip through the full state dict
    train(model, opt, [SAVE_AT], rank, world)       # perturb
    set_state_dict(model, opt, model_state_dict=full_msd, optim_state_dict=full_osd)
    out["full_round_trip"] = [x for x in snapshots_equal(local_snapshot(model, opt), at_save)
                              if not x.startswith("state")] + \
        _close_state(local_snapshot(model, opt), at_save)
    out["uninterrupted"] = train(model, opt, range(SAVE_AT, STEPS), rank, world)

    # resume at the same world size, from DCP: exact state, exact losses
    model2, opt2 = ours_fresh(1)
    out["fresh_differs"] = bool(snapshots_equal(local_snapshot(model2, opt2), at_save))
    model2, opt2 = resume_ours(ours)
    out["dcp_round_trip"] = snapshots_equal(local_snapshot(model2, opt2), at_save)
    out["resumed"] = train(model2, opt2, range(SAVE_AT, STEPS), rank, world)

    # ours (2 ranks) -> torch FSDP2 (2 ranks)
    torch.manual_seed(2)
    f2 = shard_fsdp2(Net())
    f2_opt = resume_torch(f2, ours)
    out["fsdp2_from_ours"] = train(f2, f2_opt, range(SAVE_AT, STEPS), rank, world)

    # torch FSDP2 trains 3 steps from the same init and saves (loaded at 1 and 4 ranks)
    torch.manual_seed(0)
    f2 = shard_fsdp2(Net())
    f2_opt = make_optim(f2)
    out["fsdp2_before"] = train(f2, f2_opt, range(SAVE_AT), rank, world)
    save_torch(f2, f2_opt, os.path.join(root, "fsdp2"))
    out["ref_losses"] = ref_losses
    out["meta"] = _meta_parity(rank, world)
    out.update(_tensor_layout_save(rank, world, root, ref, ref_opt))
    out.update(_switch_layouts(rank, world, root))
    return out


def _form(v) -> tuple:
    """Type, global shape, placements (our RowShard == Shard(0)), mesh, dtype;
    not the local shape: our rows are not torch.chunk's."""
    if isinstance(v, DTensor):
        return ("DTensor", tuple(v.shape), tuple(v.placements), tuple(v.device_mesh.shape),
                v.dtype)
    return (type(v).__name__, tuple(v.shape) if isinstance(v, torch.Tensor) else None)


def _value_vs_fsdp2(what: str, got, want, rows_here: tuple) -> list[str]:
    """A DTensor value (``want``: FSDP2's): ours holds the same full value, and
    its local tensor is this rank's rows ``rows_here`` of it (collectives:
    every rank calls this for the same keys)."""
    if not isinstance(want, DTensor) or not isinstance(got, DTensor):
        return []  # (a form that differs is reported by _form)
    full, want_full = got.full_tensor(), want.full_tensor()
    bad = [] if torch.allclose(full, want_full, rtol=RTOL, atol=ATOL) else [f"{what}: full value"]
    a, b = rows_here
    if not torch.equal(got.to_local(), full[a:b]):
        bad.append(f"{what}: local tensor {tuple(got.to_local().shape)} is not rows {rows_here}")
    return bad


def _form_vs_fsdp2(model, msd, osd, rank, world) -> list[str]:
    """Each value's type, global shape, placements, mesh and dtype against torch
    FSDP2's state dicts of the same model (trained the same steps); each DTensor's
    full value against FSDP2's, its local tensor this rank's rows."""
    torch.manual_seed(0)
    f2 = shard_fsdp2(Net())
    f2_opt = make_optim(f2)
    train(f2, f2_opt, range(SAVE_AT), rank, world)
    want_msd, want_osd = torch_dsd().get_state_dict(f2, f2_opt)

    def rows_of(fqn):
        return fsdp_compose.param_info(model.get_parameter(fqn)).rows

    bad = [f"model keys {list(msd)} != {list(want_msd)}"] if list(msd) != list(want_msd) else []
    bad += [f"model {k}: {_form(msd.get(k))} != {_form(v)}" for k, v in want_msd.items()
            if _form(msd.get(k)) != _form(v)]
    for k, v in want_msd.items():
        if isinstance(v, DTensor):
            bad += _value_vs_fsdp2(f"model {k}", msd.get(k), v, rows_of(k))
    for fqn, st in want_osd["state"].items():
        for k, v in st.items():
            got = osd["state"].get(fqn, {}).get(k)
            if _form(got) != _form(v):
                bad.append(f"optim {fqn} {k}: {_form(got)} != {_form(v)}")
            if isinstance(v, DTensor):
                bad += _value_vs_fsdp2(f"optim {fqn} {k}", got, v, rows_of(fqn))
    return bad


def _tensor_layout_save(rank, world, root, ref, ref_opt) -> dict:
    """The tensor layout (each parameter whole on one rank; the others keep no
    optimizer state for it): full state dicts, an exact DCP round trip, and a
    save that the other layouts and world sizes load."""
    out = {}
    model, opt = ours_fresh(0, "tensor")
    out["tensor_before"] = train(model, opt, range(SAVE_AT), rank, world)
    full_msd, full_osd = get_state_dict(model, opt, full_state_dict=True)
    out["tensor_full_vs_ref"] = _check_full(full_msd, full_osd, ref, ref_opt)
    off_msd, off_osd = get_state_dict(model, opt, full_state_dict=True, cpu_offload=True)
    if rank == 0:
        out["tensor_full_vs_ref"] += _check_full(off_msd, off_osd, ref, ref_opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "ours_tensor"))
    at_save = local_snapshot(model, opt)
    model2, opt2 = resume_ours(os.path.join(root, "ours_tensor"), granularity="tensor")
    out["tensor_dcp_round_trip"] = snapshots_equal(local_snapshot(model2, opt2), at_save)
    train(model2, opt2, [SAVE_AT], rank, world)  # perturb, then load the full state dict
    set_state_dict(model2, opt2, model_state_dict=full_msd, optim_state_dict=full_osd)
    out["tensor_full_round_trip"] = snapshots_equal(local_snapshot(model2, opt2), at_save)
    out["meta_tensor"] = _meta_parity(rank, world, "tensor")
    return out


def _switch_layouts(rank, world, root) -> dict:
    """Row <-> tensor <-> FSDP2: each loads the others' checkpoints (run at
    every world size; the checkpoints were saved at 2 ranks)."""
    out = {}
    model, opt = resume_ours(os.path.join(root, "ours"), granularity="tensor")
    out["tensor_from_row"] = train(model, opt, range(SAVE_AT, STEPS), rank, world)
    model, opt = resume_ours(os.path.join(root, "ours_tensor"))
    out["row_from_tensor"] = train(model, opt, range(SAVE_AT, STEPS), rank, world)
    model, opt = resume_ours(os.path.join(root, "fsdp2"), seed=3, granularity="tensor")
    out["tensor_from_fsdp2"] = train(model, opt, range(SAVE_AT, STEPS), rank, world)
    torch.manual_seed(2)
    f2 = shard_fsdp2(Net())
    f2_opt = resume_torch(f2, os.path.join(root, "ours_tensor"))
    out["fsdp2_from_tensor"] = train(f2, f2_opt, range(SAVE_AT, STEPS), rank, world)
    return out


def _close_state(a, b) -> list[str]:
    return [k for k in a["state"] if not torch.allclose(torch.as_tensor(a["state"][k]),
                                                         torch.as_tensor(b["state"][k]),
                                                         rtol=RTOL, atol=ATOL)]


def _resume_run(rank, world, root):
    """At 1 or 4 ranks: resume ours, load FSDP2's and a plain module's checkpoints."""
    out = {}
    model, opt = resume_ours(os.path.join(root, "ours"))
    out["resumed"] = train(model, opt, range(SAVE_AT, STEPS), rank, world)
    model, opt = resume_ours(os.path.join(root, "fsdp2"), seed=3)
    out["from_fsdp2"] = train(model, opt, range(SAVE_AT, STEPS), rank, world)
    if world == 1:
        # ours (saved at 2) -> a plain nn.Module; and a plain module saves
        torch.manual_seed(4)
        plain = Net()
        opt = resume_torch(plain, os.path.join(root, "ours"))
        out["plain_from_ours"] = train(plain, opt, range(SAVE_AT, STEPS), rank, world)
        plain, opt, _ = reference(range(SAVE_AT))
        save_torch(plain, opt, os.path.join(root, "plain"))
        out["errors"] = _load_errors()
        out.update(_save_at_1(root, plain, opt))
    else:
        model, opt = resume_ours(os.path.join(root, "plain"), seed=5)
        out["from_plain"] = train(model, opt, range(SAVE_AT, STEPS), rank, world)
        model, opt = resume_ours(os.path.join(root, "ours_ws1"), seed=6)
        out["from_ws1"] = train(model, opt, range(SAVE_AT, STEPS), rank, world)
    out["meta"] = _meta_parity(rank, world)
    out["meta_tensor"] = _meta_parity(rank, world, "tensor")
    out.update(_switch_layouts(rank, world, root))
    return out


def _save_at_1(root, ref, ref_opt) -> dict:
    """Ours at 1 rank, where parameters and optimizer state keep their shapes
    (docs/design.md, "World size 1"): state dicts and a save for the 4-rank run."""
    out = {}
    model, opt = ours_fresh(0)
    train(model, opt, range(SAVE_AT), 0, 1)
    out["ws1_shapes"] = [(n, tuple(p.shape), tuple(opt.state[p]["exp_avg"].shape))
                         for n, p in model.named_parameters() if p.requires_grad]
    full_msd, full_osd = get_state_dict(model, opt, full_state_dict=True)
    out["ws1_full_vs_ref"] = _check_full(full_msd, full_osd, ref, ref_opt)
    msd, osd = get_state_dict(model, opt)
    out["ws1_exp_avg_types"] = {type(st["exp_avg"]).__name__ for st in osd["state"].values()}
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "ours_ws1"))
    at_save = local_snapshot(model, opt)
    model2, opt2 = resume_ours(os.path.join(root, "ours_ws1"))
    out["ws1_dcp_round_trip"] = snapshots_equal(local_snapshot(model2, opt2), at_save)
    train(model2, opt2, [SAVE_AT], 0, 1)  # perturb, then load the full state dict
    set_state_dict(model2, opt2, model_state_dict=full_msd, optim_state_dict=full_osd)
    out["ws1_full_round_trip"] = snapshots_equal(local_snapshot(model2, opt2), at_save)
    return out


def _load_errors() -> dict:
    model, opt = ours_fresh(0)
    errs = {}
    sd = {k: v for k, v in Net().state_dict().items()}
    sd["layers.0.lin1.weight"] = torch.zeros(3, 3)
    try:
        model.load_state_dict(sd)
    except RuntimeError as e:
        errs["shape"] = str(e)
    try:
        get_state_dict(model, opt, cpu_offload=True)
    except ValueError as e:
        errs["offload"] = str(e)
    # full tensors load (each rank copies its piece)
    torch.manual_seed(7)
    src = Net()
    model.load_state_dict(src.state_dict())
    full, _ = get_state_dict(model, [], full_state_dict=True)
    errs["full_load_ok"] = all(torch.equal(full[k], v) for k, v in src.state_dict().items())
    return errs


class NoInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.w = nn.Parameter(torch.ones(4))  # no reset_parameters initialises it

    def forward(self, x):
        return self.lin(x) * self.w.sum()


def _meta_parity(rank, world, granularity="row") -> dict:
    """meta build + fully_shard + materialize == eager build, bitwise, same RNG after."""
    torch.manual_seed(0)
    eager = Net()
    rng_eager = torch.get_rng_state()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Net()
    shard_ours(model, granularity)
    fsdp_compose.materialize(model)
    out = {"rng": torch.equal(torch.get_rng_state(), rng_eager)}
    full, _ = get_state_dict(model, [], full_state_dict=True)
    want = eager.state_dict()
    out["diff"] = [k for k, v in want.items()
                   if k not in full or full[k].dtype != v.dtype or not torch.equal(full[k], v)]
    out["tied"] = model.head.weight is model.embed.weight
    out["frozen"] = not model.norm.bias.requires_grad
    # the path before a Hugging Face save_pretrained: full, on CPU, on rank 0, no optimizer
    off, off_osd = get_state_dict(model, [], full_state_dict=True, cpu_offload=True)
    if rank == 0:
        out["offload_no_optim"] = [k for k, v in want.items() if k not in off
                                   or off[k].device.type != "cpu" or not torch.equal(off[k], v)]
        out["offload_no_optim"] += [] if off_osd == {} else [f"optim {off_osd}"]
    else:
        out["offload_no_optim"] = [] if (off, off_osd) == ({}, {}) else ["kept data"]
    out["loss"] = train(model, make_optim(model), range(1), rank, world)
    with torch.device("meta"):
        bad = NoInit()
    fully_shard(bad)
    try:
        fsdp_compose.materialize(bad)
        out["error"] = "no error"
    except RuntimeError as e:
        out["error"] = str(e)
    return out


# ------------------------------------------------------------------ fixture
@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory(prefix="fsdp_ckpt_") as root:
        res = {2: run_distributed(_save_run, 2, root)}
        res[1] = run_distributed(_resume_run, 1, root)
        res[4] = run_distributed(_resume_run, 4, root)
        res["ref"] = reference(range(STEPS))[2]
        res["files"] = _tools_check(os.path.join(root, "ours"), root)
        yield res


def _close(a, b) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=RTOL, abs_tol=ATOL)
                                    for x, y in zip(a, b))


# -------------------------------------------------------------------- tests
def test_state_dicts_take_fsdp2s_form(runs):
    for r in runs[2]:
        # the values are the sharded parameters themselves (RowParam DTensors
        # over our rows): no collective at all (no all-to-all to torch.chunk's
        # split any more); the full state dict gathers
        assert r["sd_dtensors"] > 0
        assert r["sharded_counts"] == {"ours": 0, "dispatcher": 0, "python": 0}, \
            r["sharded_counts"]
        assert all(v > 0 for v in r["full_counts"].values()), r["full_counts"]
        assert r["sd_types"] == ["RowParam", "Tensor"]  # parameters; the buffer
        assert r["sd_keys"]
        assert r["form_vs_fsdp2"] == []


def test_full_state_dict_equals_reference(runs):
    for r in runs[2]:
        assert r["full_vs_ref"] == []
        assert r["offload_vs_ref"] == []


def test_optimizer_state_round_trip(runs):
    for r in runs[2]:
        assert r["fresh_differs"]          # the check below can fail
        assert r["dcp_round_trip"] == []   # exact, through DCP
        assert r["full_round_trip"] == []  # through full tensors


def test_save_at_1_rank_full_shapes(runs):
    r = runs[1][0]
    ref = dict(Net().named_parameters())
    assert r["ws1_shapes"] and all(p == s == tuple(ref[n].shape) for n, p, s in r["ws1_shapes"])
    assert r["ws1_full_vs_ref"] == []
    assert r["ws1_exp_avg_types"] == {"DTensor"}  # per-element state, as FSDP2's
    assert r["ws1_dcp_round_trip"] == []
    assert r["ws1_full_round_trip"] == []
    # saved at 1 rank, resumed at 4
    assert _close(global_losses([r["from_ws1"] for r in runs[4]]), runs["ref"][SAVE_AT:])


def test_resume_at_1_2_4_ranks_matches_uninterrupted(runs):
    ref = runs["ref"]
    assert _close(global_losses([r["losses_before"] for r in runs[2]]), ref[:SAVE_AT])
    uninterrupted = global_losses([r["uninterrupted"] for r in runs[2]])
    assert _close(uninterrupted, ref[SAVE_AT:])
    # same world size: bit-identical to not stopping
    assert global_losses([r["resumed"] for r in runs[2]]) == uninterrupted
    for world in (1, 4):
        assert _close(global_losses([r["resumed"] for r in runs[world]]), ref[SAVE_AT:]), world


def test_dcp_interop_plain_module(runs):
    ref = runs["ref"][SAVE_AT:]
    assert _close(runs[1][0]["plain_from_ours"], ref)                        # ours -> plain
    assert _close(global_losses([r["from_plain"] for r in runs[4]]), ref)    # plain -> ours


def test_dcp_interop_torch_fsdp2(runs):
    ref = runs["ref"]
    assert _close(global_losses([r["fsdp2_before"] for r in runs[2]]), ref[:SAVE_AT])
    assert _close(global_losses([r["fsdp2_from_ours"] for r in runs[2]]), ref[SAVE_AT:])
    for world in (1, 4):  # FSDP2 (saved at 2) -> ours at 1 and 4
        assert _close(global_losses([r["from_fsdp2"] for r in runs[world]]), ref[SAVE_AT:])


def test_load_errors_name_the_fqn(runs):
    errs = runs[1][0]["errors"]
    assert "'layers.0.lin1.weight'" in errs["shape"] and "(3, 3)" in errs["shape"] \
        and "(17, 8)" in errs["shape"], errs["shape"]
    assert "full_state_dict=True" in errs["offload"]
    assert errs["full_load_ok"]


# -------------------------------------------------------------------- tools
def _tools_check(path: str, root: str) -> dict:
    from tools import dcp_inspect, dcp_to_torch
    out = {}
    pt = os.path.join(root, "model.pt")
    dcp_to_torch.main([path, pt])
    out["pt"] = torch.load(pt, weights_only=False)
    st = os.path.join(root, "model.safetensors")
    dcp_to_torch.main([path, st, "--key", "model"])
    from safetensors.torch import load_file
    out["st"] = load_file(st)
    lines = dcp_inspect.describe(path)
    out["inspect"] = lines
    help_ = subprocess.run([sys.executable, "-m", "tools.dcp_to_torch", "--help"],
                           capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(
                               os.path.abspath(__file__))))
    out["help"] = help_.stdout
    return out


def test_tools_convert_and_inspect(runs):
    files = runs["files"]
    torch.manual_seed(0)
    ref = Net()
    ref_sd = ref.state_dict()
    pt = files["pt"]
    assert set(pt) == {"model", "optim"}
    assert pt["model"].keys() == ref_sd.keys()
    assert {k: (v.shape, v.dtype) for k, v in pt["model"].items()} == \
        {k: (v.shape, v.dtype) for k, v in ref_sd.items()}
    assert files["st"].keys() == ref_sd.keys()
    assert all(torch.equal(files["st"][k], pt["model"][k]) for k in ref_sd)
    plain = Net()
    plain.load_state_dict(files["st"])                  # loads into a plain module
    assert any("embed.weight" in line and "(13, 8)" in line and "float32" in line
               for line in files["inspect"]), files["inspect"]
    assert any("scale.w" in line and "float64" in line for line in files["inspect"])
    assert "usage" in files["help"]


@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_meta_init_parity_bitwise(runs, world, granularity):
    ref = runs["ref"]
    key = "meta" if granularity == "row" else "meta_tensor"
    for r in runs[world]:
        m = r[key]
        assert m["diff"] == [] and m["rng"] and m["tied"] and m["frozen"]
    assert _close(global_losses([r[key]["loss"] for r in runs[world]]), ref[:1])
    err = runs[world][0][key]["error"]
    assert "1 parameter(s)/buffer(s) were not initialised: w." in err, err


def test_tensor_layout_state_dicts(runs):
    ref = runs["ref"]
    assert _close(global_losses([r["tensor_before"] for r in runs[2]]), ref[:SAVE_AT])
    for r in runs[2]:
        assert r["tensor_full_vs_ref"] == []      # also where a rank keeps no state
        assert r["tensor_dcp_round_trip"] == []   # exact, through DCP
        assert r["tensor_full_round_trip"] == []  # through full tensors


@pytest.mark.parametrize("switch", ["tensor_from_row", "row_from_tensor", "tensor_from_fsdp2",
                                    "fsdp2_from_tensor"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_switch_layout_between_save_and_load(runs, world, switch):
    # saved at 2 ranks in one layout, resumed at 1, 2 and 4 in another
    assert _close(global_losses([r[switch] for r in runs[world]]), runs["ref"][SAVE_AT:])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_full_state_dict_on_cpu_without_optimizer(runs, world):
    # get_state_dict(model, [], full_state_dict=True, cpu_offload=True): rank 0
    # gets the unsharded model's values on CPU, the others empty dicts
    assert [r["meta"]["offload_no_optim"] for r in runs[world]] == [[]] * world
