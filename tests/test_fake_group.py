"""In this process, on torch's fake process group: no worker processes, so
part of the one-minute tier (``make test-fast``).

* The schedule of one step on the path every backend but gloo takes (NCCL's):
  uneven pieces padded to one equal-size collective ([Note: padded
  collectives] in fsdp_compose/_comm/_collectives.py), the side-stream protocol
  ([Note: side streams] in _streams.py, on the recording stream double of
  tests/test_streams.py), and the backward that reshards a unit after its
  post-backward (gloo reshards it as soon as its gradients are computed:
  tests/test_schedule.py). The fake group moves no data, so the schedule, the
  collectives and the stream hand-offs are checked, not values. Refresh the
  literals with EXPECTTEST_ACCEPT=1 after an intended change.
* What needs no collective, checked by value: ``materialize`` at 2 ranks
  (rank 0 and rank 1, in turn); a training step, ``clip_grad_norm_`` and a
  checkpoint round trip at world size 1; ``use_as_fsdp2``; the rendezvous
  helpers of ``fsdp_compose._base._launch``.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import os
import socket

import expecttest
import pytest
import torch
import torch.distributed as dist

from fsdp_compose import (clip_grad_norm_, comm_stats, fully_shard, param_info, record_schedule,
                           reset_comm_stats)

from fsdp_compose._plan import _layout
from ._pieces import local_piece
from ._support import (ONE_STEP_CPU, Net, rows, StreamDouble, check_stream_protocol,
                       per_unit_collectives, recording, shard)
from ._support import schedule_text as _fmt

pytestmark = pytest.mark.fast

# the collectives of the side-stream protocol, each checked by check_stream_protocol
_KINDS = ("all_gather", "reduce_scatter", "all_reduce_async")


@contextlib.contextmanager
def fake_group(rank: int, world: int):
    """The default process group: torch's fake one, as ``rank`` of ``world``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _no_list_collectives():
    """The padded path issues the equal-size collectives only."""
    def refused(*a, **k):
        raise AssertionError("a list collective was issued")
    saved = dist.all_gather, dist.reduce_scatter
    dist.all_gather = dist.reduce_scatter = refused
    try:
        yield
    finally:
        dist.all_gather, dist.reduce_scatter = saved


def _second_step(m, per_unit: bool, before_recording=None) -> dict:
    """``m``'s second training step (the first: lazy init, order recording),
    its schedule and collective counts; ``before_recording()`` runs just
    before it."""
    if per_unit:
        per_unit_collectives(m)
    x = torch.randn(2, 3)
    m(x).sum().backward()
    reset_comm_stats()
    if before_recording is not None:
        before_recording()
    with record_schedule() as ev:
        m(x).sum().backward()
    s = comm_stats()
    return {"schedule": _fmt(ev), "calls": (s.all_gather_calls, s.reduce_scatter_calls),
            "manager": repr(m._unit().ctx.streams)}


def _padded_step(rank: int, per_unit: bool) -> dict:
    """The second step of a root and 2 blocks (uneven pieces forced), as
    ``rank`` of 2, on side streams: its schedule, collective counts, the
    collectives' (kind, stream) and what the stream protocol check finds."""
    rt = StreamDouble(side_streams=("ag", "rs"))
    with fake_group(rank, 2), recording(rt, kinds=_KINDS, logged=_KINDS), \
            _no_list_collectives():
        _layout.FORCE_EVEN = False
        try:
            torch.manual_seed(0)
            m = shard(Net(n=2))
        finally:
            _layout.FORCE_EVEN = None
        groups = [g for u in (m._unit(), *(b._unit() for b in m.layers)) for g in u.groups]
        out = _second_step(m, per_unit, before_recording=rt.issues.clear)
        out["padded"] = all(g.padded() for g in groups)
        out["streams"] = sorted({(k, st) for k, st, _, _ in rt.issues})
        del m
        gc.collect()  # every release is in the log
        out["problems"] = check_stream_protocol(rt.log)
    return out


