"""The side-stream protocol of the stream manager (CUDA's), checked on CPU.

No GPU here: the manager takes a ``runtime`` (streams and events), and this
test gives it a recording double whose events order nothing (``StreamDouble``
of tests/_support.py), over gloo. What it checks is what the CUDA path relies
on (see [Note: side streams] in fsdp_compose/_comm/_streams.py):

- every all-gather is issued on the all-gather stream, every reduce-scatter
  (and the all-reduce of its used-flags) on the reduce-scatter stream, never
  on the compute stream;
- before issuing, the side stream waits for an event just recorded on the
  compute stream (the inputs are written); after, it records an event that
  the compute stream waits for before the result is used;
- no tensor a collective touches is released before the compute stream has
  waited for that collective's event (what makes ``record_stream``
  unnecessary);
- training with this manager (the non-blocking schedule: waits only order
  streams, as on NCCL) matches the default gloo schedule bitwise and a
  single-process reference.
"""
from __future__ import annotations

import contextlib
import copy
import gc

import pytest
import torch
import torch.distributed as dist

from fsdp_compose import fully_shard, param_info

from fsdp_compose._group import _grad_path
from ._pieces import piece_close

from ._dist import run_distributed
from ._support import (Net, StreamDouble, check_stream_protocol, per_unit_collectives,
                       recording, rows)


# the collectives the stream manager issues in training, each checked by check_stream_protocol
_KINDS = ("all_gather", "reduce_scatter", "all_reduce_async")


def _train(streams: bool, per_unit: bool, padded: bool = False):
    """Two steps of ours (4 blocks + root, resharding after forward); the log if
    ``streams``. ``padded``: every row layout uneven pieces, gathered and
    reduced by the padded equal-size collectives (NCCL's path, here on gloo:
    [Note: padded collectives] in fsdp_compose/_comm/_collectives.py)."""
    torch.manual_seed(0)
    model = Net(n=4)
    ref = copy.deepcopy(model)
    # two side streams (all-gather, reduce-scatter): a third is an error
    rt = StreamDouble(side_streams=("ag", "rs")) if streams else None
    patched = []
    if streams:  # every root's stream manager runs on rt, every collective is logged
        seam = contextlib.ExitStack()
        seam.enter_context(recording(rt, kinds=_KINDS, logged=_KINDS))
        patched.append(seam.close)
    if per_unit:  # the used-flags' own all-reduce (large flat gradients) is checked too
        seam = _grad_path.inline_flags_limit(0)
        seam.__enter__()
        patched.append(lambda: seam.__exit__(None, None, None))
    try:
        from fsdp_compose._comm import _collectives
        from fsdp_compose._plan import _layout
        _layout.FORCE_EVEN, _collectives.PAD_UNEVEN_ON_GLOO = (False, True) if padded else (None,
                                                                                           False)
        try:
            for layer in model.layers:
                fully_shard(layer)
            fully_shard(model)
        finally:
            _layout.FORCE_EVEN, _collectives.PAD_UNEVEN_ON_GLOO = None, False
        if padded:
            assert all(g.padded() for u in [model, *model.layers] for g in u._unit().groups)
        if per_unit:
            per_unit_collectives(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
        rank, world = dist.get_rank(), dist.get_world_size()
        out = {"params": [], "ref_close": True}
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(4 * world, 3, generator=g)
            model(x[4 * rank:4 * rank + 4]).pow(2).mean().backward()
            ref(x).pow(2).mean().backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                out["ref_close"] &= piece_close(p.grad, q.grad, param_info(p).local_range,
                                                atol=1e-6)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        out["params"] = [rows(p).detach().clone() for p in model.parameters()]  # this rank's
        out["manager"] = repr(model._unit().ctx.streams)
        del model, opt
        gc.collect()  # every release is in the log
        out["log"] = rt.log if streams else None
        return out
    finally:
        for undo in patched:
            undo()


def _both(rank, world, per_unit, padded=False):
    return _train(False, per_unit, padded), _train(True, per_unit, padded)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("per_unit", [False, True], ids=["bucketed", "per_unit"])
def test_side_stream_protocol(world, per_unit):
    for default, streams in run_distributed(_both, world, per_unit):
        assert default["manager"].startswith("BlockingStreams(")
        assert streams["manager"].endswith("mode=side-streams)")
        assert default["ref_close"] and streams["ref_close"]
        assert all(torch.equal(a, b) for a, b in zip(default["params"], streams["params"]))
        assert check_stream_protocol(streams["log"]) == []
        kinds = {e[2] for e in streams["log"] if e[0] == "issue"}
        # per unit, the used-flags go in an all-reduce of their own (forced:
        # these flat gradients are small enough to carry them inline)
        assert kinds == {"all_gather", "reduce_scatter"} | ({"all_reduce_async"} if per_unit
                                                            else set())


@pytest.mark.parametrize("world", [2, 4])
def test_side_stream_protocol_padded(world):
    """The same with uneven pieces, each group alone (per unit, flags in their
    own all-reduce): the padded collectives and their staging copies run
    inside the side-stream hand-off, and train as the default schedule does."""
    for default, streams in run_distributed(_both, world, True, True):
        assert default["ref_close"] and streams["ref_close"]
        assert all(torch.equal(a, b) for a, b in zip(default["params"], streams["params"]))
        assert check_stream_protocol(streams["log"]) == []


@pytest.mark.fast
def test_protocol_check_can_fail():
    """The checker catches a collective on the wrong stream, a missing hand-off
    and an early release."""
    ok = [("record", "compute", 0), ("wait", "ag", 0), ("issue", "ag", "all_gather"),
          ("record", "ag", 1), ("wait", "compute", 1), ("release", 2)]
    assert check_stream_protocol(ok) == []
    assert check_stream_protocol([e if e[0] != "issue" else ("issue", "compute", "all_gather")
                                  for e in ok])
    assert check_stream_protocol([("record", "compute", 0)] + ok[2:])
    assert check_stream_protocol(ok[:4] + [("release", 2), ("wait", "compute", 1)])
    assert check_stream_protocol(ok[:4])
