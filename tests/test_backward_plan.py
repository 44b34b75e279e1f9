"""The backward plan as a pure function of the forward's record
(fsdp_compose/_plan/_backward_plan.py): gather and reduce orders, slots, prefetch
stops and reduce buckets, built without processes or modules. The same plan
runs every backward (RootContext) and the planner's replay (tools/_planner.py).
"""
from __future__ import annotations

import pytest

from fsdp_compose._plan._backward_plan import StepRecord, build_plan

pytestmark = pytest.mark.fast  # no process: the one-minute tier (make test-fast)


def _chain(*inner: str, root: str = "r") -> StepRecord:
    """The root's forward around ``inner`` units run one after another, every
    output seeing a backward."""
    rec = StepRecord()
    rec.record_pre(root)
    for u in inner:
        rec.record_pre(u)
        rec.expect_backward(u)
    rec.expect_backward(root)
    return rec


def test_orders_slots_and_stops_of_a_chain():
    plan = build_plan(_chain("a", "b", "c"), prefetch_depth=1)
    # gather order: last post-forward, latest first (the root's ends last);
    # reduce order: first pre-forward, latest first (the root's began first)
    assert plan.gather_order == ("r", "c", "b", "a")
    assert plan.reduce_order == ("c", "b", "a", "r")
    assert dict(plan.stops) == {"r": 1, "c": 2, "b": 3, "a": 3}
    assert plan.stop("c", prefetch=False) == 1
    # c's reduce-scatter after b's all-gather (c's prefetch), and so on
    assert plan.slots == (2, 3, 3, 3)
    assert plan.reduces == (True, True, True, True)


def test_without_prefetch_each_reduce_scatter_follows_its_consumers_gathers():
    plan = build_plan(_chain("a", "b", "c"), prefetch_depth=0)
    assert plan.slots == (1, 2, 3, 3)


def test_explicit_backward_prefetch_moves_the_stop():
    plan = build_plan(_chain("a", "b", "c"), prefetch_depth=1,
                      backward_prefetch=lambda u: ["b"] if u == "r" else None)
    assert plan.stops["r"] == 2  # r prefetches up to b (over c)
    assert plan.slots[0] == 2


@pytest.mark.parametrize("frozen_root, ends", [(False, (False, True, False, True)),
                                               (True, (False, True, True, False))])
def test_reduce_buckets_close_before_the_limit(frozen_root, ends):
    sizes = {"a": 4, "b": 4, "c": 4, "r": 1}
    plan = build_plan(_chain("a", "b", "c"), prefetch_depth=1, grad_bytes=sizes.__getitem__,
                      reduces=lambda u: not (frozen_root and u == "r"), bucket_bytes=8)
    # c + b fill 8 bytes; a + r (5) close at the last unit to reduce
    assert plan.bucket_ends == ends


def test_a_larger_unit_goes_alone():
    sizes = {"a": 2, "b": 20, "c": 2, "r": 2}
    plan = build_plan(_chain("a", "b", "c"), prefetch_depth=1, grad_bytes=sizes.__getitem__,
                      bucket_bytes=8)
    assert plan.reduce_order == ("c", "b", "a", "r")
    assert plan.bucket_ends == (True, True, False, True)


def test_pending_units_reduce_last():
    plan = build_plan(_chain("a", "b"), pending=["x", "a", "y"], prefetch_depth=1,
                      completes=lambda u: u != "y")
    # x (not run in this backward, its reduction finishing now) after the rest;
    # a ran: once, in its place; y still does not complete: not in the order
    assert plan.reduce_order == ("b", "a", "r", "x")
    assert plan.slots[-1] == len(plan.gather_order) - 1


def test_a_checkpoint_region_reduces_after_all_of_its_gathers():
    rec = StepRecord()
    rec.record_pre("r")
    for u in ("a", "b", "c"):
        rec.record_pre(u)
        if u in ("a", "c"):
            rec.add_region(u, "region-1")  # c's recompute gathers a's parameters too
        rec.expect_backward(u)
    rec.expect_backward("r")
    plain = build_plan(_chain("a", "b", "c"), prefetch_depth=0)
    plan = build_plan(rec, prefetch_depth=0)
    assert plain.slots[0] == 1 and plan.slots[0] == 3  # after a's all-gather (index 3)


def test_islands_and_a_unit_used_twice():
    rec = StepRecord()
    rec.record_pre("r")
    rec.record_pre("a")
    rec.expect_backward("a")
    rec.record_pre("i")
    rec.expect_backward("i", island=True)  # no-grad island: in both orders
    rec.record_pre("a")                    # a again: its last post-forward counts
    rec.expect_backward("a")
    rec.expect_backward("r")
    plan = build_plan(rec, prefetch_depth=0)
    assert plan.gather_order == ("r", "a", "i")
    assert plan.reduce_order == ("i", "a", "r")
    assert rec.expects_backward("a") and not rec.expects_backward("i")


def test_a_record_clears_but_its_clock_runs_on():
    rec = _chain("a")
    clock = rec.clock
    rec.clear()
    assert not rec.step_order and not rec.in_orders and rec.clock == clock
    assert build_plan(rec, prefetch_depth=1).gather_order == ()


def test_the_plan_is_frozen():
    plan = build_plan(_chain("a"), prefetch_depth=1)
    with pytest.raises(AttributeError):
        plan.slots = ()
    with pytest.raises(TypeError):
        plan.gather_pos["a"] = 0