class TestPaddedSideStreamStep(expecttest.TestCase):
    def _both_ranks(self, per_unit: bool) -> dict:
        r0, r1 = _padded_step(0, per_unit), _padded_step(1, per_unit)
        self.assertEqual(r0, r1)  # one schedule, the same collectives, on every rank
        self.assertTrue(r0["padded"])
        self.assertEqual(r0["manager"], "StreamManager(device=cpu, mode=side-streams)")
        self.assertEqual(r0["problems"], [])
        # every all-gather on the all-gather stream, every reduce-scatter on the other
        self.assertEqual(r0["streams"], [("all_gather", "ag"), ("reduce_scatter", "rs")])
        return r0

    def test_one_step(self):
        r = self._both_ranks(per_unit=True)
        self.assertEqual(r["calls"], (3 + 2, 3))  # per unit: forward 3, backward the 2 blocks
        # unlike gloo's (tests/test_schedule.py), a unit reshards after its
        # post-backward, not as soon as its gradients are computed
        self.assertExpectedInline(r["schedule"], """\
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

    def test_one_bucketed_step(self):
        r = self._both_ranks(per_unit=False)
        self.assertEqual(r["calls"], (1 + 1, 1))  # default buckets: the model is one
        self.assertExpectedInline(r["schedule"], """\
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
post_backward layers.1 PRE_BACKWARD
reshard layers.1 POST_BACKWARD
pre_backward layers.0 IDLE
post_backward layers.0 PRE_BACKWARD
reshard layers.0 POST_BACKWARD
post_backward PRE_BACKWARD
reshard POST_BACKWARD
reduce_scatter layers.1 bucketed
reduce_scatter layers.0 bucketed
reduce_scatter bucketed
final_callback""")


def _blocking_step(rank: int, per_unit: bool) -> dict:
    """The second step of the same model (equal chunks) as ``rank`` of 2 with
    the CPU backend (``BlockingStreams``, gloo's backward: [Note: gloo
    backward] in fsdp_compose/_runtime/_state.py): its schedule and collective counts."""
    with fake_group(rank, 2):
        torch.manual_seed(0)
        return _second_step(shard(Net(n=2)), per_unit)


class TestBlockingStep(expecttest.TestCase):
    """One literal per backend: the side-stream one is TestPaddedSideStreamStep's,
    the CPU backend's ``ONE_STEP_CPU``, which the multi-process gloo step of
    tests/test_schedule.py gives too."""

    def test_one_step(self):
        r0, r1 = _blocking_step(0, per_unit=True), _blocking_step(1, per_unit=True)
        self.assertEqual(r0, r1)
        self.assertEqual(r0["manager"], "BlockingStreams(device=cpu)")
        self.assertEqual(r0["calls"], (3 + 2, 3))
        # the multi-process gloo step's schedule (tests/test_schedule.py)
        self.assertEqual(r0["schedule"], ONE_STEP_CPU)


# ---------------------------------------------------------------- by value


@pytest.mark.parametrize("rank", [0, 1])
def test_materialize_gives_each_rank_its_piece_of_the_eager_build(rank):
    torch.manual_seed(0)
    eager = Net(n=2)
    with fake_group(rank, 2):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Net(n=2)
        shard(model)
        from fsdp_compose import materialize
        materialize(model)
        held = 0
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            info = param_info(p)
            assert info.numel == q.numel(), name
            assert p.device.type == "cpu", name
            assert torch.equal(rows(p).detach(), local_piece(q, info.local_range)), name
            held += rows(p).numel()
        # the two ranks' pieces are the model, each element once
        assert 0 < held < sum(q.numel() for q in eager.parameters())


def test_world_one_step_and_clip_match_the_unsharded_model():
    """At world size 1 nothing is communicated: loss, gradients, the clipped
    norm and the optimizer step are the unsharded model's."""
    torch.manual_seed(0)
    ref = Net(n=2)
    with fake_group(0, 1):
        model = shard(copy.deepcopy(ref))
        _two_steps_as_the_reference(model, ref, clip_grad_norm_)
        assert comm_stats().all_gather_calls == 0


