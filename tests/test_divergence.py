"""Ranks that diverge get a DivergenceError on every rank, within 30 s.

Each scenario runs as its own set of gloo processes with a hard timeout
(``run_distributed_outcomes``: every rank's outcome, no rank killed because
another failed): a different number of forwards or backwards, different
gradient-sync or HSDP all-reduce settings, different parameter shapes or
dtypes, and an exception on one rank only (uncaught: that process exits;
caught by the loop, which goes on). Every rank must end with our error (the
exiting rank with its own), naming the unit, the collective and what the
ranks did; none may hang. A different number of forwards or backwards,
different settings and an exception caught between forward and backward
need the step check (``STEP_CHECKED``), on by default: every scenario runs
with the defaults. Models in sequence and side by side, with faults every
rank raises alike, must not see each other's records (issue 27). See
docs/design.md, "Divergence".
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn as nn

from fsdp_compose import fully_shard

from ._dist import run_distributed_outcomes

LIMIT = 30.0  # seconds, launch included
LINGER = 10.0  # seconds a rank that caught every error stays alive


class Scale(nn.Module):
    def __init__(self, dim: int, dtype=torch.float32, fail_at: int = -1):
        super().__init__()
        self.w = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.fail_at, self.calls = fail_at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_at or isinstance(self.fail_at, tuple) \
                and self.calls in self.fail_at:
            raise ValueError("deliberate failure inside a forward")
        return x * self.w.to(x.dtype)


def _model(out: int = 4, dtype=torch.float32, fail_at: int = -1, mesh=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Scale(16, dtype, fail_at),
                          nn.Linear(16, out))
    for m in (model[0], model[2], model[3]):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(model, x):
    return model(x)[:, :4].square().mean()


def _train(model, rank: int, steps: int = 3, forwards=None, microbatches=None,
           before=None, between=None):
    """``steps`` optimizer steps; per step ``microbatches(step)`` backwards, each
    of the sum of ``forwards(step)`` forwards; ``before(step)`` runs first,
    ``between(step)`` after the forward(s)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        if before is not None:
            before(step)
        for _ in range(microbatches(step) if microbatches else 1):
            x = _batch(rank, step)
            loss = sum(_loss(model, x) for _ in range(forwards(step) if forwards else 1))
            if between is not None:
                between(step)
            loss.backward()
        opt.step()
        opt.zero_grad()


# Scenarios caught by the step check (on by default; FSDP_COMPOSE_STEP_CHECK=0
# turns it off: docs/design.md, "Divergence"); the others hold without it.
STEP_CHECKED = {"extra_microbatch", "two_forwards", "gradient_sync", "all_reduce",
                "catch_in_loss"}


