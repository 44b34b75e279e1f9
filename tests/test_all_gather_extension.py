"""FSDP2's all-gather extension (fsdp_pre_all_gather / fsdp_post_all_gather):
torchao's float8 training against FSDP2's, a subclass of our own, and what
is refused. See [Note: all-gather extension] in fsdp_compose/_group/_extension.py.

torchao is a test extra: its tests skip without it, and it is imported only
inside the ranks (never into pytest's process, which every later test forks).
"""
from __future__ import annotations

import contextlib
import importlib.util
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ._dist import run_distributed
from ._support import OnFirstUse, rows

TIMEOUT = 600
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="torchao is not installed (pip install -e .[test])")

D, F = 64, 128  # float8 matmuls need dims that are multiples of 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.w1 = nn.Linear(D, F, bias=False)
        self.w2 = nn.Linear(F, D, bias=False)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, n_blocks=2):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(n_blocks)])
        # (a non-float8 parameter in the root: FSDP2 on gloo cannot gather a
        # unit whose inputs are all float8, it gathers them in their own dtype)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, D, bias=False)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


@contextlib.contextmanager
def fsdp2_all_gather_bytes():
    """Bytes FSDP2's all-gathers write, and their number. It issues them as
    ``all_gather_single`` (torch 2.13, 2.14) or ``all_gather_into_tensor``
    (2.11, which has no ``all_gather_single``): both are counted, a call
    inside another once."""
    box, depth = [0, 0], [0]

    def wrap(orig):
        def counting(out, inp, *a, **k):
            if depth[0] == 0:
                box[0] += out.numel() * out.element_size()
                box[1] += 1
            depth[0] += 1
            try:
                return orig(out, inp, *a, **k)
            finally:
                depth[0] -= 1
        return counting

    with contextlib.ExitStack() as stack:
        for name in ("all_gather_single", "all_gather_into_tensor"):
            if hasattr(dist, name):
                stack.enter_context(mock.patch.object(dist, name, wrap(getattr(dist, name))))
        yield box


def _shard(model, impl, mp):
    """``impl`` "ours-padded": ours with every plain row group in uneven pieces
    and the padded collectives of every backend but gloo (here on gloo):
    [Note: padded collectives] in fsdp_compose/_comm/_collectives.py."""
    if impl.startswith("ours"):
        from fsdp_compose import MixedPrecisionPolicy, fully_shard
        from fsdp_compose._comm import _collectives
        from fsdp_compose._plan import _layout
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    kw = {}
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if impl == "ours-padded":
        _layout.FORCE_EVEN, _collectives.PAD_UNEVEN_ON_GLOO = False, True
    try:
        for b in model.blocks:
            fully_shard(b, **kw)
        fully_shard(model, **kw)
    finally:
        if impl == "ours-padded":
            _layout.FORCE_EVEN, _collectives.PAD_UNEVEN_ON_GLOO = None, False
    if impl == "ours-padded":  # no buckets: each unit's collectives alone
        model.set_all_gather_bucket_bytes(0)
        model.set_reduce_scatter_bucket_bytes(0)
    return model


