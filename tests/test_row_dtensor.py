"""Sharded parameters as DTensors (fsdp_compose/_group/_row_dtensor.py, docs/dtensor-params.md).

One worker per world size (2 and 4 gloo ranks) builds RowParams over uneven
splits with empty pieces (first, middle and last rank) and records, per
check, what it got; the tests compare each with the unsharded computation.
Covered:

- ``RowShard`` data movement: ``full_tensor``, ``redistribute`` to
  ``Replicate``, ``Shard(1)`` and ``Shard(0)`` (torch.chunk's), ``Partial ->
  RowShard``, ``Replicate -> RowShard``, ``distribute_tensor`` with a
  RowParam's placements, DCP's chunk offsets;
- its identity: ``== Shard(0)``, split-specific hash, pickling, and no
  poisoning of DTensor's caches (a plain ``Shard(0)`` tensor of the same shape
  gathered after ours, and before, is right);
- the guard, op by op (a property test over DTensor-supported ops): the
  result equals the unsharded computation, or the call raises on every rank
  naming the parameter;
- ``copy_`` from a full tensor, a replicated DTensor, torch.chunk's
  ``Shard(0)`` and another split (torchtitan's init), ``nn.init``;
- the optimizer step on local tensors, bitwise equal to the same optimizer on
  plain tensors (AdamW foreach and for-loop, Adam, SGD with momentum,
  Adagrad, RMSprop), state stored as RowParams;
- torch's own ``clip_grad_norm_`` on RowParam gradients = the unsharded norm.
"""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn

from ._dist import run_distributed

SHAPE = (7, 3)
SPLITS = {2: (0, 5, 7), 4: (0, 0, 3, 7, 7)}  # rank 0 and rank 3 hold none at 4


def _full(seed: int = 0) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


# ops whose result does not depend on the split, run with one RowParam operand
# (the property test): name -> f(x) where x is the full tensor or the RowParam
_OPS = {
    "add_scalar": lambda x: x + 1.5, "mul_scalar": lambda x: x * -2.0,
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "sqrt_abs": lambda x: x.abs().sqrt(),
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu": torch.relu, "sign": torch.sign,
    "pow2": lambda x: x.pow(2), "clamp": lambda x: x.clamp(-0.5, 0.5),
    "square_add": lambda x: x * x + x, "lerp": lambda x: torch.lerp(x, x * 2, 0.3),
    "where": lambda x: torch.where(x > 0, x, x * 0.1), "clone": torch.clone,
    "zeros_like": torch.zeros_like, "ones_like": torch.ones_like,
    "full_like": lambda x: torch.full_like(x, 3.0),
    "to_f64": lambda x: x.to(torch.float64), "to_bf16": lambda x: x.to(torch.bfloat16),
    "sum": torch.sum, "mean": torch.mean, "amax": torch.amax, "amin": torch.amin,
    "sum_dim0": lambda x: x.sum(0), "sum_dim1": lambda x: x.sum(1), "max_dim1": lambda x: x.amax(1),
    "norm": torch.linalg.vector_norm,
    "norm_inf": lambda x: torch.linalg.vector_norm(x, float("inf")),
    "norm_dim1": lambda x: torch.linalg.vector_norm(x, dim=1),
    "softmax_dim1": lambda x: torch.softmax(x, 1),
    "col_select": lambda x: x[:, 1], "col_slice": lambda x: x[:, 1:],
    "unsqueeze_last": lambda x: x.unsqueeze(-1), "view_rows": lambda x: x.view(7, 3, 1),
    "reshape_rows": lambda x: x.reshape(7, 1, 3),
    "flatten_last": lambda x: x.unsqueeze(-1).flatten(1),
    "cumsum0": lambda x: x.cumsum(0), "flip0": lambda x: x.flip(0), "sort0": lambda x: x.sort(0)[0],
    "max_all": lambda x: x.max(), "argmax_dim0": lambda x: x.argmax(0),
    "norm_inf_all": lambda x: torch.linalg.vector_norm(x, float("inf")),
    # with a replicated operand (R: the full tensor, or a Replicate DTensor of it)
    "add_row_vector": lambda x, R: x + R(torch.arange(3.0)),
    "mm_right": lambda x, R: x @ R(torch.ones(3, 2)),
    # depend on the split: must raise
    "flatten_all": lambda x: x.reshape(-1), "t": lambda x: x.t(), "row_index": lambda x: x[1],
    "row_slice": lambda x: x[2:6], "mm_left": lambda x, R: R(torch.ones(2, 7)) @ x,
    "linear": lambda x, R: torch.nn.functional.linear(R(torch.ones(2, 3)), x),
    "mul_full_shape": lambda x, R: x * R(_full(3)),
}
# results DTensor would silently get wrong (or raise on some ranks only) for an
# uneven split: they must raise on every rank
MUST_RAISE = {"flatten_all", "t", "row_index", "row_slice", "mm_left", "linear", "mul_full_shape"}


