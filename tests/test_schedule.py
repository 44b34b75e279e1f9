"""The schedule of one training step, as recorded from the hook seams.

Tests the *order* of unshard / reshard / reduce-scatter, not only the numbers:
refresh the literals with EXPECTTEST_ACCEPT=1 after an intended change.
"""
from __future__ import annotations

import expecttest
import torch
import torch.nn as nn

from fsdp_compose import fully_shard, record_schedule

from ._dist import run_distributed
from .test_api import Block, Net, shard


def _fmt(events) -> str:
    return "\n".join(" ".join(x for x in e if x) for e in events)


def _one_step(rank, world):
    m = shard(Net(n=2))
    x = torch.randn(2, 3)
    m(x).sum().backward()  # first step: lazy init, order recording
    with record_schedule() as ev:
        m(x).sum().backward()
    return _fmt(ev)


def _prefetch_knobs(rank, world):
    out = {}
    for name in ("depth0", "explicit"):
        m = shard(Net(n=3))
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


def _unused_on_rank1(rank, world):
    m = Branchy()
    for layer in m.layers:
        fully_shard(layer)
    fully_shard(m)
    x = torch.randn(2, 3)
    with record_schedule() as ev:
        m(x, use_branch=(rank == 0)).sum().backward()
    grads_set = all(p.grad is not None for p in m.layers[1].parameters())
    start = next(i for i, e in enumerate(ev) if e[0] == "pre_backward")
    return _fmt(e for e in ev[start:] if e[0] in ("all_gather", "reduce_scatter",
                                                   "final_callback")), grads_set


class TestSchedule(expecttest.TestCase):
    def test_one_step(self):
        rank0, rank1 = run_distributed(_one_step, 2)
        self.assertEqual(rank0, rank1)
        self.assertExpectedInline(rank0, """\
pre_forward IDLE
all_gather FORWARD
prefetch layers.0 forward
all_gather layers.0 IDLE
pre_forward layers.0 IDLE
prefetch layers.1 forward
all_gather layers.1 IDLE
post_forward layers.0 FORWARD
reshard layers.0 FORWARD
pre_forward layers.1 IDLE
post_forward layers.1 FORWARD
reshard layers.1 FORWARD
post_forward FORWARD
pre_backward IDLE
all_gather layers.1 IDLE
pre_backward layers.1 IDLE
all_gather layers.0 IDLE
post_backward layers.1 PRE_BACKWARD
reshard layers.1 POST_BACKWARD
reduce_scatter layers.1 ready
pre_backward layers.0 IDLE
post_backward layers.0 PRE_BACKWARD
reshard layers.0 POST_BACKWARD
reduce_scatter layers.0 ready
post_backward PRE_BACKWARD
reshard POST_BACKWARD
reduce_scatter ready
final_callback""")

    def test_unit_without_gradient_on_one_rank(self):
        (r0, set0), (r1, set1) = run_distributed(_unused_on_rank1, 2)
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
