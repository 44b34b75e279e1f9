"""The training scenarios on the CUDA code path, under CUDA's rules (CPU only).

Every scenario builds its model outside the checker (as if on the default
stream before training), then trains with the stream manager's CUDA path
(side streams, events, non-blocking host copies: ``tests/_cuda_rules.py``'s
``CudaRules`` is its runtime) while the checker attributes every op to a
stream and flags: unordered cross-stream accesses (race), blocks handed out
again by the caching allocator while another stream's use is not ordered
(reuse), host synchronisations inside forward or backward not marked as
intended (sync in hook), device collectives issued ``async_op=True``
(async), host and device tensors mixed in one op (mixed), and collectives on
two process groups issued in different relative orders on two ranks (order,
compared here over every rank's sequence).

The scenarios do not read device values between steps (a read synchronises
the compute stream and would hide what a real loop, which does not, races
on): losses and gradients are cloned on the device and compared at the end.

The planted tests put back, one at a time, what review findings 1, 2 and 3
removed (tests/_cuda_rules.py flags each), and the finding tests show the
other fixes.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
import shutil
import tempfile
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_compose._comm._streams as streams_mod
from fsdp_compose import (CPUOffloadPolicy, MixedPrecisionPolicy, clip_grad_norm_, fully_shard,
                          param_info)
from fsdp_compose._comm import _collectives
from fsdp_compose._group import _grad_path

from ._cuda_rules import CudaRules, check_orders
from ._dist import run_distributed
from ._pieces import piece_close
from ._support import SKIPS, Boom, Chain, Net, Scenarios, per_unit_collectives

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
BF16_FP32 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _mesh(world: int, hsdp: bool):
    if not hsdp:
        return None
    return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))


def _batch(step: int, world: int, rank: int | None = None, n: int = 4):
    x = torch.randn(n * world, 3, generator=torch.Generator().manual_seed(100 + step))
    return x if rank is None else x[n * rank:n * rank + n]


def _grads_close(model, ref, atol) -> list[str]:
    bad = []
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            continue
        if p.grad is None and param_info(p).local_range[0] == param_info(p).local_range[1]:
            continue
        if p.grad is None or not piece_close(p.grad.float(), q.grad.float(),
                                             param_info(p).local_range, atol=atol):
            bad.append(f"gradient of {name} differs from the reference")
    return bad


def _result(rules: CudaRules, problems=()) -> dict:
    kinds: dict = {}
    for v in rules.violations:
        k = v.split("]")[0] + "]"
        if k not in kinds:
            kinds[k] = v
    return {"violations": rules.violations[:8], "n_violations": len(rules.violations),
            "first_of_kind": kinds,
            "sequence": rules.collectives, "members": dict(rules.members.values()),
            "problems": list(problems), "syncs": rules.syncs}


def _mark_offloaded(rules: CudaRules, model) -> None:
    for u in model._units(True):
        for g in u.groups:
            if g.offload:
                rules.mark_host(g.shard)


# ------------------------------------------------------------------ training
def _train(rank, world, *, mp=None, offload=False, hsdp=False, per_unit=False, steps=2,
           inner=None, clip=None, accumulate=False, async_unshard=False, rules=None,
           between=None) -> dict:
    """``steps`` training steps of Net(n=3) (each block a unit, and the root)
    under the checker; gradients checked against a reference on the global
    batch at the last step (fp32 only)."""
    torch.manual_seed(0)
    model = Net(n=3, inner=inner)
    ref = copy.deepcopy(model)
    mesh = _mesh(world, hsdp)
    kw = dict(mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy() if offload else None)
    kw = {k: v for k, v in kw.items() if v is not None}
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    if per_unit:
        per_unit_collectives(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.02)
    rules = rules or CudaRules(strict=False)
    _mark_offloaded(rules, model)
    kept = []
    with contextlib.ExitStack() as stack:
        if per_unit:
            stack.enter_context(_grad_path.inline_flags_limit(0))
        stack.enter_context(rules.active())
        for step in range(steps):
            if async_unshard:
                handle = model.layers[1].unshard(async_op=True)
            micro = [(0, 2), (2, 4)] if accumulate else [(0, 4)]
            for i, (a, b) in enumerate(micro):
                if accumulate:
                    model.set_requires_gradient_sync(i == len(micro) - 1)
                x = _batch(step, world, rank)[a:b]
                with rules.in_forward():
                    loss = model(x).pow(2).mean() * (b - a) / 4
                if async_unshard and i == 0:
                    handle.wait()
                    model.layers[1].reshard()
                loss.backward()
            if clip is not None:
                clip_grad_norm_(model.parameters(), clip)
            if step == steps - 1:
                kept = [None if p.grad is None else p.grad.detach().clone()
                        for p in model.parameters()]
            opt.step()
            opt.zero_grad()
            if between is not None:
                between(model, rules)
    problems = []
    if mp is None:  # the reference: the same steps on the global batch
        for step in range(steps):
            ref(_batch(step, world)).pow(2).mean().backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            if step < steps - 1:
                ref_opt.step()
                ref_opt.zero_grad()
        for p, g in zip(model.parameters(), kept):
            p.grad = g
        problems = _grads_close(model, ref, atol=1e-5)
    return _result(rules, problems)


class _Raising(Net):
    boom = None  # "forward": raises after layers.1; "backward": when backward reaches layers.0

    def forward(self, x):
        x = self.inp(x)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 0 and self.boom == "backward":
                x = Boom.apply(x)  # (after the reduce-scatters of layers.2 and .1 are issued)
            if i == 1 and self.boom == "forward":
                raise RuntimeError("forward raised")
        return self.out(x)


def _exceptions(rank, world, *, where: str, hsdp: bool = False, offload: bool = False) -> dict:
    """A step that raises (in forward; in backward with reduce-scatters in
    flight; or inside the post-reduce of the first reduce-scatter: an injected
    failure of its cast), then two good steps."""
    torch.manual_seed(0)
    model = _Raising(n=3)
    mesh = _mesh(world, hsdp)
    kw = {"mp_policy": BF16} | ({"mesh": mesh} if mesh is not None else {})
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    per_unit_collectives(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    rules = CudaRules(strict=False)
    _mark_offloaded(rules, model)
    raised = []
    with rules.active():
        for step in range(3):
            model.boom = where if step == 0 and where != "post-reduce" else None
            if where == "post-reduce" and step == 0:
                side = "ar" if hsdp else "rs"
                rules.fail_when(lambda op, s: op == "aten._to_copy" and s == side)
            try:
                with rules.in_forward():
                    loss = model(_batch(step, world, rank)).pow(2).mean()
                loss.backward()
            except RuntimeError as e:
                raised.append(str(e).splitlines()[0])
                del e
                continue
            opt.step()
            opt.zero_grad()
    out = _result(rules)
    out["raised"] = raised
    return out


def _skipped(rank, world, *, hsdp: bool = False, mp=None, steps: int = 3, rules=None) -> dict:
    """Units whose output some ranks do not use (no gradient there), the forward
    order agreed at every forward (``set_forward_order_dynamic(True)``)."""
    skip = SKIPS["unused_middle"].get(rank, set())
    torch.manual_seed(0)
    model = Chain()
    mesh = _mesh(world, hsdp)
    kw = ({"mesh": mesh} if mesh is not None else {}) | ({"mp_policy": mp} if mp else {})
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    model.set_forward_order_dynamic(True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    rules = rules or CudaRules(strict=False)
    with rules.active():
        for step in range(steps):
            with rules.in_forward():
                loss = model(_batch(step, world, rank), skip).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return _result(rules)


def _offload_eval_write(rank, world) -> dict:
    """An eval forward of an offloaded model, then a CPU write of the shards
    (a checkpoint load, a manual update): the shards' non-blocking
    host-to-device copies must have read them first (review finding 13)."""
    torch.manual_seed(0)
    model = Net(n=2)
    for layer in model.layers:
        fully_shard(layer, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    rules = CudaRules(strict=False)
    _mark_offloaded(rules, model)
    with rules.active():
        with torch.no_grad():
            for step in range(3):  # (the first forwards agree on the order: a host sync)
                with rules.in_forward():
                    model(_batch(step, world, rank))
                for p in model.parameters():
                    p.mul_(0.5)
    return _result(rules)


def _safe_load(rank, world) -> dict:
    """Train a step, save with DCP, train another, load_checkpoint (the safe
    load), train again: under the checker from the first step on."""
    from fsdp_compose import get_state_dict, load_checkpoint

    torch.manual_seed(0)
    model = Net(n=2)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    # (one directory per launch: its store's port is unique on this machine)
    path = os.path.join(tempfile.gettempdir(),
                        f"fsdp_cuda_rules_{os.environ.get('MASTER_PORT', '0')}_{world}")
    rules = CudaRules(strict=False)
    with rules.active():
        for step in range(3):
            with rules.in_forward():
                loss = model(_batch(step, world, rank)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                msd, osd = get_state_dict(model, opt)
                import torch.distributed.checkpoint as dcp
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
            if step == 1:
                load_checkpoint(model, opt, path)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return _result(rules)

P = functools.partial
SCENARIOS = {
    "parity": P(_train),
    "parity_per_unit": P(_train, per_unit=True),
    "bf16": P(_train, mp=BF16),
    "bf16_reduce_fp32": P(_train, mp=BF16_FP32),
    "offload": P(_train, offload=True),
    "offload_bf16": P(_train, offload=True, mp=BF16),
    "hsdp": P(_train, hsdp=True),
    "hsdp_bf16_per_unit": P(_train, hsdp=True, mp=BF16, per_unit=True),
    "hsdp_offload": P(_train, hsdp=True, offload=True),
    "skipped_dynamic": P(_skipped),
    "skipped_dynamic_hsdp_bf16": P(_skipped, hsdp=True, mp=BF16),
    "accumulate_no_sync": P(_train, accumulate=True),
    "accumulate_no_sync_offload": P(_train, accumulate=True, offload=True),
    "exception_in_forward": P(_exceptions, where="forward"),
    "exception_in_post_reduce": P(_exceptions, where="post-reduce"),
    "exception_in_backward": P(_exceptions, where="backward"),
    "exception_in_backward_offload": P(_exceptions, where="backward", offload=True),
    "checkpoint_nonreentrant": P(_train, inner="nonreentrant"),
    "checkpoint_reentrant": P(_train, inner="reentrant"),
    "clip": P(_train, clip=0.05),
    "clip_offload": P(_train, clip=0.05, offload=True),
    "unshard_async": P(_train, async_unshard=True),
    "offload_eval_then_cpu_write": _offload_eval_write,
    "safe_load": _safe_load,
}


def _run_one(name: str, rank: int, world: int):
    return SCENARIOS[name](rank, world)


_scenarios = Scenarios(_run_one, timeout=lambda n: 60 + 15 * n)


# A step left half-done leaves records in the job's store for the divergence
# checks (_divergence.py) that a later scenario of the same launch would read:
# these run in launches of their own.
ISOLATED = ("exception_in_forward", "exception_in_post_reduce", "exception_in_backward",
            "exception_in_backward_offload")


def _ok(world: int, name: str) -> list:
    return _scenarios.results(world, name, [n for n in SCENARIOS if n not in ISOLATED])


def _assert_clean(per_rank: list) -> None:
    lines = [f"rank {r}: {v}" for r, res in enumerate(per_rank) for v in res["violations"]]
    lines += [f"rank {r}: {p}" for r, res in enumerate(per_rank) for p in res["problems"]]
    members = {}
    for res in per_rank:
        members.update(res["members"])
    lines += check_orders([res["sequence"] for res in per_rank], members)
    assert not lines, "\n".join(lines[:20])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_obeys_cuda_rules(world, name):
    """At 2 ranks HSDP is a (2, 1) mesh: shard world size 1, the all-reduce
    and the fold on the compute stream; at 4 ranks (2, 2)."""
    per_rank = _ok(world, name)
    _assert_clean(per_rank)
    assert all(res["sequence"] for res in per_rank)  # the checker saw the collectives
    if name.startswith("exception"):  # the step raised on every rank, the next ones trained
        assert all(len(res["raised"]) == 1 for res in per_rank), [r["raised"] for r in per_rank]


# =================================================================== planted
# What review findings 1, 2 and 3 removed, put back one at a time: the
# checker must flag each on the scenario that exercises it.

def _old_min_across(self, values, shard_groups, replicate_groups):
    """Finding 1's code: the agreement's all-reduce allocates and writes on a
    side stream that never waited for the compute stream."""
    if shard_groups:
        with self._rt.use(self.all_gather_stream):
            values = _collectives.min_across(values, shard_groups)
    if replicate_groups:
        with self._rt.use(self._all_reduce_side_stream()):
            values = _collectives.min_across(values, replicate_groups)
    return values


def _old_on(self, stream, issue, then=None, post=None, after=None):
    """Finding 2's code: an exception in the post-reduce leaves no event
    that the compute stream waits for."""
    rt = self._rt
    inputs_ready = rt.current_stream().record_event()
    with rt.use(stream):
        stream.wait_event(inputs_ready)
        if after is not None:
            stream.wait_event(after)
        result = issue().wait()
        issued = None
        if then is not None:
            issued = stream.record_event()
            then(result)
        done = stream.record_event()
    if then is None:
        return streams_mod._EventWork(rt, done, result)
    self._post_reduces.append((done, post))
    return streams_mod._EventWork(rt, issued, result)


def _old_after_backward(self, t, fn):
    """Finding 3's code: the used-flags read in the post-reduce, on the backward thread."""
    fn(t.tolist())