def _two_steps_as_the_reference(model, ref, clip, grad_of=lambda g: g, value_of=lambda p: p):
    """Two AdamW steps of ``model`` and of the unsharded ``ref`` on the same
    data, clipped (``clip`` on ``model``, torch's on ``ref``): equal losses,
    clipped norms, gradients (``grad_of(p.grad)``) and parameters after
    (``value_of(p)``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
        loss, ref_loss = model(x).pow(2).mean(), ref(x).pow(2).mean()
        assert torch.equal(loss, ref_loss), step
        loss.backward()
        ref_loss.backward()
        norm = clip(model.parameters(), 0.05)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        assert ref_norm > 0.05  # it clips
        torch.testing.assert_close(norm, ref_norm)
        for p, q in zip(model.parameters(), ref.parameters()):
            g = grad_of(p.grad)
            torch.testing.assert_close(g, q.grad.view_as(g))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        v = value_of(p.detach())
        torch.testing.assert_close(v, q.detach().view_as(v))


def test_world_one_through_fsdp2s_name_gives_dtensors_and_the_same_step():
    """Called as torch's ``fully_shard`` (``use_as_fsdp2``), parameters at world
    size 1 are DTensors of their shape, as FSDP2's are (Lightning finds the
    model by them); the step is still the unsharded model's. Called by its own
    name, fully_shard keeps plain full-shape parameters there."""
    import torch.distributed.fsdp as tfsdp
    from torch.distributed.tensor import DTensor

    from fsdp_compose import use_as_fsdp2

    torch.manual_seed(0)
    ref = Net(n=2)
    with fake_group(0, 1):
        plain = shard(copy.deepcopy(ref))
        assert not any(isinstance(p, DTensor) for p in plain.parameters())
        use_as_fsdp2()
        try:
            model = copy.deepcopy(ref)
            for layer in model.layers:
                tfsdp.fully_shard(layer)
            tfsdp.fully_shard(model)
        finally:
            use_as_fsdp2(False)
        assert all(isinstance(p, DTensor) and p.shape == q.shape and p.to_local().shape == q.shape
                   for p, q in zip(model.parameters(), ref.parameters()))

        def local(g):
            assert isinstance(g, DTensor)
            return g.to_local()
        _two_steps_as_the_reference(model, ref, torch.nn.utils.clip_grad_norm_, local,
                                    lambda p: p.full_tensor())
        sd = model.state_dict()
        assert all(isinstance(v, DTensor) for v in sd.values())


def test_checkpoint_round_trip_and_a_truncated_file_changes_nothing(tmp_path):
    import torch.distributed.checkpoint as dcp

    from fsdp_compose import CheckpointLoadError, get_state_dict, load_checkpoint

    with fake_group(0, 1):
        torch.manual_seed(0)
        model = shard(Net(n=2))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
        saved = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        load_checkpoint(model, opt, str(tmp_path))
        assert all(torch.equal(a, p) for a, p in zip(saved, model.parameters()))

        (data,) = [f for f in os.listdir(tmp_path) if f.endswith(".distcp")]
        os.truncate(tmp_path / data, 10)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(CheckpointLoadError, match="truncated") as ei:
            load_checkpoint(model, opt, str(tmp_path))
        assert list(ei.value.failures) == [0] and not ei.value.partial
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_use_as_fsdp2_rebinds_torchs_fully_shard_and_restores_it():
    import torch.distributed.fsdp as tfsdp
    import torch.distributed.fsdp._fully_shard as tfsdp_impl

    from fsdp_compose import use_as_fsdp2

    theirs = tfsdp.fully_shard, tfsdp_impl.fully_shard
    try:
        use_as_fsdp2()
        use_as_fsdp2()  # twice: torch's is still what False restores
        # (ours, through a wrapper that makes parameters DTensors at world size 1)
        assert tfsdp.fully_shard.fsdp_compose is fully_shard
        assert tfsdp_impl.fully_shard is tfsdp.fully_shard
    finally:
        use_as_fsdp2(False)
    assert (tfsdp.fully_shard, tfsdp_impl.fully_shard) == theirs


def test_launch_helpers_set_torchruns_variables_and_join_the_group(monkeypatch):
    """What a launcher's rank does (no group is made here: a gloo group's
    threads in the pytest process would be inherited by the forked ranks of
    the tests that launch)."""
    from datetime import timedelta

    from fsdp_compose._base import _launch

    port = _launch.free_port()
    with socket.socket() as s:  # free now
        s.bind((_launch.HOST, port))
    want = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}
    assert _launch.rank_env(1, 4, port) == want
    for k in want:
        monkeypatch.setenv(k, "")  # restored (or removed) after the test
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(("threads", n)))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda *a, **kw: calls.append((a, kw, {k: os.environ[k] for k in want})))
    _launch.init_gloo(1, 4, port, timeout=30, threads=1)
    assert calls == [("threads", 1), (("gloo",), {"rank": 1, "world_size": 4,
                                                  "timeout": timedelta(seconds=30)}, want)]
