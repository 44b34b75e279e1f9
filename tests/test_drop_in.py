"""What a stack written for FSDP2 touches, on our units (issue: the
ecosystem's contract): torch's policy objects, ``isinstance`` with torch's
``FSDPModule`` and its methods, ``set_gradient_divide_factor``, torch's
``get_total_norm`` + ``clip_grads_with_norm_`` (torchtitan's clipping), a
state dict taken on the meta device and loaded with ``assign=True``
(accelerate's ``cpu_ram_efficient_loading``), HSDP state dicts against
FSDP2's, and the refusal of FSDP2's all-gather extension."""
from __future__ import annotations

import contextlib
import copy
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import fsdp_compose
from fsdp_compose import fully_shard

from ._checkpoint_net import V, Net, batch, shard_fsdp2, shard_ours, train
from ._dist import run_distributed
from ._support import OnFirstUse, OptimizerContainer, rows, two_lanes_forced

TIMEOUT = 120


def _full(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _grads_full(model) -> dict:
    """Every parameter's gradient, whole (our row pieces gathered over the ranks)."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if isinstance(g, DTensor):
            out[n] = g.full_tensor()
            continue
        hit = fsdp_compose._base._registry.SHARDED.get(p)
        if hit is not None:  # (every rank gathers: a rank holding no rows may have no grad)
            out[n] = fsdp_compose.checkpoint._checkpoint.gather_entry(
                hit[0], hit[1], g if g is not None else torch.zeros_like(rows(p)))
        elif g is not None:
            out[n] = g
    return out


def _run(rank, world):
    out = {}
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    # torch's policy objects, and torch's FSDPModule
    torch.manual_seed(0)
    m = Net()
    for layer in m.layers:
        fully_shard(layer, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                          reduce_dtype=torch.float32,
                                                          output_dtype=torch.float32),
                    offload_policy=OffloadPolicy())
    fully_shard([m.embed, m.head])
    fully_shard(m)
    out["isinstance"] = isinstance(m, TorchFSDPModule) and isinstance(m.layers[0], TorchFSDPModule)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    out["mp_losses"] = train(m, opt, range(2), rank, world)
    torch.manual_seed(0)
    m2 = Net()
    for layer in m2.layers:
        fully_shard(layer, mp_policy=fsdp_compose.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32))
    fully_shard([m2.embed, m2.head])
    fully_shard(m2)
    out["mp_losses_ours"] = train(m2, torch.optim.AdamW(m2.parameters(), lr=1e-2), range(2),
                                  rank, world)

    # set_gradient_divide_factor(1.0): summed gradients, as FSDP2's
    grads = {}
    for impl in ("ours", "fsdp2"):
        torch.manual_seed(0)
        model = shard_ours(Net()) if impl == "ours" else shard_fsdp2(Net())
        for mod in model.modules():
            if isinstance(mod, TorchFSDPModule):
                mod.set_gradient_divide_factor(1.0)
                mod.set_force_sum_reduction_for_comms(True)  # (gloo has no PREMUL_SUM)
        tok, tgt = batch(0, rank, world)
        F.cross_entropy(model(tok).reshape(-1, V), tgt.reshape(-1)).backward()
        grads[impl] = _grads_full(model)
    torch.manual_seed(0)
    ref = Net()
    tok, tgt = batch(0, 0, 1)
    F.cross_entropy(ref(tok).reshape(-1, V), tgt.reshape(-1)).backward()
    out["sum_vs_fsdp2"] = [n for n in grads["fsdp2"]
                           if not torch.allclose(grads["ours"][n], grads["fsdp2"][n],
                                                 rtol=1e-5, atol=1e-6)]
    out["sum_vs_ref"] = [n for n, p in ref.named_parameters() if p.grad is not None
                         and not torch.allclose(grads["ours"][n], world * p.grad,
                                                rtol=1e-5, atol=1e-6)]

    # torchtitan's clipping: get_total_norm on the gradients, clip_grads_with_norm_
    torch.manual_seed(0)
    model = shard_ours(Net())
    tok, tgt = batch(0, rank, world)
    F.cross_entropy(model(tok).reshape(-1, V), tgt.reshape(-1)).backward()
    gs = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(gs, 2.0)
    torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), 0.5, total)
    torch.manual_seed(0)
    ref = Net()
    tok, tgt = batch(0, 0, 1)
    F.cross_entropy(ref(tok).reshape(-1, V), tgt.reshape(-1)).backward()
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    out["norm"] = (float(total), float(ref_total))
    clipped = _grads_full(model)
    out["clipped_vs_ref"] = [n for n, p in ref.named_parameters() if p.grad is not None
                             and not torch.allclose(clipped[n], p.grad, rtol=1e-4, atol=1e-6)]

    # torch's full state dicts: taken on every rank, loaded with broadcast_from_rank0
    from torch.distributed.checkpoint import state_dict as dsd
    torch.manual_seed(0)
    model = shard_ours(Net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, range(2), rank, world)
    full_opts = dsd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = dsd.get_state_dict(model, opt, options=full_opts)
    # (torch's full optimizer state dict shares CPU tensors such as `step` with the
    # live state, for FSDP2 too: keep a copy from this point)
    msd, osd = copy.deepcopy(msd), copy.deepcopy(osd)
    ref_losses = train(model, opt, range(2, 4), rank, world)
    torch.manual_seed(1)
    fresh = shard_ours(Net())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    bcast = dsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # (set_model/optimizer_state_dict: set_state_dict takes {} on a rank for "optimizer only")
    dsd.set_model_state_dict(fresh, msd if rank == 0 else {}, options=bcast)
    dsd.set_optimizer_state_dict(fresh, fresh_opt, osd if rank == 0 else {}, options=bcast)
    out["broadcast_resume"] = (train(fresh, fresh_opt, range(2, 4), rank, world), ref_losses)

    # optimizer.load_state_dict before the optimizer's first step (two param
    # groups): the DTensors it holds are converted at that step
    def two_groups(m):
        ps = list(m.parameters())
        return torch.optim.AdamW([{"params": ps[:3]}, {"params": ps[3:], "lr": 2e-2}], lr=1e-2)
    torch.manual_seed(0)
    model = shard_ours(Net())
    opt = two_groups(model)
    train(model, opt, range(2), rank, world)
    msd, osd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    want = train(model, opt, range(2, 4), rank, world)
    torch.manual_seed(1)
    fresh = shard_ours(Net())
    fresh_opt = two_groups(fresh)
    fresh.load_state_dict(msd)
    fresh_opt.load_state_dict(osd)
    out["load_before_first_step"] = (train(fresh, fresh_opt, range(2, 4), rank, world), want)

    # an optimizer container (torchtitan's OptimizersContainer): checked by what it holds
    torch.manual_seed(0)
    model = shard_ours(Net())
    params = list(model.parameters())
    inner = [torch.optim.AdamW(params[:3], lr=1e-2), torch.optim.AdamW(params[3:], lr=1e-2)]
    out["container"] = train(model, OptimizerContainer(params, inner), range(2), rank, world)
    torch.manual_seed(0)
    model = shard_ours(Net())
    out["plain"] = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), range(2),
                         rank, world)
    try:
        _Unknown(model.parameters()).step()
        out["unknown"] = None
    except RuntimeError as e:
        out["unknown"] = str(e)

    # accelerate's cpu_ram_efficient_loading: a state dict on meta, loaded with assign=True
    torch.manual_seed(0)
    full = Net().state_dict()
    with torch.device("meta"):
        torch.manual_seed(0)
        meta = Net()
    shard_ours(meta)
    msd = meta.state_dict()
    out["meta_sd"] = sorted({("DTensor" if isinstance(v, DTensor) else type(v).__name__,
                              v.device.type) for v in msd.values()})
    from torch.distributed.tensor import distribute_tensor
    sharded = {}
    for k, v in msd.items():
        if isinstance(v, DTensor):
            sharded[k] = distribute_tensor(full[k], v.device_mesh, v.placements)
        else:
            sharded[k] = full[k]
    meta.load_state_dict(sharded, assign=True)
    got = _full(meta)
    out["meta_assign"] = [k for k, v in full.items() if not torch.equal(got[k], v)]
    out["meta_trains"] = train(meta, torch.optim.AdamW(meta.parameters(), lr=1e-2), range(2),
                               rank, world)
    torch.manual_seed(0)
    eager = shard_ours(Net())
    out["eager_trains"] = train(eager, torch.optim.AdamW(eager.parameters(), lr=1e-2), range(2),
                                rank, world)
    return out


class _Unknown(torch.optim.Optimizer):
    """An optimizer of its own: refused on row pieces unless declared."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        pass


@pytest.fixture(scope="module")
def runs():
    """world size (2 or 4) -> per-rank results: one launch per world size a test uses."""
    return OnFirstUse(lambda w: run_distributed(_run, w, timeout=TIMEOUT))


@pytest.mark.parametrize("world", [2, 4])
def test_torch_policies_and_fsdp_module(runs, world):
    for r in runs[world]:
        assert r["isinstance"]
        assert r["mp_losses"] == r["mp_losses_ours"]


@pytest.mark.fast
def test_every_public_method_of_torchs_fsdp_module_is_ours():
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    public = [n for n, v in vars(TorchFSDPModule).items()
              if not n.startswith("_") and callable(v)]
    assert public  # (the check below can fail)
    missing = [n for n in public if n not in vars(fsdp_compose.FSDPModule)]
    assert missing == []
    for n in public:  # FSDP2's signature: the same parameter names
        ours = inspect.signature(getattr(fsdp_compose.FSDPModule, n)).parameters
        theirs = inspect.signature(getattr(TorchFSDPModule, n)).parameters
        assert list(ours) == list(theirs), n


@pytest.mark.parametrize("world", [2, 4])
def test_gradient_divide_factor_sums_as_fsdp2(runs, world):
    for r in runs[world]:
        assert r["sum_vs_fsdp2"] == [] and r["sum_vs_ref"] == []


@pytest.mark.parametrize("world", [2, 4])
def test_get_total_norm_is_global(runs, world):
    for r in runs[world]:
        total, ref = r["norm"]
        assert total == pytest.approx(ref, rel=1e-5)
        assert r["clipped_vs_ref"] == []


@pytest.mark.parametrize("world", [2, 4])
def test_torch_full_state_dict_broadcast_from_rank0_resumes(runs, world):
    for r in runs[world]:
        got, want = r["broadcast_resume"]
        assert got == want


@pytest.mark.parametrize("world", [2, 4])
def test_optimizer_state_loaded_before_the_first_step(runs, world):
    for r in runs[world]:
        got, want = r["load_before_first_step"]
        assert got == want


@pytest.mark.parametrize("world", [2, 4])
def test_optimizer_container_is_checked_by_what_it_holds(runs, world):
    for r in runs[world]:
        assert r["container"] == r["plain"]
        assert r["unknown"] and "declare_optimizer(_Unknown" in r["unknown"]


@pytest.mark.parametrize("world", [2, 4])
def test_meta_state_dict_loads_with_assign(runs, world):
    for r in runs[world]:
        assert r["meta_sd"] == [("DTensor", "meta"), ("Tensor", "meta")]
        assert r["meta_assign"] == []
        assert r["meta_trains"] == r["eager_trains"]


class _WithExtension(torch.Tensor):
    """A tensor subclass that declares FSDP2's all-gather extension but is no
    traceable wrapper subclass (no __tensor_flatten__): we cannot rebuild it
    around a rank's rows, so it is refused (tests/test_all_gather_extension.py
    has the supported cases and the other refusals)."""

    def fsdp_pre_all_gather(self, mesh):  # pragma: no cover - never called
        raise AssertionError

    def fsdp_post_all_gather(self, *args):  # pragma: no cover - never called
        raise AssertionError


def _refuse(rank, world):
    lin = nn.Linear(4, 4)
    lin.weight = nn.Parameter(lin.weight.detach().as_subclass(_WithExtension))
    try:
        fully_shard(lin)
    except NotImplementedError as e:
        return str(e)
    return None


def test_all_gather_extension_is_refused_naming_the_parameter():
    for msg in run_distributed(_refuse, 2, timeout=TIMEOUT):
        assert msg and "'weight'" in msg and "fsdp_pre_all_gather" in msg


def _full_state(model, opt) -> dict:
    """The whole model and optimizer state (every rank gathers), copied."""
    from torch.distributed.checkpoint import state_dict as dsd
    msd, osd = dsd.get_state_dict(model, opt,
                                  options=dsd.StateDictOptions(full_state_dict=True))
    return copy.deepcopy({"model": msd, "optim": osd})


def _state_differences(got: dict, want: dict) -> list[str]:
    """Where two ``_full_state`` differ, bit for bit."""
    bad = []
    pairs = [(f"model {k}", got["model"].get(k), v) for k, v in want["model"].items()]
    pairs += [(f"optim {fqn} {k}", got["optim"]["state"].get(fqn, {}).get(k), v)
              for fqn, st in want["optim"]["state"].items() for k, v in st.items()]
    for what, x, y in pairs:
        if isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                bad.append(what)
        elif x != y:
            bad.append(f"{what}: {x!r} != {y!r}")
    if got["model"].keys() != want["model"].keys():
        bad.append(f"model keys {sorted(got['model'].keys() ^ want['model'].keys())}")
    if got["optim"]["state"].keys() != want["optim"]["state"].keys():
        bad.append("optimizer state keys differ")
    if got["optim"]["param_groups"] != want["optim"]["param_groups"]:
        bad.append("param_groups differ")
    return bad


def _uneven_round_trip(rank, world, root, lanes=False):
    """Ours with every row layout forced to uneven pieces (what groups get at
    hundreds of ranks; ``lanes``: in two lanes wherever they are better at
    all, [Note: lanes] in _layout.py, what coarse rows get at thousands): a
    DCP save through torch's get_state_dict loads bit-exactly in ours
    (uneven again) and in FSDP2, and resumes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd

    from fsdp_compose._plan import _layout
    from fsdp_compose._base._registry import unit_of

    def ours(seed):
        torch.manual_seed(seed)
        _layout.FORCE_EVEN = False
        try:
            with two_lanes_forced() if lanes else contextlib.nullcontext():
                m = shard_ours(Net())
        finally:
            _layout.FORCE_EVEN = None
        units = {id(u): u for u in map(unit_of, m.modules()) if u is not None}
        assert not all(g.layout.even for u in units.values() for g in u.groups)
        assert any(g.layout.lanes for u in units.values() for g in u.groups) == lanes
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    model, opt = ours(0)
    train(model, opt, range(2), rank, world)
    msd, osd = dsd.get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=root)
    saved = _full_state(model, opt)
    out = {"uninterrupted": train(model, opt, range(2, 4), rank, world)}
    for name, make in (("ours", lambda: ours(1)),
                       ("fsdp2", lambda: (lambda m: (m, torch.optim.AdamW(m.parameters(),
                                                                          lr=1e-2)))(
                           shard_fsdp2((torch.manual_seed(1), Net())[1])))):
        m, o = make()
        msd, osd = dsd.get_state_dict(m, o)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=root)
        dsd.set_state_dict(m, o, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        out[f"{name}_state"] = _state_differences(_full_state(m, o), saved)
        out[name] = train(m, o, range(2, 4), rank, world)
    return out


# After the resume, FSDP2 sums each gradient element over the W ranks in
# another order than ours: gloo's ring all-reduce adds an element's W terms in
# a rank order fixed by the chunk (of W) of the buffer it lies in, and an
# element lies in another chunk of FSDP2's buffer than of ours (our uneven
# pieces). At W = 3 and 4, 92 and 137 of the 727 reduced gradient elements
# differ, by up to 7e-6 relative (where the terms cancel). The first loss
# comes before any of that: bitwise. One AdamW step (lr 1e-2, Adam's 3rd: the
# new gradient enters m with weight 0.1 and v with 0.001, so m^/sqrt(v^) moves
# by at most ~0.6x the gradient's relative change) leaves the parameters
# <= lr * 0.6 * 7e-6 + 1 ulp ~ 6e-8 apart (measured: 1 ulp, 1.5e-8); the next
# local loss then moves by at most |dL/dtheta|_1 * 6e-8 <= 90 * 6e-8 ~ 5e-6,
# 2e-6 relative (losses >= 2.9). Measured: 0 (AdamW's rounding absorbed it).
# A learning rate 1% off moves it by >= 5e-4.
RESUME_LOSS_RTOL = 1e-5


@pytest.mark.parametrize("world,lanes", [(3, False), (4, False), (3, True)])
def test_uneven_pieces_checkpoint_round_trip(world, lanes, tmp_path):
    for r in run_distributed(_uneven_round_trip, world, str(tmp_path / "ckpt"), lanes,
                             timeout=TIMEOUT):
        # the loaded state is the saved one, bit for bit
        assert r["ours_state"] == [] and r["fsdp2_state"] == []
        # ours: the same layout, so the same reductions in the same order: bitwise
        assert r["ours"] == r["uninterrupted"]
        # FSDP2: the first loss bitwise (same parameters, same forward), the
        # next one after gradients summed in another order (see above)
        got, want = r["fsdp2"], r["uninterrupted"]
        assert got[0] == want[0], (got, want)
        assert got[1] == pytest.approx(want[1], rel=RESUME_LOSS_RTOL, abs=0), (got, want)