def _old_all_reduce(self, tensor, group, op=dist.ReduceOp.SUM, what=None):
    """Finding 7's code: the used-flags' all-reduce issued async_op=True on the
    side stream (NCCL: on c10d's internal stream)."""
    work = self._on(self.reduce_scatter_stream,
                    lambda: _collectives.all_reduce_async(tensor, op, group))
    return streams_mod.Pending(work, (tensor,), what)


def _old_end_eval_forward(self):
    """Finding 13's code: nothing synchronises an eval forward's copies."""


PLANTED = {
    "finding1_min_across_without_wait": ("min_across", _old_min_across),
    "finding2_no_event_after_failure": ("_on", _old_on),
    "finding3_flags_read_in_backward": ("after_backward", _old_after_backward),
    "finding7_flags_all_reduce_async": ("all_reduce", _old_all_reduce),
    "finding13_no_sync_after_eval_forward": ("end_eval_forward", _old_end_eval_forward),
}
# which: (world size, scenario, what the checker says)
PLANTED_RUNS = {
    "finding1_min_across_without_wait": (4, "skipped_dynamic_hsdp_bf16", "[reuse]"),
    "finding2_no_event_after_failure": (2, "exception_in_post_reduce", "[reuse]"),
    "finding3_flags_read_in_backward": (2, "skipped_dynamic", "[sync in hook]"),
    "finding7_flags_all_reduce_async": (2, "parity_per_unit", "[async]"),
    "finding13_no_sync_after_eval_forward": (2, "offload_eval_then_cpu_write", "[race]"),
}