def _float8_train(rank, world, impl, ext, mp, precompute, steps=5):
    import fsdp_compose
    from torchao.float8 import (Float8LinearConfig, convert_to_float8_training,
                                precompute_float8_dynamic_scale_for_fsdp)
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from fsdp_compose._group._extension import inner_data

    torch.manual_seed(0)
    model = Net()
    convert_to_float8_training(model, config=Float8LinearConfig(
        enable_fsdp_float8_all_gather=ext))
    _shard(model, impl, mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)
    from torchao.float8 import fsdp_utils
    dynamic = [0]  # pre-all-gathers that computed the scale (an amax all-reduce each)
    cast = fsdp_utils.hp_tensor_to_float8_dynamic

    def counting(*a, **k):
        dynamic[0] += 1
        return cast(*a, **k)

    losses, nbytes, calls, scales_set, dynamic_casts, rs_calls = [], [], [], [], [], []
    for _ in range(steps):
        x = torch.randn(4, 16, D)
        fsdp_compose.reset_comm_stats()
        dynamic[0] = 0
        with fsdp2_all_gather_bytes() as box, \
                mock.patch.object(fsdp_utils, "hp_tensor_to_float8_dynamic", counting):
            loss = model(x).float().pow(2).mean()
            loss.backward()
        dynamic_casts.append(dynamic[0])
        stats = fsdp_compose.comm_stats()
        nbytes.append(stats.all_gather_bytes if impl.startswith("ours") else box[0])
        calls.append(stats.all_gather_calls if impl.startswith("ours") else box[1])
        rs_calls.append(stats.reduce_scatter_calls)
        opt.step()
        opt.zero_grad()
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
            weights = [m.weight for m in model.modules() if hasattr(m, "linear_mm_config")]
            # (where precompute stores it: to_local() of a Parameter is a new view)
            scales_set.append([w._local_tensor._precomputed_scale is not None for w in weights])
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    # this rank's fp32 master rows of every float8 weight (torch.chunk's rows in both)
    rows = {}
    for name, p in model.named_parameters():
        local = p._local_tensor if hasattr(p, "_local_tensor") else p
        if isinstance(local, WeightWithDynamicFloat8CastTensor):
            rows[name] = inner_data(local).detach().clone()
    from torch.distributed.tensor import DTensor
    kinds = sorted({(isinstance(m.weight, DTensor), isinstance(m.weight, nn.Parameter),
                     type(m.weight.to_local() if isinstance(m.weight, DTensor)
                          else m.weight).__name__)
                    for m in model.modules() if hasattr(m, "linear_mm_config")})
    return dict(losses=losses, bytes=nbytes, calls=calls, scales_set=scales_set, rows=rows,
                kinds=kinds, dynamic_casts=dynamic_casts, rs_calls=rs_calls,
                units=1 + len(model.blocks))


_FLOAT8_RUNS = [  # (impl, extension on, bf16 params, precompute the scales)
    ("ours", True, False, True), ("fsdp2", True, False, True),
    ("ours", True, True, True), ("fsdp2", True, True, True),
    ("ours", True, True, False), ("fsdp2", True, True, False),
    ("ours", False, True, False), ("fsdp2", False, True, False),
    ("ours-padded", True, False, True),
]


def _float8_body(rank, world):
    return {k: _float8_train(rank, world, *k) for k in _FLOAT8_RUNS}


@pytest.fixture(scope="module")
def float8_runs():
    """world size (2 or 4) -> per-rank results: one launch per world size a test uses."""
    return OnFirstUse(lambda w: run_distributed(_float8_body, w, timeout=TIMEOUT))


# Measured: bit-identical (difference 0) at 2 and 4 ranks. The bound allows
# a different summation order in a reduction; gathering bf16 weights instead
# (the extension off) moves the losses by ~1e-3 relative in 5 steps.
LOSS_RTOL = 1e-6


