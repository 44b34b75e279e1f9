"""The gloo all-gather / reduce-scatter of ``fsdp_compose._comm._collectives``.

On CPU tensors over gloo they are built from broadcasts and an in-place
all-reduce (see the "[Note: gloo collectives]" in _gloo.py). These tests check the
results against torch's own tensor collectives, bit for bit, on the world
group and on subgroups (where a group rank is not the global rank), and that
the in-place path is really the one taken.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_compose._comm import _collectives as C
from fsdp_compose._comm import _gloo

from ._dist import run_distributed

# torch's native tensor collectives (the new names where present: the old warn).
_native_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_native_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN-safe, tells -0.0 from 0.0)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype])))


def _groups(rank: int, world: int) -> list[tuple[str, object]]:
    """(name, group) for every group this rank is in; the same calls on every rank.

    At 4 ranks: interleaved pairs {0, 2} {1, 3} (group rank != global rank, and
    group rank 0 is not global rank 0 for half of them) and {1, 2, 3} (an odd
    size; rank 0 is not a member)."""
    out: list[tuple[str, object]] = [("world", None)]
    if world == 2:
        out.append(("new_group[0,1]", dist.new_group([0, 1])))
    else:
        pairs, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
        out.append((f"pairs{dist.get_process_group_ranks(pairs)}", pairs))
        three = dist.new_group([1, 2, 3])
        if rank != 0:
            out.append(("three[1,2,3]", three))
    return out


def _members(group) -> list[int]:
    return (list(range(dist.get_world_size())) if group is None
            else dist.get_process_group_ranks(group))


def _data(global_rank: int, n: int, kind: str, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + global_rank)
    if kind == "int":  # integer-valued: every summation order gives the same bits
        return torch.randint(-64, 64, (n,), generator=g).to(dtype)
    return torch.randn(n, generator=g).to(dtype)


# ---------------------------------------------------------------------------
# all-gather


def _all_gather_cases(rank, world):
    checked = []
    for gname, group in _groups(rank, world):
        members = _members(group)
        w, r = len(members), dist.get_rank(group)
        for dtype in (torch.float32, torch.bfloat16):
            for S in (1, 37, 1027):
                for in_place in (False, True):
                    case = f"{gname} {dtype} S={S} in_place={in_place}"
                    shard = _data(rank, S, "randn", dtype)
                    ref = torch.full((w * S,), float("nan"), dtype=dtype)
                    _native_all_gather(ref, shard, group=group)
                    out = torch.full((w * S,), float("nan"), dtype=dtype)
                    ptr = out.data_ptr()
                    if in_place:  # the shard is already our chunk of the output
                        arg = out.view(w, S)[r]
                        arg.copy_(shard)
                    else:
                        arg = shard.clone()
                    work = C.all_gather(out, arg, group)
                    assert work.wait() is True, case
                    assert out.data_ptr() == ptr, case
                    # every chunk is its group rank's shard, in group rank order
                    expect = torch.cat([_data(m, S, "randn", dtype) for m in members])
                    assert _bitwise_equal(out, ref), f"{case}: differs from torch's all-gather"
                    assert _bitwise_equal(out, expect), \
                        f"{case}: not the shards in group rank order"
                    assert _bitwise_equal(arg, shard), f"{case}: the shard argument changed"
                    checked.append(case)
    return checked


# ---------------------------------------------------------------------------
# reduce-scatter


class _CountingWork:
    def __init__(self, work):
        self.work, self.waits = work, 0

    def wait(self, *a, **k):
        self.waits += 1
        return self.work.wait(*a, **k)


def _reduce_scatter_cases(rank, world, path):
    """``path``: "all_reduce" (the in-place all-reduce) or "exchange" (the
    point-to-point one of small inputs over 2 ranks), forced with
    ``_gloo.P2P_MAX_BYTES``."""
    _gloo.P2P_MAX_BYTES = 0 if path == "all_reduce" else 1 << 30
    checked = []
    for gname, group in _groups(rank, world):
        members = _members(group)
        w, r = len(members), dist.get_rank(group)
        for op_name in ("AVG", "SUM"):
            op = getattr(dist.ReduceOp, op_name)
            for kind in ("int", "randn"):
                for S in (1, 37, 1027):
                    case = f"{gname} {op_name} {kind} S={S}"
                    flat = _data(rank, w * S, kind)
                    ref = torch.full((S,), float("nan"))
                    _native_reduce_scatter(ref, flat.clone(), op=op, group=group)

                    # count the underlying collectives and the waits on them
                    real = {n: getattr(dist, n) for n in ("all_reduce", "isend", "irecv")}
                    spies = {n: [] for n in real}

                    def spy(name):
                        def call(*a, **k):
                            spies[name].append(_CountingWork(real[name](*a, **k)))
                            return spies[name][-1]
                        return call

                    for n in real:
                        setattr(dist, n, spy(n))
                    try:
                        work = C.reduce_scatter(flat.clone(), group, op)
                    finally:
                        for n, f in real.items():
                            setattr(dist, n, f)
                    counts = {n: len(v) for n, v in spies.items()}
                    exchange = path == "exchange" and w == 2  # (more ranks: all-reduce)
                    want = ({"all_reduce": 0, "isend": 1, "irecv": 1} if exchange
                            else {"all_reduce": 1, "isend": 0, "irecv": 0})
                    assert counts == want, f"{case}: {counts}"
                    first = work.wait()
                    snapshot = first.clone()
                    second = work.wait()
                    assert second is first, f"{case}: a second wait() returned another tensor"
                    waits = [s.waits for v in spies.values() for s in v]
                    assert waits == [1] * len(waits), f"{case}: waits {waits}"
                    assert first.shape == (S,) and first.dtype == torch.float32, case
                    assert _bitwise_equal(second, snapshot), f"{case}: a second wait() changed it"

                    # the expected value, from every member's data
                    chunks = torch.stack([_data(m, w * S, kind).view(w, S)[r] for m in members])
                    if kind == "int" or w == 2:  # order-free sums: bit for bit
                        assert _bitwise_equal(first, ref), (
                            f"{case}: differs from torch's reduce-scatter "
                            f"({first[:4].tolist()} vs {ref[:4].tolist()})")
                        exact = chunks.sum(0)
                        if op_name == "AVG":
                            exact = exact / w
                        assert _bitwise_equal(first, exact), \
                            f"{case}: not the {op_name} of chunk {r}"
                    else:
                        torch.testing.assert_close(first, ref, msg=f"{case}: differs from torch's")
                    checked.append(case)

    # The result does not alias the (overwritten) flat gradient.
    for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
        flat = _data(rank, world * 8, "int")
        work = C.reduce_scatter(flat, None, op)
        res = work.wait()
        keep = res.clone()
        flat.fill_(float("nan"))
        assert _bitwise_equal(res, keep), f"{op}: the result aliases the flat gradient"
        assert _bitwise_equal(work.wait(), keep), op
    return checked


# ---------------------------------------------------------------------------
# the in-place gloo path is the one taken; comm_stats counts logical calls


def _op_names(prof) -> dict[str, int]:
    return {e.key: e.count for e in prof.key_averages()}


def _gloo_path(rank, world):
    S = 64
    _gloo.P2P_MAX_BYTES = 0  # the all-reduce path (the exchange: _gloo_exchange_path)
    C.reset_comm_stats()
    out = torch.empty(world * S)
    out_bf16 = torch.empty(world * S, dtype=torch.bfloat16)
    flat = _data(rank, world * S, "int")
    acts = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as p_ag:
        C.all_gather(out, _data(rank, S, "randn"), None).wait()
    with torch.profiler.profile(activities=acts) as p_rs:
        C.reduce_scatter(flat, None).wait()
    C.all_gather(out_bf16, torch.ones(S, dtype=torch.bfloat16), None).wait()
    stats = C.comm_stats()
    # the native collectives, for reference: their op names must be the ones we look for
    with torch.profiler.profile(activities=acts) as p_native:
        _native_all_gather(torch.empty(world * S), torch.ones(S))
        _native_reduce_scatter(torch.empty(S), _data(rank, world * S, "int"), op=dist.ReduceOp.AVG)
    return _op_names(p_ag), _op_names(p_rs), _op_names(p_native), stats


# ---------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_matches_torch(world):
    cases = run_distributed(_all_gather_cases, world)
    # fp32/bf16 × 3 sizes × in place or not, on each group (at 4 ranks, rank 0 is in two)
    assert [len(c) for c in cases] == ([24] * 2 if world == 2 else [24] + [36] * 3), cases


@pytest.mark.parametrize("path", ["all_reduce", "exchange"])
@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_matches_torch(world, path):
    cases = run_distributed(_reduce_scatter_cases, world, path)
    # AVG/SUM × integer/random data × 3 sizes, on each group
    assert [len(c) for c in cases] == ([24] * 2 if world == 2 else [24] + [36] * 3), cases


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_path_is_broadcast_and_all_reduce(world):
    S = 64
    for rank, (ag, rs, native, stats) in enumerate(run_distributed(_gloo_path, world)):
        # the names checked below are torch's names for these collectives
        assert "c10d::_allgather_base_" in native, native
        assert "c10d::_reduce_scatter_base_" in native, native
        assert ag.get("c10d::broadcast_") == world, (rank, ag)  # one broadcast per rank
        assert not any("allgather" in k or "all_gather" in k or "allreduce" in k
                       or "reduce_scatter" in k for k in ag), (rank, ag)
        assert rs.get("c10d::allreduce_") == 1, (rank, rs)
        assert not any("allgather" in k or "all_gather" in k or "broadcast" in k
                       or "reduce_scatter" in k for k in rs), (rank, rs)
        # one logical call each; bytes: the all-gather output, the reduce-scatter input
        assert stats.all_gather_calls == 2 and stats.reduce_scatter_calls == 1, stats
        assert stats.all_gather_bytes == world * S * 4 + world * S * 2, stats
        assert stats.reduce_scatter_bytes == world * S * 4, stats
        assert stats.all_reduce_calls == 0 and stats.all_reduce_bytes == 0, stats


def _gloo_exchange_path(rank, world):
    S = 64  # 512 B: below _gloo.P2P_MAX_BYTES
    C.reset_comm_stats()
    flat = _data(rank, world * S, "int")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p_rs:
        C.reduce_scatter(flat, None).wait()
    return _op_names(p_rs), C.comm_stats()


@pytest.mark.parametrize("world", [2, 4])
def test_small_gloo_reduce_scatter_over_2_ranks_is_an_exchange(world):
    """2 ranks: one send and one receive, no all-reduce (no scratch buffer on
    gloo's worker thread, see [Note: gloo collectives]); more ranks: the
    all-reduce. Counted as one reduce-scatter of the whole input either way."""
    for rank, (rs, stats) in enumerate(run_distributed(_gloo_exchange_path, world)):
        if world == 2:
            assert rs.get("c10d::send") == 1 and rs.get("c10d::recv_") == 1, (rank, rs)
            assert not any("allreduce" in k or "broadcast" in k or "reduce_scatter" in k
                           for k in rs), (rank, rs)
        else:
            assert rs.get("c10d::allreduce_") == 1 and "c10d::send" not in rs, (rank, rs)
        assert stats.reduce_scatter_calls == 1 and stats.reduce_scatter_bytes == world * 64 * 4
        assert stats.all_reduce_calls == 0, stats


# ---------------------------------------------------------------------------
# padded collectives: uneven pieces as ONE equal-size collective (every backend
# but gloo; forced here on gloo with ``padded=True``)


def _uneven_bounds(w: int) -> tuple:
    """Pieces of 0, 8, 24, 4, ... elements (multiples of 4, one empty)."""
    sizes = [(0, 8, 24, 4)[i % 4] for i in range(w)]
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return tuple(out)


def _padded_cases(rank, world):
    calls = []
    real_ag, real_rs = C._all_gather_tensor, C._reduce_scatter_tensor

    def spy_ag(*a, **k):
        calls.append("all_gather_into_tensor")
        return real_ag(*a, **k)

    def spy_rs(*a, **k):
        calls.append("reduce_scatter_tensor")
        return real_rs(*a, **k)
    C._all_gather_tensor, C._reduce_scatter_tensor = spy_ag, spy_rs
    dist.all_gather = dist.reduce_scatter = None  # the list forms: never called
    checked = []
    try:
        for gname, group in _groups(rank, world):
            members = _members(group)
            w, r = len(members), dist.get_rank(group)
            bounds = _uneven_bounds(w)
            numel = bounds[-1] + 4 * w  # a tail the collective never writes
            for async_op in (True, False):
                case = f"{gname} async={async_op}"
                mine = _data(rank, bounds[r + 1] - bounds[r], "randn")
                out = torch.full((numel,), float("nan"))
                n0 = len(calls)
                work = C.all_gather(out, mine.clone(), group, async_op=async_op, bounds=bounds,
                                    padded=True)
                work.wait()
                assert calls[n0:] == ["all_gather_into_tensor"], (case, calls[n0:])
                expect = torch.cat([_data(m, bounds[i + 1] - bounds[i], "randn")
                                    for i, m in enumerate(members)])
                assert _bitwise_equal(out[:bounds[-1]], expect), case
                assert out[bounds[-1]:].isnan().all(), case  # the tail untouched
                # reduce-scatter of integer data: every order sums to the same bits
                for op_name in ("SUM", "AVG"):
                    op = getattr(dist.ReduceOp, op_name)
                    flats = [_data(m, numel, "int") for m in members]
                    n0 = len(calls)
                    res = C.reduce_scatter(flats[r].clone(), group, op, async_op=async_op,
                                           bounds=bounds, padded=True).wait()
                    assert calls[n0:] == ["reduce_scatter_tensor"], (case, calls[n0:])
                    total = torch.stack(flats).sum(0)[bounds[r]:bounds[r + 1]]
                    want = total / w if op_name == "AVG" else total
                    assert _bitwise_equal(res, want), f"{case} {op_name}"
                checked.append(case)
    finally:
        C._all_gather_tensor, C._reduce_scatter_tensor = real_ag, real_rs
    return checked


@pytest.mark.parametrize("world", [2, 4])
def test_padded_uneven_collectives(world):
    """One ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` per call, the
    list forms never called; the pieces land at their true offsets (empty
    pieces and subgroups included) and the flat's tail is untouched."""
    out = run_distributed(_padded_cases, world)
    assert all(out), out


@pytest.mark.fast
def test_pack_unpack_in_a_bucket_row():
    """The staging copies alone (no process): pieces padded to the largest,
    in a bucket row after another group's columns, and back; the padding zeroed."""
    bounds = (0, 12, 12, 40, 48)   # pieces 12, 0, 28, 8: padded to 28
    slot, row, at = 28, 28 + 4 + 36, 4
    flat = torch.arange(48, dtype=torch.float32) + 1
    staging = torch.full((4 * row,), -1.0)
    C.pack(staging, flat, bounds, slot, row, at)
    rows = staging.view(4, row)
    for r in range(4):
        n = bounds[r + 1] - bounds[r]
        assert torch.equal(rows[r, at:at + n], flat[bounds[r]:bounds[r + 1]])
        assert (rows[r, at + n:at + slot] == 0).all()     # padding zeroed
        assert (rows[r, :at] == -1).all() and (rows[r, at + slot:] == -1).all()  # others' columns
    back = torch.zeros(52)
    C.unpack(back, staging, bounds, slot, row, at)
    assert torch.equal(back[:48], flat) and (back[48:] == 0).all()