@contextlib.contextmanager
def planted(which: str):
    attr, fn = PLANTED[which]
    with mock.patch.object(streams_mod.StreamManager, attr, fn):
        yield


def _planted_runs(rank, world):
    out = {}
    for which, (w, scenario, _) in PLANTED_RUNS.items():
        if w == world:
            with planted(which):
                out[which] = SCENARIOS[scenario](rank, world)["first_of_kind"]
    return out


@functools.lru_cache(maxsize=None)
def _planted_results(world: int):
    return run_distributed(_planted_runs, world, timeout=180)


@pytest.mark.parametrize("which", list(PLANTED_RUNS))
def test_planted_race_is_flagged(which):
    """The code a review finding removed, put back: the checker flags it on
    the scenario that exercises it (and the fixed code passes that scenario,
    test_scenario_obeys_cuda_rules)."""
    world, scenario, kind = PLANTED_RUNS[which]
    per_rank = [r[which] for r in _planted_results(world)]
    assert any(kind in r for r in per_rank), per_rank


# ================================================================== findings
def _with_final_marks(rules: CudaRules):
    """Log the start and end of every final callback of the root into ``rules.log``."""
    from fsdp_compose._runtime._state import RootContext

    real = RootContext._final_callback

    def final(self):
        rules.log.append(("mark", "final start"))
        real(self)
        rules.log.append(("mark", "final end"))
    return mock.patch.object(RootContext, "_final_callback", final)