def _call(f, x, R):
    code = getattr(f, "__code__", None)  # (a lambda taking R; torch's builtins take x)
    return f(x, R) if code is not None and code.co_argcount == 2 else f(x)


def _as_full(out):
    from torch.distributed.tensor import DTensor
    if isinstance(out, DTensor):
        return out.full_tensor()
    return out


def _op_results(p, full, replicated, rank: int) -> dict:
    """The property test on ``p`` (the RowParam of ``full``): each op's result
    against the unsharded one, or whether it raised naming the parameter.
    ``replicated(t)``: ``t`` as a replicated DTensor on ``p``'s mesh."""
    ops = {}
    for name, f in _OPS.items():
        want = _call(f, full, lambda t: t)
        try:
            with torch.no_grad():
                got = _as_full(_call(f, p, replicated))
            ops[name] = ("equal" if torch.allclose(got.to(want.dtype), want, atol=1e-6)
                         and got.dtype == want.dtype else f"WRONG {got}")
        except (NotImplementedError, RuntimeError) as e:
            ops[name] = ("raised", "w" in str(e) and f"rank {rank}" in str(e), str(e)[:160])
    return ops


def _copy_results(param, srcs: dict, a: int, b: int) -> dict:
    """``copy_`` of each source into a fresh RowParam of rows ``[a, b)``:
    this rank's rows and the whole tensor equal the source's."""
    copies = {}
    for k, src in srcs.items():
        q = param(torch.zeros(SHAPE))
        with torch.no_grad():
            q.copy_(src)
        copies[k] = torch.equal(q.to_local(), _as_full(src)[a:b]) and torch.equal(
            q.full_tensor(), _as_full(src))
    return copies


def _step_both(do, lo, dp, lp, a: int, b: int, steps: int = 3) -> None:
    """``steps`` steps of ``do`` on RowParam ``dp`` (through the local swap,
    as the global step hooks run it) and of ``lo`` on plain ``lp``, alike."""
    from fsdp_compose._optim._local_step import restore, swap_in
    from fsdp_compose._group._row_dtensor import row_param

    for step in range(steps):
        g = _full(10 + step)[a:b]
        dp.grad = row_param(g.clone(), dp._spec)
        lp.grad = g.clone()
        assert swap_in(do)  # what the global step hooks do for sharded parameters
        try:
            do.step()
        finally:
            restore(do)
        lo.step()


def _torch_clip_result(param, full, a: int, b: int) -> tuple:
    """torch's own clip_grad_norm_ (not our routing) on a RowParam gradient:
    (its norm, the unsharded norm, the clipped gradients equal)."""
    from torch.distributed.tensor import DTensor

    from fsdp_compose._group._row_dtensor import row_param

    cp = param(full)
    cp.grad = row_param(_full(20)[a:b].clone(), cp._spec)
    torch_clip = torch.nn.utils.clip_grad_norm_
    torch_clip = getattr(torch_clip, "__wrapped__", torch_clip)  # torch's own, not our routing
    norm = torch_clip([cp], 1.0)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    ref = nn.Parameter(full.clone())
    ref.grad = _full(20)
    return (float(norm), float(torch.nn.utils.clip_grad_norm_([ref], 1.0)),
            torch.allclose(cp.grad.full_tensor(), ref.grad, atol=1e-7))


