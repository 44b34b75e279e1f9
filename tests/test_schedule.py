"""The schedule of one training step, as recorded from the hook seams.

Tests the *order* of unshard / reshard / reduce-scatter, not only the numbers:
refresh the literals with EXPECTTEST_ACCEPT=1 after an intended change.
"""
from __future__ import annotations

import expecttest
import torch
import torch.nn as nn

from fsdp_compose import comm_stats, fully_shard, record_schedule, reset_comm_stats

from ._dist import run_distributed
from ._support import ONE_STEP_CPU, Block, Net, per_unit_collectives, shard
from ._support import schedule_text as _fmt


def _calls() -> tuple[int, int]:
    s = comm_stats()
    return s.all_gather_calls, s.reduce_scatter_calls


def _one_step(rank, world, per_unit=True):
    m = shard(Net(n=2))
    if per_unit:
        per_unit_collectives(m)
    x = torch.randn(2, 3)
    m(x).sum().backward()  # first step: lazy init, order recording
    reset_comm_stats()
    with record_schedule() as ev:
        m(x).sum().backward()
    return _fmt(ev), _calls()


def _prefetch_knobs(rank, world):
    out = {}
    for name in ("depth0", "explicit"):
        m = per_unit_collectives(shard(Net(n=3)))
        if name == "depth0":
            m.set_prefetch_depth(0)
        else:  # forward: layers.0 fetches layers.2 (not layers.1); backward: layers.2 -> layers.0
            m.set_prefetch_depth(0)
            m.layers[0].set_modules_to_forward_prefetch([m.layers[2]])
            m.layers[2].set_modules_to_backward_prefetch([m.layers[0]])
        x = torch.randn(2, 3)
        m(x).sum().backward()
        with record_schedule() as ev:
            m(x).sum().backward()
        out[name] = _fmt(e for e in ev if e[0] in ("pre_forward", "pre_backward", "all_gather",
                                                  "prefetch"))
    return out


class Branchy(nn.Module):
    """layers.1 contributes to the loss only on rank 0."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 6)
        self.layers = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x, use_branch: bool):
        x = self.layers[0](self.inp(x))
        y = self.layers[1](x)
        y = y if use_branch else y.detach() * 0
        return self.layers[2](x + y)


def _unused_on_rank1(rank, world, per_unit=True):
    m = Branchy()
    for layer in m.layers:
        fully_shard(layer)
    fully_shard(m)
    if per_unit:
        per_unit_collectives(m)
    x = torch.randn(2, 3)
    reset_comm_stats()
    with record_schedule() as ev:
        m(x, use_branch=(rank == 0)).sum().backward()
    # used on rank 0 only: p.grad on every rank, empty where it holds no rows of p
    grads_set = all(p.grad is not None and p.grad.shape == p.shape
                    for p in m.layers[1].parameters())
    start = next(i for i, e in enumerate(ev) if e[0] == "pre_backward")
    return _fmt(e for e in ev[start:] if e[0] in ("all_gather", "reduce_scatter",
                                                   "final_callback")), grads_set, _calls()


def _world_one(rank, world):
    """World size 1: the blocks are passive (no hooks), only the root's events;
    a block with a cast keeps its hooks."""
    from fsdp_compose import MixedPrecisionPolicy
    out = []
    for cast in (False, True):
        m = Net(n=2)
        fully_shard(m.layers[0])
        fully_shard(m.layers[1], mp_policy=MixedPrecisionPolicy(param_dtype=torch.float64,
                                                                  output_dtype=torch.float32)
                    if cast else None)
        fully_shard(m)
        x = torch.randn(2, 3)
        with record_schedule() as ev:
            m(x).sum().backward()  # first step: lazy init
            m(x).sum().backward()
        out.append(_fmt(ev))
    return out


class TestSchedule(expecttest.TestCase):
    def test_world_size_one(self):
        plain, cast = run_distributed(_world_one, 1)[0]
        self.assertExpectedInline(plain, """\