def _tag_post_reduces(rules: CudaRules):
    """Tag the ops of every post-reduce (``then`` of reduce_scatter)."""
    real = streams_mod.StreamManager.reduce_scatter

    def reduce_scatter(self, flat_grad, group, op=dist.ReduceOp.AVG, then=None, *a, **k):
        def tagged(out):
            with rules.tag("post-reduce"):
                then(out)
        return real(self, flat_grad, group, op, None if then is None else tagged, *a, **k)
    return mock.patch.object(streams_mod.StreamManager, "reduce_scatter", reduce_scatter)


def _early_post_reduce_waits(log) -> tuple[int, int]:
    """(compute waits for a side stream whose last op was a post-reduce op,
    outside the final callback; the same inside it)."""
    early = late = 0
    inside = False
    for e in log:
        if e[:2] == ("mark", "final start"):
            inside = True
        elif e[:2] == ("mark", "final end"):
            inside = False
        elif e[0] == "wait" and e[1] == "compute" and e[5] == "post-reduce":
            if inside:
                late += 1
            else:
                early += 1
    return early, late


def _overlap(rank, world):
    """bf16 (a cast in every post-reduce) and HSDP with offload (an all-reduce
    and a copy): which side-stream work the compute stream waits for where."""
    out = {}
    for name, kw in (("bf16", dict(mp=BF16)), ("hsdp_offload", dict(hsdp=True, offload=True))):
        for planted_old in (False, True):
            rules = CudaRules(strict=False)
            with _with_final_marks(rules), _tag_post_reduces(rules), \
                    (planted("finding4_wait_whole_post_reduce") if planted_old
                     else contextlib.nullcontext()):
                _train(rank, world, per_unit=True, rules=rules, **kw)
            out[(name, planted_old)] = _early_post_reduce_waits(rules.log)
    return out