def _worker(rank: int, ws: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import (DTensor, Partial, Replicate, Shard,
                                          distribute_tensor)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from fsdp_compose._group._row_dtensor import RowShard, row_param, row_spec

    mesh = init_device_mesh("cpu", (ws,))
    cuts = SPLITS[ws]
    a, b = cuts[rank], cuts[rank + 1]
    full = _full()
    out: dict = {"rows": (a, b)}

    def param(t, name="w", split=cuts):
        lo, hi = split[rank], split[rank + 1]
        p = nn.Parameter(row_param(t[lo:hi].clone(), row_spec(mesh, split, t.shape, t.dtype)))
        p._fsdp_name = name
        return p

    p = param(full)
    out["is"] = (type(p).__name__, isinstance(p, nn.Parameter), isinstance(p, DTensor),
                 tuple(p.shape), p.placements == (Shard(0),), type(p.placements[0]).__name__)
    # ---- data movement
    out["full_tensor"] = torch.equal(p.full_tensor(), full)
    # p.data is ours too: DTensor's own ops on a plain DTensor carrying our
    # placement would give results of torch.chunk's split
    out["data"] = (type(p.data).__name__, torch.equal(p.data.clone().full_tensor(), full))
    out["replicate"] = torch.equal(p.redistribute(mesh, [Replicate()]).to_local(), full)
    s1 = p.redistribute(mesh, [Shard(1)])
    out["shard1"] = torch.equal(s1.full_tensor(), full)
    chunked = distribute_tensor(full, mesh, [Shard(0)])
    out["chunked_after"] = torch.equal(chunked.full_tensor(), full)  # cache not poisoned
    # DTensor's C++ dispatch cache keys a placement by (type, dim): after ops on
    # ours, the same ops on a plain Shard(0) tensor of that shape and mesh must
    # not get our split back (fsdp_compose/_base/_compat.py)
    with torch.no_grad():
        for f in (lambda t: t.detach(), lambda t: t + 1, lambda t: t.clone(), lambda t: t * 2):
            f(p)
            got_plain = f(chunked)
            out.setdefault("plain_after_ours", []).append(
                (type(got_plain.placements[0]).__name__,
                 torch.allclose(got_plain.full_tensor(), f(full))))
    part = DTensor.from_local(full * (rank + 1), mesh, [Partial()], run_check=False)
    rs = part.redistribute(mesh, [RowShard(cuts)])
    # (a sum over ranks: equal within rounding, not bitwise)
    out["partial_to_rows"] = torch.allclose(rs.to_local(), (full * sum(range(1, ws + 1)))[a:b],
                                            atol=1e-5) and rs.to_local().shape == (b - a, 3)
    rep = distribute_tensor(full, mesh, [Replicate()]).redistribute(mesh, [RowShard(cuts)])
    out["replicate_to_rows"] = torch.equal(rep.to_local(), full[a:b])
    d = distribute_tensor(full, mesh, p.placements)
    out["distribute_like_p"] = torch.equal(d.full_tensor(), full)
    out["dcp_offsets"] = tuple(map(tuple, compute_local_shape_and_global_offset(
        p.shape, mesh, p.placements)))
    # ---- pickling a piece that is a view at an offset (as ours are, of the flat shard)
    import io
    flat = torch.cat([torch.zeros(5), full[a:b].reshape(-1)])
    v = nn.Parameter(row_param(flat[5:].view(b - a, 3), p._spec))
    v._fsdp_name = "w"
    buf = io.BytesIO()
    torch.save({"w": v, "d": v.detach()}, buf)
    buf.seek(0)
    back = torch.load(buf)  # (torch's default, weights_only, as FSDP2's DTensors load)
    out["pickle"] = (type(back["w"]).__name__, isinstance(back["w"], nn.Parameter),
                     back["w"]._fsdp_name, torch.equal(back["w"].to_local(), full[a:b]),
                     back["d"].placements == p.placements,
                     torch.equal(back["d"].full_tensor(), full))
    # ---- identity
    rsh = RowShard(cuts)
    other = RowShard((0,) + tuple(min(7, c + 1) for c in cuts[1:-1]) + (7,))
    out["identity"] = (rsh == Shard(0), rsh == RowShard(cuts), rsh != other,
                       hash(rsh) != hash(Shard(0)), pickle.loads(pickle.dumps(rsh)) == rsh,
                       copy.deepcopy(rsh) is rsh)
    # ---- the guard, op by op
    out["ops"] = _op_results(p, full, lambda t: distribute_tensor(t, mesh, [Replicate()]), rank)
    # foreach ops over parameters split differently (torch's clip_grads_with_norm_,
    # optimizers): element-wise per position, so allowed, and right
    q = param(_full(5), "q")
    # (a parameter of another split is a RowParam, as fsdp_compose makes them: a
    # plain DTensor carrying a RowShard loses it in nn.Parameter() on torch 2.14,
    # whose detach strategy rebuilds the placement as a plain Shard(0))
    q_other = param(_full(5), "q_other", other.cuts)
    with torch.no_grad():
        torch._foreach_mul_([p, q_other], 2.0)
        summed = torch._foreach_add([p, q], [p, q])
        norms = torch._foreach_norm([p, q_other])
    out["foreach_mixed"] = (torch.equal(p.full_tensor(), full * 2),
                            torch.equal(q_other.full_tensor(), _full(5) * 2),
                            torch.equal(summed[1].full_tensor(), _full(5) * 2),
                            [float(n.full_tensor()) for n in norms])
    with torch.no_grad():
        p.copy_(full)
    try:
        p.view(7, 3, 1)  # keeps the rows, but with autograd on: refused by name
        out["grad_view"] = "no raise"
    except NotImplementedError as e:
        out["grad_view"] = str(e)
    # ---- copy_
    srcs = {"full": full * 2, "replicate": distribute_tensor(full * 3, mesh, [Replicate()]),
            "chunked": distribute_tensor(full * 4, mesh, [Shard(0)]),
            "other_split": DTensor.from_local(
                (full * 5)[other.cuts[rank]:other.cuts[rank + 1]], mesh, [other],
                run_check=False, shape=full.shape, stride=full.stride())}
    copies = _copy_results(param, srcs, a, b)
    try:
        with torch.no_grad():
            param(torch.zeros(SHAPE)).copy_(torch.zeros(8, 3))
        copies["wrong_shape"] = "no raise"
    except RuntimeError as e:
        copies["wrong_shape"] = str(e)
    q = param(torch.zeros(SHAPE))
    nn.init.constant_(q, 0.25)
    copies["init"] = torch.equal(q.full_tensor(), torch.full(SHAPE, 0.25))
    out["copy"] = copies
    # ---- optimizers: local step vs plain tensors, bitwise
    opts = {}
    for name, make in {
            "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True),
            "adamw_loop": lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=False),
            "adam": lambda ps: torch.optim.Adam(ps, lr=0.1),
            "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
            "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01)}.items():
        dp, lp = param(full), nn.Parameter(full[a:b].clone())
        do, lo = make([dp]), make([lp])
        _step_both(do, lo, dp, lp, a, b)
        state = do.state[dp]
        opts[name] = (torch.equal(dp.to_local(), lp.detach()),
                      all(torch.equal(v.to_local() if isinstance(v, DTensor) else v,
                                      lo.state[lp][k]) for k, v in state.items()),
                      sorted(type(v).__name__ for v in state.values()),
                      type(do.param_groups[0]["params"][0]).__name__)
    out["optim"] = opts
    # ---- torch's own clip on RowParam gradients
    out["clip"] = _torch_clip_result(param, full, a, b)
    # ---- DCP: save our rows, load into another split and into torch.chunk's
    path = f"{_tmp_root()}/dcp_{ws}"
    dcp.save({"w": p}, checkpoint_id=path)
    into_other = {"w": DTensor.from_local(torch.zeros(other.cuts[rank + 1] - other.cuts[rank], 3),
                                          mesh, [other], run_check=False, shape=full.shape,
                                          stride=full.stride())}
    dcp.load(into_other, checkpoint_id=path)
    into_chunks = {"w": distribute_tensor(torch.zeros(SHAPE), mesh, [Shard(0)])}
    dcp.load(into_chunks, checkpoint_id=path)
    out["dcp"] = (torch.equal(into_other["w"].full_tensor(), full),
                  torch.equal(into_chunks["w"].full_tensor(), full))
    dist.barrier()
    return out


def _tmp_root() -> str:
    import os
    import tempfile
    root = os.environ.get("FSDP_ROW_DTENSOR_TMP") or tempfile.gettempdir()
    return root


@pytest.fixture(scope="module", params=[2, 4])
def got(request, tmp_path_factory):
    import os
    os.environ["FSDP_ROW_DTENSOR_TMP"] = str(tmp_path_factory.mktemp("rowdt"))
    return request.param, run_distributed(_worker, request.param, timeout=240)


def test_parameters_are_dtensors_of_the_global_shape(got):
    ws, per_rank = got
    for r in per_rank:
        assert r["is"] == ("RowParam", True, True, SHAPE, True, "RowShard")


def test_data_movement_is_right_for_the_uneven_split(got):
    ws, per_rank = got
    for rank, r in enumerate(per_rank):
        for k in ("full_tensor", "replicate", "shard1", "chunked_after", "partial_to_rows",
                  "replicate_to_rows", "distribute_like_p"):
            assert r[k], (rank, k)
        assert r["data"] == ("RowParam", True), rank
        a, b = r["rows"]
        # (an empty piece's offset is the end of the dim, as torch gives FSDP2's)
        assert r["dcp_offsets"] == ((b - a, 3), (a if b > a else SHAPE[0], 0)), rank


def test_pieces_at_an_offset_pickle(got):
    for r in got[1]:  # (torch's own pickling would read the wrapper's invalid storage)
        assert r["pickle"] == ("RowParam", True, "w", True, True, True)


def test_ops_on_ours_leave_plain_shard0_tensors_alone(got):
    for r in got[1]:
        assert r["plain_after_ours"] == [("Shard", True)] * 4, r["plain_after_ours"]


def test_rowshard_identity(got):
    for r in got[1]:
        assert r["identity"] == (True, True, True, True, True, True)


def test_each_op_equals_the_unsharded_result_or_raises_on_every_rank(got):
    ws, per_rank = got
    for name in _OPS:
        seen = [r["ops"][name] for r in per_rank]
        if name in MUST_RAISE:
            for rank, s in enumerate(seen):
                assert s[0] == "raised" and s[1], (name, rank, s)
        else:
            assert all(s == "equal" for s in seen), (name, seen)
    for r in per_rank:
        assert "autograd" in r["grad_view"] and "parameter(s) w" in r["grad_view"], r["grad_view"]


def test_foreach_over_parameters_split_differently(got):
    for r in got[1]:
        a, b, c, norms = r["foreach_mixed"]
        assert a and b and c
        assert norms == pytest.approx([float(_full().norm() * 2), float(_full(5).norm() * 2)])


def test_copy_keeps_each_ranks_rows_of_any_source(got):
    for r in got[1]:
        c = r["copy"]
        assert c["full"] and c["replicate"] and c["chunked"] and c["other_split"] and c["init"], c
        assert "copy_ into the sharded parameter w" in c["wrong_shape"], c["wrong_shape"]


def test_optimizer_steps_local_tensors_bitwise_and_keeps_dtensor_state(got):
    for r in got[1]:
        for name, (param_eq, state_eq, kinds, held) in r["optim"].items():
            assert param_eq and state_eq, name
            assert held == "RowParam", name  # the user's parameter is back after the step
            assert all(k in ("RowParam", "Tensor") for k in kinds) and "RowParam" in kinds, (
                name, kinds)


def test_torch_clip_grad_norm_is_global_on_rowparam_grads(got):
    for r in got[1]:
        norm, ref_norm, scaled = r["clip"]
        assert norm == pytest.approx(ref_norm, rel=1e-6) and scaled


def test_dcp_reshards_our_rows_into_another_split_and_into_chunks(got):
    for r in got[1]:
        assert r["dcp"] == (True, True)


def _closure_worker(rank: int, ws: int) -> dict:
    """``opt.step(closure)`` (Lightning's automatic optimization) on a sharded
    model against the same model unsharded (every rank the same batch, so
    the averaged gradient is the reference's), with ``zero_grad`` inside
    the closure, as Lightning does it."""
    import copy as _copy

    from fsdp_compose import fully_shard

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    model = _copy.deepcopy(ref)
    fully_shard(model[0])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    losses = []
    for step in range(3):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))

        def closure(m=model, o=opt):
            o.zero_grad()
            loss = m(x).pow(2).mean()
            loss.backward()
            return loss

        def ref_closure():
            ref_opt.zero_grad()
            loss = ref(x).pow(2).mean()
            loss.backward()
            return loss
        losses.append((float(opt.step(closure)), float(ref_opt.step(ref_closure))))
    return {"losses": losses,
            "params": all(torch.allclose(p.full_tensor(), q, atol=1e-6)
                          for p, q in zip(model.parameters(), ref.parameters())),
            "moved": not all(torch.equal(p.full_tensor(), q) for p, q in
                             zip(model.parameters(), nn.Sequential(
                                 nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).parameters())),
            "state": sorted({k for st in opt.state.values() for k in st})}


