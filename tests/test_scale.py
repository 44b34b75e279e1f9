"""One training step at 256, 1024 and 4096 ranks, simulated: torch's fake
process group on CPU, as rank 0 and as the most-loaded rank.

The fake group's backend is not gloo, so groups of uneven pieces take the path
every backend but gloo takes ([Note: padded collectives] in
fsdp_compose/_comm/_collectives.py): one equal-size ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` per bucket, pieces padded through a staging buffer.
(The backward is the blocking one, as on any CPU backend.) The model is the
demo Llama at dim 64 with every row layout forced to uneven pieces (at these
sizes a model this small would take equal chunks).

The fake group moves no data, so the collectives are made to act as if every
rank held the same model: an all-gather writes this rank's piece into its row
(and 0.01 elsewhere), a reduce-scatter returns this rank's row of the input
(the average of W equal inputs). Each step asserts that the collectives issued
are the planner's (calls and bytes: tools/plan.py, on the same settings),
that every collective is the equal-size one (the list forms are never
called, input = W x output), and that every gradient shard holds the rows
of the flat gradient at the rank's true offsets.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_compose import comm_stats, reset_comm_stats

from fsdp_compose._comm import _collectives

pytestmark = pytest.mark.filterwarnings("ignore")


def _config():
    from tools.plan import PlanConfig
    return PlanConfig(model="demo", dim=64, layers=2, vocab=128, row_layout="uneven",
                      schedule="gloo", backend="fake")


class _Emulated:
    """The collectives as if every rank held the same model (see the module doc)."""

    def __init__(self, world: int, rank: int):
        self.world, self.rank = world, rank
        self.calls: list[tuple[str, int, int]] = []  # (kind, input numel, output numel)

    def __enter__(self):
        self._saved = (_collectives._all_gather_tensor, _collectives._reduce_scatter_tensor,
                       dist.all_gather, dist.reduce_scatter)
        real_ag, real_rs = self._saved[:2]
        W, r = self.world, self.rank

        def all_gather(output, shard, **kw):
            work = real_ag(output, shard, **kw)
            self.calls.append(("all_gather", shard.numel(), output.numel()))
            rows = output.view(W, -1)
            rows.fill_(0.01)
            rows[r].copy_(shard)
            return work

        def reduce_scatter(output, inp, **kw):
            work = real_rs(output, inp, **kw)
            self.calls.append(("reduce_scatter", inp.numel(), output.numel()))
            output.copy_(inp.view(W, -1)[r])
            return work

        def refused(*a, **k):
            raise AssertionError("a list collective was issued")
        _collectives._all_gather_tensor, _collectives._reduce_scatter_tensor = \
            all_gather, reduce_scatter
        dist.all_gather = dist.reduce_scatter = refused
        return self

    def __exit__(self, *exc):
        (_collectives._all_gather_tensor, _collectives._reduce_scatter_tensor,
         dist.all_gather, dist.reduce_scatter) = self._saved


def _step(world: int, rank: int, cfg, lanes: bool = False) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_compose._group._grad_path import GradientPath
    from tools import _measure

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    taken: list = []
    real_take = GradientPath.take_grad

    def take(path):  # the flat gradient each reduction starts from (pre-divided)
        t = real_take(path)
        taken.append((path.group, t.flat_grad.clone()))
        return t
    try:
        with _Emulated(world, rank) as emu:
            model, units, optim, inputs = _measure.setup(cfg, rank, world)
            groups = [g for u in units for g in u.groups]
            assert any(g.padded() for g in groups) and all(not g.layout.even for g in groups
                                                           if g.world > 1)
            if lanes:
                assert any(g.layout.lanes for g in groups)
            _measure.train_step(model, optim, inputs)
            reset_comm_stats()
            emu.calls.clear()
            GradientPath.take_grad = take
            _measure._loss(model(*inputs)).backward()
            GradientPath.take_grad = real_take
            c = comm_stats()
            # every gradient shard: the flat gradient's rows at this rank's offsets
            checked = 0
            for g, flat in taken:
                for e in g.entries:
                    a, b = e.local_range
                    if e.sharded.grad is None or b <= a:
                        continue
                    at = g.layout.offsets[g.entries.index(e)]
                    want = flat[at + a:at + b]
                    got = e.grad_rows().reshape(-1)
                    assert torch.equal(got, want.to(got.dtype)), (e.fqn, rank)
                    checked += 1
            optim.step()
            optim.zero_grad(set_to_none=True)
            calls = list(emu.calls)
    finally:
        GradientPath.take_grad = real_take
        dist.destroy_process_group()
    return {"comm": c, "calls": calls, "checked": checked}


@pytest.mark.parametrize("world", [pytest.param(256, marks=pytest.mark.fast), 1024, 4096])
def test_one_step_at_scale_issues_the_planners_collectives(world):
    from tools.plan import plan_world
    cfg = _config()
    wp = plan_world(cfg, world)
    row = wp.row
    assert row["uneven_groups"] > 0
    for rank in sorted({0, row["most_loaded_rank"]}):
        got = _step(world, rank, cfg)
        c = got["comm"]
        for k in ("all_gather_calls", "reduce_scatter_calls", "all_reduce_calls",
                  "all_gather_bytes", "reduce_scatter_bytes"):
            assert getattr(c, k) == row[k], (rank, k, getattr(c, k), row[k])
        # one equal-size collective per bucket: input = W x output
        for kind, n_in, n_out in got["calls"]:
            if kind == "all_gather":
                assert n_out == world * n_in, (kind, n_in, n_out)
            else:
                assert n_in == world * n_out, (kind, n_in, n_out)
        kinds = [k for k, _, _ in got["calls"]]
        assert kinds.count("all_gather") == c.all_gather_calls
        assert kinds.count("reduce_scatter") == c.reduce_scatter_calls
        assert row["nccl_ops"] == row["collective_calls"]
        assert got["checked"] > 0


@pytest.mark.fast
def test_one_step_in_two_lanes():
    """At dim 256 over 256 ranks the blocks' rows (256 and 704 elements
    against a share of 3138) pad one lane by 6%: the blocks take two lanes
    ([Note: lanes] in fsdp_compose/_plan/_layout.py), each rank's shard two
    ranges of the flat. The step issues the planner's collectives, every one
    the equal-size one, and every gradient shard holds the flat gradient's
    rows at the rank's true offsets."""
    import dataclasses

    from tools.plan import plan_world
    cfg = dataclasses.replace(_config(), layers=1, dim=256, vocab=1024)
    world = 256
    row = plan_world(cfg, world).row
    for rank in sorted({0, row["most_loaded_rank"], world - 1}):
        got = _step(world, rank, cfg, lanes=True)
        c = got["comm"]
        for k in ("all_gather_calls", "reduce_scatter_calls", "all_gather_bytes",
                  "reduce_scatter_bytes"):
            assert getattr(c, k) == row[k], (rank, k, getattr(c, k), row[k])
        for kind, n_in, n_out in got["calls"]:
            assert (n_out == world * n_in) if kind == "all_gather" else (n_in == world * n_out)
        assert got["checked"] > 0


def simulated_calls(layers: int, world: int) -> dict:
    """Collectives per step of the demo Llama's unit structure (``layers``
    blocks and the root; dim 256 and vocab 1024, so that every unit is past
    the 1 MiB bucket and every group past the 256 KiB of inline flags, as
    in the 6.6B and 70B shapes; uneven pieces forced) in one simulated step
    as rank 0, with the planner's count for it: the counts depend on the
    units and groups, not on the width (docs/scale.md)."""
    import dataclasses

    from tools.plan import plan_world
    cfg = dataclasses.replace(_config(), layers=layers, dim=256, vocab=1024)
    row = plan_world(cfg, world).row
    c = _step(world, 0, cfg)["comm"]
    calls = c.all_gather_calls + c.reduce_scatter_calls + c.all_reduce_calls
    return {"simulated": calls, "planned": row["collective_calls"]}


if __name__ == "__main__":
    for layers in (32, 80):
        for world in (8, 256, 1024, 4096):
            print(layers, world, simulated_calls(layers, world), flush=True)