def _scenario(rank: int, world: int, name: str) -> None:
    os.environ.pop("FSDP_COMPOSE_STEP_CHECK", None)  # the defaults
    last = world - 1
    if name == "extra_microbatch":  # the last rank runs 2 forward+backward per step
        _train(_model(), rank, microbatches=lambda s: 2 if rank == last and s == 1 else 1)
    elif name == "two_forwards":  # rank 0 runs 2 forwards before its backward
        _train(_model(), rank, forwards=lambda s: 2 if rank == 0 and s == 1 else 1)
    elif name == "gradient_sync":
        model = _model()

        def before(step):
            if step == 1 and rank == last:
                model.set_requires_gradient_sync(False)
        _train(model, rank, before=before)
    elif name == "all_reduce":  # HSDP, mesh (replicate 2, shard 2)
        from torch.distributed.device_mesh import init_device_mesh
        model = _model(mesh=init_device_mesh("cpu", (2, world // 2)))

        def before(step):
            if step == 1 and rank == last:
                model.set_requires_all_reduce(False)
        _train(model, rank, before=before)
    elif name == "full_tensor_one_rank":  # rank 0 gathers a sharded parameter (logging)
        model = _model()
        _train(model, rank, before=lambda s: s == 1 and rank == 0
               and model[0].weight.full_tensor())
    elif name == "clip_one_rank":  # rank 0 alone clips its gradients at step 1
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            _loss(model, _batch(rank, step)).backward()
            if step == 1 and rank == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    elif name == "shape":
        _train(_model(out=5 if rank == last else 4), rank)
    elif name == "dtype":
        _train(_model(dtype=torch.bfloat16 if rank == last else torch.float32), rank)
    elif name in ("raise_in_loss", "catch_in_loss"):  # between forward and backward
        catch = name == "catch_in_loss"
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            try:
                loss = _loss(model, _batch(rank, step))
                if step == 1 and rank == last:
                    raise ValueError("deliberate failure in the loss")
                loss.backward()
            except ValueError:
                if not catch:
                    raise
                continue
            opt.step()
            opt.zero_grad()
    elif name in ("catch_in_forward", "catch_in_backward", "catch_all_and_linger",
                  "every_rank_leaves_alike", "ranks_leave_apart"):
        # unit '2' raises inside its forward, or a hook in the middle of the backward
        now = [0]
        inside = name != "catch_in_backward"
        linger = name == "catch_all_and_linger" and rank == last
        fails = rank == last or name == "every_rank_leaves_alike"
        apart = name == "ranks_leave_apart"  # rank 0 inside unit '2', the others after '0'
        model = _model(fail_at=2 if inside and (fails and not apart or apart and rank == 0)
                       else -1)
        if apart:  # one all-gather per unit: rank 0 has prefetched '3', the others not
            model.set_all_gather_bucket_bytes(0)

            def after_0(_module, _args, _out):
                if rank != 0 and now[0] == 1:
                    raise ValueError("deliberate failure after unit '0'")
            model[0].register_forward_hook(after_0)

        def fail(_grad):
            raise ValueError("deliberate failure in a backward hook")

        def hook(_module, _args, out):
            if not inside and fails and now[0] == 1:
                out.register_hook(fail)
        model[1].register_forward_hook(hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        caught = []
        for step in range(3):
            now[0] = step
            try:
                _loss(model, _batch(rank, step)).backward()
            except (Exception if linger else ValueError) as e:  # noqa: BLE001, B030 (a class either way)
                caught.append(e)
                continue
            opt.step()
            opt.zero_grad()
        if linger and caught:  # the process stays: the others learn it from the store
            time.sleep(LINGER)
            raise caught[-1]
        if name == "every_rank_leaves_alike":
            return len(caught), _loss(model, _batch(rank, 9)).item()
    elif name.startswith("models_in_sequence_"):
        return _models_in_sequence(rank, name.removeprefix("models_in_sequence_"))
    elif name == "student_and_teacher":
        return _student_and_teacher(rank)
    else:
        raise AssertionError(name)


def _store_keys() -> int:
    import torch.distributed as dist

    from fsdp_compose._base import _compat
    dist.barrier()  # (every rank done with the store)
    return _compat.default_store().num_keys()


def _models_in_sequence(rank: int, fault: str):
    """The issue's sketch: one model after another in one process, each with
    the same fault on every rank at step 1 (a forward or a backward hook
    raises), caught by the loop, which drops the step. Returns each model's
    losses, a reference run that skips step 1, and the number of store keys
    after the first step and after each model is freed."""
    import gc
    steps, bad = 4, 1
    forward = fault == "forward"

    def run(trial: int | None):
        model = _model(fail_at=2 if forward and trial is not None else -1)
        now = [0]

        def fail(_grad):
            raise ValueError("deliberate failure in a backward hook")

        def hook(_module, _args, out):
            if not forward and trial is not None and now[0] == bad:
                out.register_hook(fail)
        model[1].register_forward_hook(hook)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        losses, keys = [], None
        for step in range(steps):
            now[0] = step
            if trial is None and step == bad:
                continue  # the reference skips the step
            try:
                loss = _loss(model, _batch(rank, step))
                loss.backward()
            except ValueError:
                assert trial is not None and step == bad
                opt.zero_grad(set_to_none=True)
                continue
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if trial == 0 and step == 0:
                keys = _store_keys()
        del model, opt
        gc.collect()
        return losses, keys

    trials = []
    for trial in range(3):
        losses, keys = run(trial)
        trials.append((losses, keys, _store_keys()))
    reference = run(None)[0]
    gc.collect()  # (the last loss held the last model's graph until run returned)
    from fsdp_compose._base._job import job
    roots = list(job().roots)
    return trials, reference, len(roots), sum(c.stopped is not None for c in roots)


def _student_and_teacher(rank: int):
    """Two models alive side by side (a teacher's no-grad forward feeds the
    student's loss), each with faults on every rank: the student's forward
    raises at step 1, the teacher's at step 2, a backward hook of the student
    at step 4. Every fault drops its step; returns the student's losses, and
    those of a reference run that skips those steps."""
    steps, dropped = 6, (1, 2, 4)

    def run(faults: bool):
        student = _model(fail_at=2 if faults else -1)
        teacher = _model(fail_at=3 if faults else -1)
        now = [0]

        def fail(_grad):
            raise ValueError("deliberate failure in a backward hook")

        def hook(_module, _args, out):
            if faults and now[0] == 4:
                out.register_hook(fail)
        student[1].register_forward_hook(hook)
        opt = torch.optim.AdamW(student.parameters(), lr=0.01)
        losses = []
        for step in range(steps):
            now[0] = step
            if not faults and step in dropped:
                continue
            x = _batch(rank, step)
            try:
                with torch.no_grad():
                    target = teacher(x)
                loss = (student(x) - target).square().mean()
                loss.backward()
            except ValueError:
                assert faults and step in dropped, step
                opt.zero_grad(set_to_none=True)
                continue
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    return run(True), run(False)


def _outcomes(name: str, world: int):
    return run_distributed_outcomes(_scenario, world, name, timeout=LIMIT)


def _assert_every_rank_raised(outcomes, *needles, own=None):
    """Every rank ended with our DivergenceError (``own``: {rank: exception
    class name} for ranks that end with their own error) within the limit, and
    each message holds every needle."""
    own = own or {}
    for r, o in enumerate(outcomes):
        assert o.seconds < LIMIT, (r, o.seconds)
        if r in own:
            assert o.kind == "err" and o.exc_type == own[r], (r, o)
            continue
        assert o.kind == "err" and o.exc_type == "DivergenceError", (r, o.kind, o.exc_type,
                                                                     o.tb)
        assert f"[rank {r}]" in o.message and "unit '" in o.message, (r, o.message)
        for needle in needles:
            assert needle in o.message, (r, needle, o.message)


def _ranks(n: int) -> str:
    return "rank 0" if n == 1 else "ranks " + ", ".join(map(str, range(n)))


def _names_a_collective(message: str) -> bool:
    return any(c in message for c in ("step check", "all-gather", "reduce-scatter",
                                       "all-reduce"))


@pytest.mark.parametrize("world", [2, 4])
def test_extra_microbatch_on_one_rank(world):
    outcomes = _outcomes("extra_microbatch", world)
    # the last rank's second microbatch of step 1 meets the others' step 2
    _assert_every_rank_raised(outcomes, "step check", f"{_ranks(world - 1)}: optimizer steps "
                              "so far: 2", f"rank {world - 1}: optimizer steps so far: 1",
                              f"rank {world - 1}: since the last optimizer step: 1 forward(s), "
                              "1 backward(s)")


@pytest.mark.parametrize("world", [2, 4])
def test_full_tensor_on_one_rank(world):
    """A collective of the user's (a sharded parameter's full_tensor()) on
    rank 0 alone: every rank raises within the limit, naming the call,
    where it waited for gloo's timeout (30 minutes) before."""
    _assert_every_rank_raised(_outcomes("full_tensor_one_rank", world),
                              "full_tensor() of sharded parameter '0.weight' (an all-gather), "
                              "on rank 0 alone", "step check",
                              # the facts, as of now: rank 0 is past its first optimizer
                              # step, as the rank waiting in the check (equal lines are
                              # not shown)
                              "rank 0: began full_tensor() of sharded parameter '0.weight'",
                              ": began a training forward")
    for o in _outcomes("full_tensor_one_rank", world)[:1]:
        assert "optimizer steps so far" not in o.message, o.message


def test_clip_on_one_rank():
    """Our clip_grad_norm_'s reduction on rank 0 alone: every rank raises
    within the limit, naming it (an all-reduce there paired with the other
    rank's step check: gloo aborted the process)."""
    _assert_every_rank_raised(_outcomes("clip_one_rank", 2),
                              "clip_grad_norm_() / get_total_norm(): the gradient norm "
                              "(an all-gather), on rank 0 alone", "step check",
                              "rank 0: began clip_grad_norm_()", "rank 1: began a training forward",
                              "rank 0: optimizer steps so far: 1",
                              "rank 1: optimizer steps so far: 2",
                              "rank 0: since the last optimizer step: 1 forward(s), 1 backward(s)",
                              "rank 1: since the last optimizer step: 0 forward(s), 0 backward(s)")


def test_two_forwards_before_backward_on_one_rank():
    _assert_every_rank_raised(_outcomes("two_forwards", 2), "step check",
                              "rank 1: began a backward", "rank 0: began a training forward")


def test_gradient_sync_differs():
    _assert_every_rank_raised(_outcomes("gradient_sync", 2), "step check",
                              "set_requires_gradient_sync(False) on: no unit",
                              "set_requires_gradient_sync(False) on: '<root>', '0'")


def test_hsdp_all_reduce_differs():
    outcomes = _outcomes("all_reduce", 4)
    _assert_every_rank_raised(outcomes)
    for o in outcomes:
        assert _names_a_collective(o.message), o.message
    # the replicas of rank 3 (rank 1) and its shard peer (rank 2) saw it at the check
    for r in (1, 2, 3):
        assert "set_requires_all_reduce(False) on: '0', '2', '3'" in outcomes[r].message


def test_parameter_shapes_differ():
    _assert_every_rank_raised(_outcomes("shape", 2), "step check (lazy init",
                              "unit '3': float32 over 2 ranks: 3.weight (4, 16), 3.bias (4,)",
                              "unit '3': float32 over 2 ranks: 3.weight (5, 16), 3.bias (5,)")


def test_parameter_dtypes_differ():
    _assert_every_rank_raised(_outcomes("dtype", 2), "step check (lazy init",
                              "unit '2': float32", "unit '2': bfloat16")


def test_uncaught_exception_on_one_rank():
    """The raising rank exits with its own error; the other waits in its
    backward's first collective and gets gloo's connection error, as ours."""
    outcomes = _outcomes("raise_in_loss", 2)
    # (gloo says "Connection closed by peer" or "Connection reset by peer")
    _assert_every_rank_raised(outcomes, "probably exited", own={1: "ValueError"})
    assert _names_a_collective(outcomes[0].message), outcomes[0].message


@pytest.mark.parametrize("world", [2, 4])
def test_caught_exception_between_forward_and_backward(world):
    # (at 4 ranks each blocked rank reports itself beside the waiting one)
    _assert_every_rank_raised(_outcomes("catch_in_loss", world), "step check",
                              "rank 0: began a backward" if world == 2 else ": began a backward",
                              f"rank {world - 1}: began a training forward")


def test_caught_exception_inside_forward():
    outcomes = _outcomes("catch_in_forward", 2)
    _assert_every_rank_raised(outcomes)
    assert "left its last step half-done" in outcomes[1].message
    assert "'2' (FORWARD)" in outcomes[1].message
    assert _names_a_collective(outcomes[0].message) and "rank 1 left a step half-done" \
        in outcomes[0].message, outcomes[0].message


def test_caught_exception_inside_backward():
    outcomes = _outcomes("catch_in_backward", 2)
    _assert_every_rank_raised(outcomes)
    assert "left its last step half-done" in outcomes[1].message
    assert _names_a_collective(outcomes[0].message) and "rank 1 left a step half-done" \
        in outcomes[0].message, outcomes[0].message


def test_caught_exception_while_the_process_stays():
    """The rank that left its step half-done catches every error (ours too: its
    later forwards raise again without communicating) and stays alive: the
    other rank, blocked in a collective, learns it from the store within a
    slice, not from a closed connection."""
    outcomes = _outcomes("catch_all_and_linger", 2)
    _assert_every_rank_raised(outcomes)
    assert "left its last step half-done" in outcomes[1].message
    assert "rank 1 left a step half-done" in outcomes[0].message, outcomes[0].message
    assert "Connection closed" not in outcomes[0].message, outcomes[0].message
    assert outcomes[0].seconds < outcomes[1].seconds - LINGER / 2, outcomes


def test_every_rank_leaves_a_step_alike_and_goes_on():
    """Every rank raises inside the same forward and skips the step: they left
    it after the same collective, so training goes on (as with one rank)."""
    outcomes = _outcomes("every_rank_leaves_alike", 2)
    assert [o.kind for o in outcomes] == ["ok", "ok"], [(o.kind, o.message) for o in outcomes]
    assert [o.value[0] for o in outcomes] == [1, 1]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fault", ["forward", "backward"])
def test_models_in_sequence_with_the_same_fault(fault, world):
    """Issue 27, 1: a model freed and another built in the same process, each
    with a fault every rank raises alike at step 1: every model drops that
    step and trains as a run that skips it, and the records of a freed model
    (store keys, roots) are gone. Before, the second model's agreement read
    the first one's words and raised a DivergenceError on one rank."""
    outcomes = _outcomes(f"models_in_sequence_{fault}", world)
    assert [o.kind for o in outcomes] == ["ok"] * world, [(o.kind, o.message) for o in outcomes]
    for o in outcomes:
        trials, reference, roots, stopped = o.value
        assert len(reference) == 3
        for losses, _, _ in trials:
            assert losses == reference, (losses, reference)
        baseline = trials[0][1]
        assert [keys for _, _, keys in trials] == [baseline] * 3, trials
        assert (roots, stopped) == (0, 0)


@pytest.mark.parametrize("world", [2, 4])
def test_two_models_alive_side_by_side_with_faults(world):
    """Issue 27, 1: a student and a teacher alive together, faults in each
    (every rank alike): each drops its step, the student trains as a run that
    skips those steps. Before, both roots' records had the same keys (unit
    '' over the same ranks) and the teacher's agreement read the student's."""
    outcomes = _outcomes("student_and_teacher", world)
    assert [o.kind for o in outcomes] == ["ok"] * world, [(o.kind, o.message) for o in outcomes]
    for o in outcomes:
        losses, reference = o.value
        assert len(reference) == 3 and losses == reference, (losses, reference)


@pytest.mark.fast
def test_the_step_check_is_on_by_default_and_has_a_switch(monkeypatch):
    from fsdp_compose._comm import _divergence
    monkeypatch.delenv("FSDP_COMPOSE_STEP_CHECK", raising=False)
    assert _divergence.step_check_enabled()
    for off in ("0", "false", "False"):
        monkeypatch.setenv("FSDP_COMPOSE_STEP_CHECK", off)
        assert not _divergence.step_check_enabled()
    monkeypatch.setenv("FSDP_COMPOSE_STEP_CHECK", "1")
    assert _divergence.step_check_enabled()


def test_ranks_leave_a_step_at_different_points():
    """Every rank leaves the step inside its forward, rank 0 after prefetching
    unit '3' (no all-gather buckets), rank 1 before: their collectives no
    longer match, both raise."""
    outcomes = _outcomes("ranks_leave_apart", 2)
    _assert_every_rank_raised(outcomes, "left its last step half-done",
                              "at different collectives")


# ------------------------------------------ the step check's CUDA protocol
def _cuda_protocol(rank: int, world: int, diverge: bool, hsdp: bool):
    """StepChecks on groups whose tensors are on CUDA, this CPU standing in:
    the check's device tensors stay on the CPU (gloo carries them) and its
    stream and event are the recording double's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks._fake_cuda import StreamDouble
    from fsdp_compose._comm import _divergence as dv

    class OnThisCpu(StreamDouble):
        def to_device(self, t, device):
            return t.clone()

    rt = OnThisCpu()
    cuda = torch.device("cuda")
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        pgs = [(mesh.get_group("shard"), cuda), (mesh.get_group("replicate"), cuda)]
    else:
        pgs = [(dist.group.WORLD, cuda)]
    checks = dv.StepChecks("", pgs, [], rt)
    checks.lazy_init(["one unit"])
    rt.log.clear()
    phase = dv.BACKWARD if diverge and rank == 1 else dv.FORWARD
    checks.before(phase, (1,), lambda: [])
    issued = list(rt.log)
    try:
        dv.next_op(pgs[0][0])  # the phase's first collective is about to be issued
        outcome = "went on"
    except dv.DivergenceError as e:
        outcome = "raised: " + str(e).splitlines()[0][:120]
    return {"issued": issued, "after": rt.log[len(issued):], "outcome": outcome}


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
@pytest.mark.parametrize("diverge", [False, True], ids=["in-step", "diverged"])
def test_cuda_step_check_is_compared_before_the_phase_issues_anything(diverge, hsdp):
    """Issue 25, finding 5. On CUDA the check is enqueued at the phase start
    (all-reduce, copy to pinned host memory, one event for all of the check's
    groups) and compared when the phase's first collective is about to be
    issued: a rank in a backward and one in a forward raise there, not one
    check later with the phase's collectives already paired wrongly on the
    GPU. With HSDP the two groups' results are read behind one event: one
    host synchronisation per check (was one per group)."""
    world = 4 if hsdp else 2
    outcomes = run_distributed_outcomes(_cuda_protocol, world, diverge, hsdp, timeout=LIMIT)
    # rank 1 diverges; with HSDP (2, 2) rank 2 shares no group with it
    # (shard groups {0, 1} {2, 3}, replicate groups {0, 2} {1, 3}): it sees
    # two matching checks and goes on (its next wait reads the stop records)
    for r, o in enumerate(outcomes):
        assert o.kind == "ok", o
        res = o.value
        kinds = [e[0] for e in res["issued"]]
        groups = 2 if hsdp else 1
        # per group a copy to pinned host memory, then ONE event after all of them
        assert kinds == ["d2h"] * groups + ["record"], res["issued"]
        assert all(e[2] for e in res["issued"][:groups]), "the host buffer is pinned"
        assert res["after"] == [("sync", "compute", res["issued"][-1][2])], res["after"]
        if diverge and r != 2:
            assert res["outcome"].startswith("raised:") and "diverged" in res["outcome"], res
        else:
            assert res["outcome"] == "went on", res