def test_step_with_a_closure_trains_as_the_unsharded_model():
    for r in run_distributed(_closure_worker, 2, timeout=120):
        for ours, ref in r["losses"]:
            assert ours == pytest.approx(ref, rel=1e-5)
        assert r["params"] and r["state"] == ["exp_avg", "exp_avg_sq", "step"], r


def _held_grad_worker(rank: int, ws: int) -> dict:
    """A gradient the user keeps across ``zero_grad`` keeps its values: the
    RowParam gradient wrapper is reused only when nothing else holds it."""
    from fsdp_compose import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = model[0].weight
    model(torch.randn(4, 5)).pow(2).sum().backward()
    kept = w.grad
    values = kept.to_local().clone()
    kept_full = kept.full_tensor()
    opt.step()
    opt.zero_grad()
    model(torch.randn(4, 5) * 3).pow(2).sum().backward()
    new = w.grad
    out = {"kept_intact": torch.equal(kept.to_local(), values), "new_object": new is not kept,
           "new_differs": not torch.equal(new.full_tensor(), kept_full)}
    del kept, new
    opt.zero_grad()
    model(torch.randn(4, 5)).pow(2).sum().backward()
    out["still_a_rowparam"] = type(w.grad).__name__
    # zero_grad frees the gradient's rows, as with plain tensors: the wrapper
    # kept for reuse lets go of them (it held every gradient shard alive)
    import gc
    import weakref
    rows = weakref.ref(w.grad._local_tensor)
    opt.zero_grad()
    gc.collect()
    out["rows_freed"] = rows() is None
    return out