def _rel(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


@needs_torchao
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mp,precompute", [(False, True), (True, True), (True, False)])
def test_float8_losses_and_master_rows_equal_fsdp2(float8_runs, world, mp, precompute):
    for r in float8_runs[world]:
        ours, fsdp2 = r[("ours", True, mp, precompute)], r[("fsdp2", True, mp, precompute)]
        assert _rel(ours["losses"], fsdp2["losses"]) <= LOSS_RTOL, (ours["losses"],
                                                                  fsdp2["losses"])
        assert ours["losses"][-1] < ours["losses"][0]  # (it trains)
        assert sorted(ours["rows"]) == sorted(fsdp2["rows"]) and len(ours["rows"]) == 5
        for name, t in ours["rows"].items():
            torch.testing.assert_close(t, fsdp2["rows"][name], rtol=1e-6, atol=1e-7)
        # while sharded, what the module holds looks to torchao as under FSDP2
        assert ours["kinds"] == fsdp2["kinds"] == [
            (True, True, "WeightWithDynamicFloat8CastTensor")]


@needs_torchao
@pytest.mark.parametrize("world", [2, 4])
def test_float8_precompute_sets_the_scales(float8_runs, world):
    for r in float8_runs[world]:
        for key in [("ours", True, False, True), ("ours", True, True, True),
                    ("fsdp2", True, True, True)]:
            assert r[key]["scales_set"] and all(all(s) for s in r[key]["scales_set"])
            assert len(r[key]["scales_set"][0]) == 5
            # the first step's gathers compute the scales (5 in forward, 4 in
            # backward: the root keeps its head), later ones use the precomputed
            assert r[key]["dynamic_casts"] == [9, 0, 0, 0, 0], r[key]["dynamic_casts"]
        assert r[("ours", True, True, False)]["dynamic_casts"] == [9] * 5


@needs_torchao
@pytest.mark.parametrize("world", [2, 4])
def test_float8_all_gather_bytes_equal_fsdp2(float8_runs, world):
    for r in float8_runs[world]:
        for mp in (False, True):
            ours = r[("ours", True, mp, True)]["bytes"]
            fsdp2 = r[("fsdp2", True, mp, True)]["bytes"]
            assert ours == fsdp2 and len(set(ours)) == 1, (ours, fsdp2)
        f8 = r[("ours", True, True, False)]["bytes"][0]
        # (FSDP2's bf16 run: at 4 ranks ours pads its plain groups by 1,280
        # bytes more per step on this model, at 2 ranks they are equal)
        bf16 = r[("fsdp2", False, True, False)]["bytes"][0]
        assert r[("ours", False, True, False)]["bytes"][0] - bf16 == (0 if world == 2 else 1280)
        # the float8 weights move 1 byte per element instead of bf16's 2: the
        # blocks' (2 x D x F each) are gathered in forward and again in
        # backward, the root's head (D x D) once
        assert bf16 - f8 == 2 * (2 * 2 * D * F) + D * D, (bf16, f8)


@needs_torchao
@pytest.mark.parametrize("world", [2, 4])
def test_float8_weights_of_a_unit_share_one_all_gather(float8_runs, world):
    """A unit's float8 weights (a block's w1 and w2) go in ONE all-gather
    (their bytes end to end, copied in and out, as FSDP2 packs a unit); its
    plain group (the LayerNorm) keeps its own zero-copy all-gather, where
    FSDP2 packs it in the same one: every unit of this model has both, so
    ours issues exactly two all-gathers where FSDP2 issues one (three per
    block, one per weight, before the weights were gathered together)."""
    for r in float8_runs[world]:
        for mp in (False, True):
            ours = r[("ours", True, mp, True)]["calls"]
            fsdp2 = r[("fsdp2", True, mp, True)]["calls"]
            assert ours == [2 * c for c in fsdp2], (ours, fsdp2)


@needs_torchao
@pytest.mark.parametrize("world", [2, 4])
def test_float8_padded_one_reduce_scatter_per_unit(float8_runs, world):
    """With the padded collectives (every backend but gloo; forced here) and
    no buckets, a unit's float8 weights share ONE reduce-scatter (never one
    per weight: ``shares_reduce``); its LayerNorm group, whose pieces come
    out equal at these sizes, keeps its own zero-copy one: two per unit and
    step; no more all-gathers than the default path; and it trains as the
    default path does (sums of 4 ranks may associate differently: 1e-6)."""
    for r in float8_runs[world]:
        padded, plain = r[("ours-padded", True, False, True)], r[("ours", True, False, True)]
        assert padded["rs_calls"] == [2 * padded["units"]] * len(padded["rs_calls"]), padded[
            "rs_calls"]
        assert padded["calls"] <= plain["calls"], (padded["calls"], plain["calls"])
        assert _rel(padded["losses"], plain["losses"]) <= LOSS_RTOL


@needs_torchao
@pytest.mark.parametrize("world", [2, 4])
def test_bf16_gather_differs_from_float8_gather(float8_runs, world):
    """What the parity test tells apart: gathering bf16 weights and casting
    after (the extension off) trains differently from FSDP2's float8 gather."""
    for r in float8_runs[world]:
        off, on = r[("ours", False, True, False)], r[("fsdp2", True, True, False)]
        assert _rel(off["losses"], on["losses"]) > 100 * LOSS_RTOL


# ------------------------------------------------------------------------------
# A subclass of our own (no torchao): rows gathered as bf16 values plus an fp32
# scale per row, the five-argument form padding uneven shards.
# ------------------------------------------------------------------------------
aten = torch.ops.aten
_PRESERVE = {aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor,
             aten.copy_.default, aten.view.default, aten.as_strided.default,
             aten._to_copy.default, aten.split.Tensor, aten.clone.default,
             aten.detach.default, aten.alias.default, aten._pin_memory.default}


def _map(fn, x):
    if isinstance(x, (list, tuple)):
        return type(x)(_map(fn, y) for y in x)
    if isinstance(x, dict):
        return {k: _map(fn, v) for k, v in x.items()}
    return fn(x)


class TwoHalves(torch.Tensor):
    """An fp32 weight whose all-gather moves each element as two 16-bit
    halves of two dtypes: bf16 ``hi`` and fp16 ``lo = x - hi`` (the unsharded
    weight is ``hi + lo``, metadata carries the global shape)."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data):
        self._data = data

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return TwoHalves(inner["_data"])

    def __repr__(self):
        return f"TwoHalves({self._data!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        args, kwargs = _map(lambda t: t._data if isinstance(t, TwoHalves) else t,
                            (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func in _PRESERVE:
            return _map(lambda t: cls(t) if isinstance(t, torch.Tensor) else t, out)
        return out

    calls = {"pre": 0, "post": 0, "post_out": 0, "padded": 0}

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        TwoHalves.calls["pre"] += 1
        rows = -(-outer_size[0] // mesh.size())  # FSDP2's padded shard
        data = self._data
        if data.shape[0] != rows:  # (every input must have the padded shape)
            TwoHalves.calls["padded"] += 1
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        hi = data.to(torch.bfloat16)
        return (hi, (data - hi.float()).to(torch.float16)), tuple(outer_size)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        hi, lo = outputs
        full = (hi.float() + lo.float()).to(param_dtype)
        if out is not None:
            TwoHalves.calls["post_out"] += 1
            # (through .data: backward's re-gather must not bump the version of
            # the weight forward saved, under FSDP2 as under fsdp_compose)
            out.data.copy_(full[:metadata[0]])
            return None
        TwoHalves.calls["post"] += 1
        return full, (full,)


class Small(nn.Module):
    """w1: 10 rows (uneven over 4 ranks: 3, 3, 3, 1), w2: 6 rows (2, 2, 2, 0)."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(16, 10)
        self.w2 = nn.Linear(10, 6)
        self.head = nn.Linear(6, 16)

    def forward(self, x):
        return self.head(torch.relu(self.w2(torch.relu(self.w1(x)))))


def _row_scaled_train(rank, world, impl, steps=4):
    import fsdp_compose
    torch.manual_seed(0)
    model = nn.Sequential(Small(), Small())
    for blk in model:
        for lin in (blk.w1, blk.w2):
            lin.weight = nn.Parameter(TwoHalves(lin.weight.detach().clone()))
    if impl == "ours":
        from fsdp_compose import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for blk in model:
        fully_shard(blk)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    TwoHalves.calls = dict.fromkeys(TwoHalves.calls, 0)
    torch.manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        fsdp_compose.reset_comm_stats()
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        grad_kind = type(model[0].w1.weight.grad).__name__
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    with torch.no_grad():
        w = model[0].w1.weight
        rows = w._local_tensor._data.clone()
    return dict(losses=losses, calls=dict(TwoHalves.calls), rows=rows,
                grad_is_dtensor=grad_kind)


def _row_scaled_body(rank, world):
    return {impl: _row_scaled_train(rank, world, impl) for impl in ("ours", "fsdp2")}


@pytest.mark.parametrize("world", [2, 4])
def test_own_subclass_matches_fsdp2(world):
    """Our own subclass (two inputs of two dtypes, metadata, padding of
    uneven shards, an empty piece at 4 ranks, out= reuse) trains as FSDP2
    trains it, with the same calls to its hooks."""
    for rank, r in enumerate(run_distributed(_row_scaled_body, world, timeout=TIMEOUT)):
        ours, fsdp2 = r["ours"], r["fsdp2"]
        assert _rel(ours["losses"], fsdp2["losses"]) <= LOSS_RTOL, (ours["losses"],
                                                                  fsdp2["losses"])
        assert ours["losses"][-1] < ours["losses"][0]
        torch.testing.assert_close(ours["rows"], fsdp2["rows"], rtol=1e-6, atol=1e-7)
        assert ours["calls"] == fsdp2["calls"], (ours["calls"], fsdp2["calls"])
        # 4 weights, 4 steps, gathered in forward and backward: the first
        # gather of each builds the unsharded weight, the others reuse it
        assert ours["calls"]["pre"] == 4 * 4 * 2 and ours["calls"]["post"] == 4
        assert ours["calls"]["post_out"] == 4 * 4 * 2 - 4
        padded = 4 * 4 * 2 if (world, rank) == (4, 3) else 0  # (rank 3 of 4: 1 row and 0)
        assert ours["calls"]["padded"] == padded
        assert ours["grad_is_dtensor"] == fsdp2["grad_is_dtensor"] == "DTensor"


# ------------------------------------------------------------------------------
# What is refused, and a subclass without the extension
# ------------------------------------------------------------------------------
class OneArg(TwoHalves):
    """The old one-argument form: it cannot pad an uneven shard."""

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return OneArg(inner["_data"])

    def fsdp_pre_all_gather(self, mesh):
        data = self._data
        return (data,), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        return outputs[0], ()


class PreOnly(torch.Tensor):
    def fsdp_pre_all_gather(self, mesh):  # pragma: no cover - never called
        raise AssertionError


class Plain(torch.Tensor):
    """A subclass without the extension: gathered as before."""


def _refusals(rank, world):
    from fsdp_compose import fully_shard
    out = {}

    def attempt(key, make, **kw):
        lin = nn.Linear(16, make[1])
        lin.weight = nn.Parameter(make[0](lin.weight.detach().clone()))
        try:
            fully_shard(lin, **kw)
            out[key] = None
        except Exception as e:  # noqa: BLE001 - the test reads type and message
            out[key] = (type(e).__name__, str(e))

    attempt("one_arg_uneven", (OneArg, 6))  # 6 rows over 4 ranks
    attempt("one_arg_even", (OneArg, 8))
    attempt("pre_only", (lambda t: t.as_subclass(PreOnly), 8))
    attempt("post_forward_int", (TwoHalves, 8), reshard_after_forward=2)
    attempt("tensor_granularity", (TwoHalves, 8), shard_granularity="tensor")

    torch.manual_seed(0)
    a, b = nn.Linear(16, 8), nn.Linear(16, 8)
    b.load_state_dict(a.state_dict())
    b.weight = nn.Parameter(b.weight.detach().as_subclass(Plain))
    fully_shard(a)
    fully_shard(b)
    x = torch.randn(4, 16)
    out["plain"] = (isinstance(b.weight, DTensor), type(rows(b.weight)).__name__,
                    tuple(b.weight.shape), tuple(rows(b.weight).shape), torch.equal(a(x), b(x)))
    return out


def test_refused_at_fully_shard_naming_the_parameter():
    for r in run_distributed(_refusals, 4, timeout=TIMEOUT):
        kind, msg = r["one_arg_uneven"]
        assert kind == "ValueError" and "'weight'" in msg and "dim 0 (6)" in msg, msg
        assert "five-argument" in msg
        assert r["one_arg_even"] is None
        kind, msg = r["pre_only"]
        assert kind == "ValueError" and "'weight'" in msg and "only one of" in msg, msg
        kind, msg = r["post_forward_int"]
        assert kind == "ValueError" and "reshard_after_forward=2" in msg, msg
        kind, msg = r["tensor_granularity"]
        assert kind == "ValueError" and "'tensor'" in msg and "'weight'" in msg, msg
        # a subclass without the extension is sharded as a plain parameter
        # (a DTensor of the global shape over our rows, a plain tensor),
        # computing as unsharded
        dtensor, kind, shape, local, same = r["plain"]
        assert dtensor and kind == "Tensor" and shape == (8, 16), r["plain"]
        assert local[1:] == (16,) and local[0] < 8 and same, r["plain"]