lazy_init units=3, 2 without hooks
pre_forward IDLE
post_forward FORWARD
pre_backward IDLE
final_callback
reshard PRE_BACKWARD
pre_forward IDLE
post_forward FORWARD
pre_backward IDLE
final_callback
reshard PRE_BACKWARD""")
        self.assertExpectedInline(cast, """\
lazy_init units=3, 1 without hooks
pre_forward IDLE
pre_forward layers.1 IDLE
post_forward layers.1 FORWARD
reshard layers.1 FORWARD
post_forward FORWARD
pre_backward IDLE
pre_backward layers.1 IDLE
post_backward layers.1 PRE_BACKWARD
reshard layers.1 POST_BACKWARD
reduce_scatter layers.1 ready
final_callback
reshard PRE_BACKWARD
pre_forward IDLE
prefetch layers.1 forward
pre_forward layers.1 IDLE
post_forward layers.1 FORWARD
reshard layers.1 FORWARD
post_forward FORWARD
pre_backward IDLE
pre_backward layers.1 IDLE
post_backward layers.1 PRE_BACKWARD
reshard layers.1 POST_BACKWARD
reduce_scatter layers.1 ready
final_callback
reshard PRE_BACKWARD""")

    def test_one_step(self):
        (rank0, calls0), (rank1, calls1) = run_distributed(_one_step, 2)
        self.assertEqual((rank0, calls0), (rank1, calls1))
        self.assertEqual(calls0, (3 + 2, 3))  # per unit: forward 3, backward the 2 blocks
        self.assertEqual(rank0, ONE_STEP_CPU)  # (tests/test_fake_group.py, in process, too)

    def test_unit_without_gradient_on_one_rank(self):
        (r0, set0, calls0), (r1, set1, calls1) = run_distributed(_unused_on_rank1, 2)
        # per unit: forward 4, backward the 3 blocks; every unit reduce-scatters
        self.assertEqual(calls0, (4 + 3, 4))
        self.assertEqual(calls1, calls0)
        for kind in ("all_gather", "reduce_scatter"):  # one order per kind on every rank
            units = [[line.split()[1] for line in r.splitlines() if line.startswith(kind)]
                     for r in (r0, r1)]
            self.assertEqual(units[0], units[1], kind)
        # rank 1's backward never reaches layers.1: it all-gathers it (rank 0
        # needs that collective) and reduce-scatters zeros for it from the final
        # callback, in the same positions of the two orders as rank 0 does.
        self.assertExpectedInline(r0, """\
all_gather layers.2 PRE_BACKWARD
all_gather layers.1 IDLE
reduce_scatter layers.2 ready
all_gather layers.0 IDLE
reduce_scatter layers.1 ready
reduce_scatter layers.0 ready
reduce_scatter ready
final_callback""")
        self.assertExpectedInline(r1, """\
all_gather layers.2 PRE_BACKWARD
all_gather layers.1 IDLE
reduce_scatter layers.2 ready
all_gather layers.0 PRE_BACKWARD
final_callback
reduce_scatter layers.1 zero-filled
reduce_scatter layers.0 ready
reduce_scatter ready""")
        self.assertTrue(set0 and set1)

    def test_prefetch_knobs(self):
        r = run_distributed(_prefetch_knobs, 2)[0]
        # depth 0: every unit gathers itself, when it starts
        self.assertExpectedInline(r["depth0"], """\
pre_forward IDLE
all_gather FORWARD
pre_forward layers.0 IDLE
all_gather layers.0 FORWARD
pre_forward layers.1 IDLE
all_gather layers.1 FORWARD
pre_forward layers.2 IDLE
all_gather layers.2 FORWARD
pre_backward IDLE
pre_backward layers.2 IDLE
all_gather layers.2 PRE_BACKWARD
pre_backward layers.1 IDLE
all_gather layers.1 PRE_BACKWARD
pre_backward layers.0 IDLE
all_gather layers.0 PRE_BACKWARD""")
        # explicit lists override the order; backward prefetch of layers.0 from
        # layers.2 also gathers layers.1 (between them in the gather order)
        self.assertExpectedInline(r["explicit"], """\