def test_a_gradient_kept_across_zero_grad_keeps_its_values():
    for r in run_distributed(_held_grad_worker, 2, timeout=120):
        assert r == {"kept_intact": True, "new_object": True, "new_differs": True,
                     "still_a_rowparam": "RowParam", "rows_freed": True}, r


def _user_changes_worker(rank: int, ws: int) -> dict:
    """The optimizer's local-tensor swap is built once and reused
    (``_local_step._Swap``); every change a user can make between steps must
    still reach the step. The same changes on the unsharded model, every rank
    the same batch (the averaged gradient is the reference's)."""
    import copy as _copy

    from torch.distributed.tensor import DTensor

    from fsdp_compose import fully_shard

    from fsdp_compose._optim import _local_step

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))
    model = _copy.deepcopy(ref)
    fully_shard(model[0])
    fully_shard(model)
    opts = [torch.optim.AdamW(model.parameters(), lr=0.05, foreach=True),
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)]
    ref_opts = [torch.optim.AdamW(ref.parameters(), lr=0.05, foreach=True),
                torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)]
    w, rw = model[0].weight, ref[0].weight
    b, rb = model[2].bias, ref[2].bias
    saved = None
    reused = []

    def local(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    for step in range(8):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        for m in (model, ref):
            m(x).pow(2).mean().backward()
        # the changes, made alike on both (the optimizer state, then the step)
        if step == 2:  # a state entry rebound
            for o, p in ((opts[0], w), (ref_opts[0], rw)):
                o.state[p]["exp_avg"] = torch.zeros_like(o.state[p]["exp_avg"])
        if step == 3:  # a parameter without gradient this step
            b.grad, rb.grad = None, None
        if step == 4:  # a parameter's state removed (started afresh)
            for o, p in ((opts[1], w), (ref_opts[1], rw)):
                del o.state[p]
            saved = [_copy.deepcopy(o.state_dict()) for o in (opts[0], ref_opts[0])]
        if step == 6:  # state loaded back
            opts[0].load_state_dict(saved[0])
            ref_opts[0].load_state_dict(saved[1])
        if step == 7:  # p.data = another tensor (the next forward would refuse it: test_casts)
            with torch.no_grad():
                w.data = w.data.clone()
                rw.data = rw.data.clone()
        for o, ro in zip(opts, ref_opts):
            before = _local_step._plans.get(o)
            o.step()
            ro.step()
            reused.append(_local_step._plans.get(o) is before)
        for m in (model, ref):
            m.zero_grad()
    state_eq = all(
        torch.allclose(local(o.state[p][k]), ro.state[rp][k], atol=1e-6)
        and isinstance(o.state[p][k], DTensor) == (o.state[p][k].dim() > 0)
        for o, ro in zip(opts, ref_opts)
        for p, rp in zip(model.parameters(), ref.parameters()) for k in ro.state[rp])
    return {"params": all(torch.allclose(p.full_tensor(), q, atol=1e-6)
                          for p, q in zip(model.parameters(), ref.parameters())),
            "state": state_eq, "reused": reused,
            "same_keys": all(sorted(o.state[p]) == sorted(ro.state[rp])
                             for o, ro in zip(opts, ref_opts)
                             for p, rp in zip(model.parameters(), ref.parameters()))}


def test_optimizer_swap_is_reused_and_sees_every_change_between_steps():
    for r in run_distributed(_user_changes_worker, 2, timeout=120):
        assert r["params"] and r["state"] and r["same_keys"], r
        reused = r["reused"]  # (AdamW, SGD) per step
        # built at the first step; rebuilt after each change to that optimizer
        # (2: AdamW's state entry; 4: SGD's removed entry; 6: AdamW loaded;
        # 7: p.data, both), and after a step that created state (the first)
        assert reused[2 * 2] is False and reused[4 * 2 + 1] is False, reused
        assert reused[6 * 2] is False and reused[7 * 2:8 * 2] == [False, False], reused
        assert reused[5 * 2:5 * 2 + 2] == [True, True], reused


def _hsdp_worker(rank: int, ws: int) -> dict:
    """HSDP's parameters: a (2, 2) mesh, rows split over its last dim,
    replicated over the first: placements ``(Replicate(), RowShard)``, as
    FSDP2 shows ``(Replicate(), Shard(0))``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from fsdp_compose._group._row_dtensor import RowShard, row_param, row_spec

    mesh = init_device_mesh("cpu", (2, 2))
    cuts = SPLITS[2]
    coord = mesh.get_coordinate()[-1]
    a, b = cuts[coord], cuts[coord + 1]
    full = _full()
    rr = [Replicate(), Replicate()]

    def param(t, name="w"):
        p = nn.Parameter(row_param(t[a:b].clone(), row_spec(mesh, cuts, t.shape, t.dtype)))
        p._fsdp_name = name
        return p

    p = param(full)
    out: dict = {"is": (type(p).__name__, isinstance(p, DTensor), tuple(p.shape),
                        p.placements == (Replicate(), Shard(0)),
                        [type(pl).__name__ for pl in p.placements])}
    out["full_tensor"] = torch.equal(p.full_tensor(), full)
    out["replicate"] = torch.equal(p.redistribute(mesh, rr).to_local(), full)
    out["shard1"] = torch.equal(p.redistribute(mesh, [Replicate(), Shard(1)]).full_tensor(),
                                full)
    out["distribute_like_p"] = torch.equal(
        distribute_tensor(full, mesh, p.placements).full_tensor(), full)
    out["ops"] = _op_results(p, full, lambda t: distribute_tensor(t, mesh, rr), rank)
    other = RowShard((0, 2, 7))
    srcs = {"full": full * 2, "replicate": distribute_tensor(full * 3, mesh, rr),
            "chunked": distribute_tensor(full * 4, mesh, [Replicate(), Shard(0)]),
            "other_split": DTensor.from_local(
                (full * 5)[other.cuts[coord]:other.cuts[coord + 1]], mesh, [Replicate(), other],
                run_check=False, shape=full.shape, stride=full.stride())}
    out["copy"] = _copy_results(param, srcs, a, b)
    dp, lp = param(full), nn.Parameter(full[a:b].clone())
    do, lo = torch.optim.AdamW([dp], lr=0.1), torch.optim.AdamW([lp], lr=0.1)
    _step_both(do, lo, dp, lp, a, b)
    out["optim"] = (torch.equal(dp.to_local(), lp.detach()),
                    sorted(type(v).__name__ for v in do.state[dp].values()),
                    all(v.placements == dp.placements for v in do.state[dp].values()
                        if isinstance(v, DTensor)))
    out["clip"] = _torch_clip_result(param, full, a, b)
    path = f"{_tmp_root()}/dcp_hsdp"
    dcp.save({"w": p}, checkpoint_id=path)
    into = {"w": distribute_tensor(torch.zeros(SHAPE), mesh, [Replicate(), Shard(0)]),
            "o": DTensor.from_local(torch.zeros(other.cuts[coord + 1] - other.cuts[coord], 3),
                                    mesh, [Replicate(), other], run_check=False,
                                    shape=full.shape, stride=full.stride())}
    dcp.load({"w": into["w"]}, checkpoint_id=path)
    dcp.load({"w": into["o"]}, checkpoint_id=path)
    out["dcp"] = (torch.equal(into["w"].full_tensor(), full),
                  torch.equal(into["o"].full_tensor(), full))
    return out


def test_hsdp_parameters_are_replicated_row_dtensors(tmp_path):
    import os
    os.environ["FSDP_ROW_DTENSOR_TMP"] = str(tmp_path)
    for rank, r in enumerate(run_distributed(_hsdp_worker, 4, timeout=240)):
        assert r["is"] == ("RowParam", True, SHAPE, True, ["Replicate", "RowShard"]), r["is"]
        for k in ("full_tensor", "replicate", "shard1", "distribute_like_p"):
            assert r[k], (rank, k)
        for name, res in r["ops"].items():
            if name in MUST_RAISE:
                assert res[0] == "raised" and res[1], (rank, name, res)
            else:
                assert res == "equal", (rank, name, res)
        assert all(v is True for v in r["copy"].values()), (rank, r["copy"])
        assert r["optim"][0] and r["optim"][2] and "RowParam" in r["optim"][1], r["optim"]
        norm, ref, scaled = r["clip"]
        assert norm == pytest.approx(ref, rel=1e-6) and scaled, r["clip"]
        assert r["dcp"] == (True, True), rank


# ----------------------------------------------------------------- TP parameters
# A tensor-parallel parameter inside a unit ([Note: TP parameters as RowParams]):
# a RowParam on the joined (dp, tp) mesh, our rows cut inside its local TP shard.
# SHAPE's 7 rows over tp 2 are TP blocks of 4 and 3 rows (torch.chunk's), so the
# dp cuts differ between TP coordinates, as fully_shard's layouts would.
TP_CUTS = {  # tail -> tp coordinate -> dp cuts of that TP shard's rows (empty pieces)
    "shard0": {0: (0, 4, 4), 1: (0, 1, 3)},
    "shard1": {0: (0, 0, 7), 1: (0, 0, 7)},
}
# ops that must give the unsharded result on a TP parameter (element-wise, whole reductions)
TP_MUST_EQUAL = {
    "add_scalar", "mul_scalar", "neg", "abs", "exp", "sqrt_abs", "sigmoid", "tanh", "relu",
    "sign", "pow2", "clamp", "square_add", "lerp", "where", "clone", "zeros_like", "ones_like",
    "full_like", "to_f64", "to_bf16", "sum", "mean", "amax", "amin", "norm", "norm_inf",
    "max_all", "norm_inf_all"}


def _tp_worker(rank: int, ws: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from fsdp_compose._group._row_dtensor import row_param, row_spec

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    d, t = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    full = _full()
    out: dict = {}
    for kind, tail in (("shard0", Shard(0)), ("shard1", Shard(1))):
        cuts = TP_CUTS[kind][t]
        tp_local = full.chunk(2, dim=tail.dim)[t]  # what TP gives this rank

        def param(src, name="w"):
            local = src.chunk(2, dim=tail.dim)[t][cuts[d]:cuts[d + 1]].clone()
            p = nn.Parameter(row_param(local, row_spec(mesh, cuts, src.shape, src.dtype,
                                                       tail=(tail,))))
            p._fsdp_name = name
            return p

        p = param(full)
        r: dict = {"placements": str(p.placements), "shape": tuple(p.shape),
                   "local": torch.equal(p.to_local(), tp_local[cuts[d]:cuts[d + 1]])}
        try:  # (not differentiable for a TP parameter: loud rather than gradient-less)
            p.full_tensor()
            r["grad_full"] = "no raise"
        except NotImplementedError as e:
            r["grad_full"] = str(e)
        with torch.no_grad():
            _tp_checks(r, p, param, full, mesh, rank, kind, tail, t, cuts, d)
        dist.barrier()
        out[kind] = r
    return out


def _tp_checks(r, p, param, full, mesh, rank, kind, tail, t, cuts, d) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from fsdp_compose._group._row_dtensor import local_box, row_param
    off, size = local_box(p._spec, (d, t))
    r["box"] = torch.equal(p.to_local(), full[off[0]:off[0] + size[0],
                                              off[1]:off[1] + size[1]])
    r["full_tensor"] = torch.equal(p.full_tensor(), full)
    r["replicate"] = torch.equal(p.redistribute(mesh, [Replicate(), Replicate()]).to_local(),
                                 full)
    r["to_chunks"] = torch.equal(p.redistribute(mesh, [Shard(0), Shard(1)]).full_tensor(),
                                 full)
    r["ops"] = _op_results(p, full, lambda x: distribute_tensor(
        x, mesh, [Replicate(), Replicate()]), rank)
    # copy_ (torchtitan's init) from a full tensor and from a replicated DTensor
    copies = {}
    for name, src in {"full": full * 2, "replicate": distribute_tensor(
            full * 3, mesh, [Replicate(), Replicate()])}.items():
        q = param(torch.zeros(SHAPE))
        with torch.no_grad():
            q.copy_(src)
        copies[name] = torch.equal(q.full_tensor(), _as_full(src))
    r["copy"] = copies
    # torch's own clip (not our routing) on the gradient: the unsharded norm
    cp = param(full)
    cp.grad = row_param(_full(20).chunk(2, dim=tail.dim)[t][cuts[d]:cuts[d + 1]].clone(),
                        cp._spec)
    torch_clip = torch.nn.utils.clip_grad_norm_
    torch_clip = getattr(torch_clip, "__wrapped__", torch_clip)
    norm = torch_clip([cp], 1.0)
    r["clip_norm"] = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    r["clip_ref"] = float(_full(20).norm())
    # DCP: save ours; load into torch.chunk's (Shard(0), Shard(1)) and back into ours
    path = f"{_tmp_root()}/dcp_tp_{kind}"
    dcp.save({"w": p}, checkpoint_id=path)
    into = {"w": distribute_tensor(torch.zeros(SHAPE), mesh, [Shard(0), Shard(1)])}
    dcp.load(into, checkpoint_id=path)
    back = {"w": param(torch.zeros(SHAPE))}
    dcp.load(back, checkpoint_id=path)
    r["dcp"] = (torch.equal(into["w"].full_tensor(), full),
                torch.equal(back["w"].full_tensor(), full))
    # torch.save / torch.load's default (weights_only): the strided spec survives
    import io
    buf = io.BytesIO()
    torch.save({"w": p}, buf)
    buf.seek(0)
    loaded = torch.load(buf)["w"]
    r["pickle"] = (type(loaded).__name__, loaded.placements == p.placements,
                   [type(q).__name__ for q in loaded.placements],
                   torch.equal(loaded.full_tensor(), full))


@pytest.fixture(scope="module")
def got_tp(tmp_path_factory):
    import os
    os.environ["FSDP_ROW_DTENSOR_TMP"] = str(tmp_path_factory.mktemp("rowdt_tp"))
    return run_distributed(_tp_worker, 4, timeout=240)


def test_tp_parameters_are_dtensors_on_the_joined_mesh(got_tp):
    for rank, r in enumerate(got_tp):
        s0, s1 = r["shard0"], r["shard1"]
        assert "within 2 TP blocks" in s0["placements"] and "Shard(dim=0)" in s0["placements"]
        assert "within" not in s1["placements"] and "Shard(dim=1)" in s1["placements"]
        for kind in ("shard0", "shard1"):
            k = r[kind]
            assert k["shape"] == SHAPE and k["local"] and k["box"], (rank, kind)
            assert k["full_tensor"] and k["replicate"] and k["to_chunks"], (rank, kind)
            assert k["copy"] == {"full": True, "replicate": True}, (rank, kind, k["copy"])
            assert k["clip_norm"] == pytest.approx(k["clip_ref"], rel=1e-6), (rank, kind)
            assert k["dcp"] == (True, True), (rank, kind)
            assert "differentiable full_tensor()" in k["grad_full"] and "w" in k["grad_full"], k
            kinds = ["RowShard", "TPShard" if kind == "shard0" else "Shard"]
            assert k["pickle"] == ("RowParam", True, kinds, True), (rank, kind, k["pickle"])


def test_tp_parameter_ops_equal_the_unsharded_result_or_raise_on_every_rank(got_tp):
    for kind in ("shard0", "shard1"):
        for name in _OPS:
            seen = [r[kind]["ops"][name] for r in got_tp]
            if name in TP_MUST_EQUAL:
                assert all(s == "equal" for s in seen), (kind, name, seen)
            elif name in MUST_RAISE or any(s != "equal" for s in seen):
                for rank, s in enumerate(seen):  # raised alike on every rank, naming it
                    assert s[0] == "raised" and s[1], (kind, name, rank, s)