def _old_on_whole(self, stream, issue, then=None, post=None, after=None):
    """Finding 4's code: the work returned waits for the whole post-reduce."""
    rt = self._rt
    caller = rt.current_stream()
    inputs_ready = caller.record_event()
    with rt.use(stream):
        stream.wait_event(inputs_ready)
        if after is not None:
            stream.wait_event(after)
        result = issue().wait()
        if then is not None:
            then(result)
        done = stream.record_event()
    return streams_mod._EventWork(rt, done, result)


PLANTED["finding4_wait_whole_post_reduce"] = ("_on", _old_on_whole)


def test_next_unit_waits_only_the_reduce_scatter():
    """Finding 4: at the next unit the compute stream waits for the
    reduce-scatter only; the post-reduce (cast, HSDP all-reduce, offload copy)
    is waited at the end of backward, as FSDP2 does. Put back, the old
    protocol waits the whole post-reduce at every next unit."""
    for res in run_distributed(_overlap, 4, timeout=120):
        for name in ("bf16", "hsdp_offload"):
            early, late = res[(name, False)]
            assert early == 0 and late > 0, (name, res)
        # (the old ``_on`` alone: the HSDP branch of reduce_scatter has its own fix)
        assert res[("bf16", True)][0] > 0, res


def _agreement_syncs(rank, world):
    out = {}
    for planted_old in (False, True):
        rules = CudaRules(strict=False)
        calls = []
        real = streams_mod.StreamManager.min_across if not planted_old else _old_min_across

        def counted(self, *args, _real=real):
            before = len(rules.syncs)
            got = _real(self, *args)
            calls.append(len(rules.syncs) - before)
            return got
        with mock.patch.object(streams_mod.StreamManager, "min_across", counted):
            _skipped(rank, world, hsdp=world == 4, steps=2, rules=rules)
        out[planted_old] = calls
    # gloo: the agreement's waits are sliced (a stopped peer is noticed)
    from fsdp_compose._comm import _divergence
    sliced = []
    real_wait = _divergence.wait
    with mock.patch.object(_divergence, "wait",
                           lambda w, *a, **k: (sliced.append(1), real_wait(w, *a, **k))):
        got = _collectives.min_across([rank + 3, 7 - rank], [dist.group.WORLD])
    out["gloo"] = (got, len(sliced))
    return out


def test_forward_order_agreement_one_host_sync():
    """Finding 6: on the CUDA path one agreement costs ONE host sync whatever
    the number of groups (was two per group: a blocking copy in, a read back);
    on gloo its wait is sliced."""
    for world in (2, 4):
        for res in run_distributed(_agreement_syncs, world, timeout=120):
            assert res[False] and all(n == 1 for n in res[False]), res[False]
            assert max(res[True]) >= 2, res[True]
            got, sliced = res["gloo"]
            assert got == [3, 7 - (world - 1)] and sliced == 1, res["gloo"]