pre_forward IDLE
all_gather FORWARD
pre_forward layers.0 IDLE
all_gather layers.0 FORWARD
prefetch layers.2 forward
all_gather layers.2 IDLE
pre_forward layers.1 IDLE
all_gather layers.1 FORWARD
pre_forward layers.2 IDLE
pre_backward IDLE
pre_backward layers.2 IDLE
all_gather layers.2 PRE_BACKWARD
all_gather layers.1 IDLE
all_gather layers.0 IDLE
pre_backward layers.1 IDLE
pre_backward layers.0 IDLE""")

    def test_one_bucketed_step(self):
        # Default knobs: 1 MiB buckets, and the whole model is 1,632 bytes. The
        # second step's forward gathers every unit as ONE bucket from the
        # root's pre-forward (in the first step's forward order, so nothing is
        # left to prefetch); backward gathers the resharded blocks, in the
        # gather order (layers.1, then layers.0), as one bucket from the root's
        # pre-backward; the three units reduce-scatter as one bucket, in the
        # reduce order, when the last of them (the root) is ready.
        (rank0, calls0), (rank1, calls1) = run_distributed(_one_step, 2, False)
        self.assertEqual((rank0, calls0), (rank1, calls1))
        self.assertEqual(calls0, (1 + 1, 1))
        self.assertExpectedInline(rank0, """\
pre_forward IDLE
all_gather bucketed
all_gather layers.0 bucketed
all_gather layers.1 bucketed
pre_forward layers.0 IDLE
post_forward layers.0 FORWARD
reshard layers.0 FORWARD
pre_forward layers.1 IDLE
post_forward layers.1 FORWARD
reshard layers.1 FORWARD
post_forward FORWARD
pre_backward IDLE
all_gather layers.1 bucketed
all_gather layers.0 bucketed
pre_backward layers.1 IDLE
reshard layers.1 grads computed
post_backward layers.1 PRE_BACKWARD
pre_backward layers.0 IDLE
reshard layers.0 grads computed
post_backward layers.0 PRE_BACKWARD
reshard grads computed
post_backward PRE_BACKWARD
reduce_scatter layers.1 bucketed
reduce_scatter layers.0 bucketed
reduce_scatter bucketed
final_callback""")

    def test_unit_without_gradient_on_one_rank_bucketed(self):
        (r0, set0, calls0), (r1, set1, calls1) = run_distributed(_unused_on_rank1, 2, False)
        # Default buckets, first step: forward gathers per unit (4, no recorded
        # order yet); backward gathers the 3 blocks as one bucket. The 4 units
        # reduce-scatter as one bucket: on rank 0 when the root is ready, on
        # rank 1 (no gradient for layers.1) from the final callback, with
        # layers.1 zero-filled: the same collective on both ranks.
        self.assertEqual(calls0, (4 + 1, 1))
        self.assertEqual(calls1, calls0)
        self.assertTrue(set0 and set1)
        self.assertExpectedInline(r0, """\
all_gather layers.2 bucketed
all_gather layers.1 bucketed
all_gather layers.0 bucketed
reduce_scatter layers.2 bucketed
reduce_scatter layers.1 bucketed
reduce_scatter layers.0 bucketed
reduce_scatter bucketed
final_callback""")
        self.assertExpectedInline(r1, """\
all_gather layers.2 bucketed
all_gather layers.1 bucketed
all_gather layers.0 bucketed
final_callback
reduce_scatter layers.2 bucketed
reduce_scatter layers.1 bucketed zero-filled
reduce_scatter layers.0 bucketed
reduce_scatter bucketed""")