def _hsdp_all_reduces(rank, world):
    """One HSDP step, buckets on (every unit in one bucket), on gloo and on
    the CUDA path: the gradient all-reduces across replicas and the
    reduce-scatters."""
    from ._support import IssueRecorder, recording

    out = {}
    for path in ("gloo", "cuda"):
        torch.manual_seed(0)
        model = Net(n=3)
        mesh = _mesh(world, True)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        rec = IssueRecorder()
        rules = CudaRules(strict=False)
        with recording(rec, use_double=False, kinds=("reduce_scatter", "all_reduce")), \
                (rules.active() if path == "cuda" else contextlib.nullcontext()):
            model(_batch(0, world, rank)).pow(2).mean().backward()
        kinds = [k for k, *_ in rec.issues]
        out[path] = (kinds.count("reduce_scatter"), kinds.count("all_reduce"), rules.violations)
    return out


def test_hsdp_bucket_one_all_reduce():
    """Finding 8: a bucket of several groups goes across the replicas in one
    all-reduce (was one per group)."""
    for res in run_distributed(_hsdp_all_reduces, 4, timeout=120):
        for path in ("gloo", "cuda"):
            rs, ar, bad = res[path]
            assert rs >= 1 and ar == rs and not bad, (path, res)


class _OddUnits(nn.Module):
    """Units of 3 parameters (one Linear without bias): the used-flags inline
    (3 per group) would shift what follows them off 16 bytes."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(6, 13, bias=False), nn.ReLU(),
                                                   nn.Linear(13, 6)) for _ in range(3)])
        self.out = nn.Linear(6, 1, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)


def _alignment(rank, world):
    """Reduce-scatter inputs (their rank chunks) and gradient shards, with the
    used-flags inline, in fp32 / bf16 / bf16-to-fp32 reductions."""
    bad = []
    for mp in (None, BF16, MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)):
        torch.manual_seed(0)
        model = _OddUnits()
        kw = {"mp_policy": mp} if mp else {}
        for layer in model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        real = _collectives.reduce_scatter
        seen = []

        def rs(flat, group, *a, **k):
            seen.append((flat.numel() // dist.get_world_size(group), flat.element_size()))
            return real(flat, group, *a, **k)
        with mock.patch.object(_collectives, "reduce_scatter", rs):
            model(torch.randn(4, 6)).pow(2).mean().backward()
        for chunk, size in seen:
            if chunk * size % 16:
                bad.append(f"{mp}: a rank chunk of {chunk * size} bytes")
        for u in model._units(True):
            for g in u.groups:
                for e in g.entries:
                    grad = e.grad_rows()  # this rank's rows (p.grad is a RowParam)
                    if grad is not None and grad.numel():
                        base = grad.data_ptr() - e.shard_range[0] * grad.element_size()
                        if base % 16:
                            bad.append(f"{mp}: the gradient shard of {e.fqn} at {base % 16} "
                                       "bytes past 16-byte alignment")
                        break
    return bad


def test_inline_flags_keep_16_byte_alignment():
    """Finding 10: the used-flags inline in a reduce-scatter are padded so that
    every rank's chunk and every group's gradient shard stay 16-byte aligned."""
    for world in (2, 4):
        for bad in run_distributed(_alignment, world, timeout=120):
            assert bad == [], bad


@pytest.mark.fast
def test_streams_are_made_on_the_managers_device():
    """Finding 11: the side streams (and the compute stream asked for) are
    the manager's device's, not the current device's."""
    made, asked = [], []

    class FakeStream:
        def __init__(self, device=None, priority=0):
            made.append((device, priority))

    with mock.patch.object(torch.cuda, "Stream", FakeStream), \
            mock.patch.object(torch.cuda, "current_stream",
                              lambda device=None: asked.append(device)):
        dev = torch.device("cuda", 1)
        manager = streams_mod.StreamManager(dev, runtime=streams_mod.default_runtime(dev))
        manager._rt.current_stream()
        manager._all_reduce_side_stream()
    assert made == [(dev, -1)] * 3 and asked == [dev], (made, asked)
