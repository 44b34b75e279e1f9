"""The CUDA/NCCL path, checked on a CPU-only machine: one test per item of
issue 20 (each fails without its fix).

Two doubles stand in for what this machine lacks (benchmarks/_fake_cuda.py,
shared with ``python -m benchmarks.gpu_check --dry-run``):

* ``CudaJob`` (items 1, 2, 6, through the public API): torch as a GPU job
  sees it: a visible GPU (``torch.cuda.is_available`` / ``device_count`` /
  ``current_device`` / ``is_initialized``), the default process group's
  backend string and config as torch computes them for a spelling of
  ``init_process_group`` on a CUDA machine (``BackendConfig`` with the
  accelerator reported as CUDA), and, for process groups made NCCL-only,
  NCCL's "No backend type associated with device type cpu" on a tensor of
  another device. A move to CUDA (``Tensor.to``) gives a CPU copy marked as
  on CUDA; allocating on CUDA still fails (the build has no CUDA kernels),
  which is how the tests see that a CUDA device was chosen.
* ``StreamDouble`` (items 3, 4, 5, 7, 8): the stream
  runtime of ``StreamManager``, also used by tests/test_streams.py. Streams
  and events record instead of ordering; host copies are logged with the
  stream they are issued on and whether their host buffer is pinned;
  ``event.synchronize()`` is logged. Collectives are the real gloo ones and
  complete when issued (the side-stream path issues them ``async_op=False``),
  i.e. every rank runs its collectives one at a time in its issue order: the
  worst case of ``CUDA_DEVICE_MAX_CONNECTIONS=1``. Two ranks that issue
  collectives on two process groups in different orders then deadlock, as
  NCCL can; each rank's cross-group sequence is also compared.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_compose._comm._streams as streams_mod
from benchmarks._fake_cuda import CudaJob
from fsdp_compose import (CPUOffloadPolicy, clip_grad_norm_, fully_shard, materialize,
                          param_info)

from ._dist import run_distributed
from ._pieces import piece_close
from ._support import (REGIONS, SKIPS, Block, Boom, Chain, IssueRecorder, Net, StreamDouble,
                       check_stream_protocol, per_unit_collectives, recording, shard)

# what torch says here when asked to allocate on CUDA: a CPU-only build, or a
# CUDA build on a machine without a GPU (its driver is missing)
NO_CUDA = ("Torch not compiled with CUDA enabled", "from the 'CUDA' backend",
           "Found no NVIDIA driver on your system")


def _outcome(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return "cuda" if any(s in str(e) for s in NO_CUDA) else f"{type(e).__name__}: {e}"
    return "cpu"


# ============================================================ 1. default device
def _default_device(rank, world):
    out = {}
    for spelling in (None, "cpu:gloo,cuda:nccl", "nccl", "gloo"):
        with CudaJob(spelling).active():
            torch.manual_seed(0)
            eager = _outcome(lambda: fully_shard(Net()))  # no mesh: the default one
            with torch.device("meta"):
                lazy = Net()
            for layer in lazy.layers:
                fully_shard(layer)
            fully_shard(lazy)  # nothing allocated yet
            later = _outcome(lambda: materialize(lazy))  # no device: the mesh's
        out[spelling] = (eager, later)
    return out


def test_default_device_follows_the_backend_config():
    """Item 1: ``init_process_group()`` with no backend reports "undefined",
    the multi-backend spelling reports itself: both are CUDA jobs, and
    fully_shard's default mesh and materialize's default device must be CUDA
    (gloo stays CPU)."""
    for res in run_distributed(_default_device, 2):
        assert res == {None: ("cuda", "cuda"), "cpu:gloo,cuda:nccl": ("cuda", "cuda"),
                       "nccl": ("cuda", "cuda"), "gloo": ("cpu", "cpu")}, res


@pytest.mark.fast
def test_the_cuda_job_answers_the_optimizers_graph_capture_check():
    """The optimizers' ``step()`` asks whether the current CUDA stream is
    capturing a graph once CUDA is available: torch 2.11 through
    ``torch.cuda.is_current_stream_capturing()``, 2.13 and 2.14 through
    ``torch.accelerator.current_stream().is_capturing()``. A GPU job's answer
    is no; unanswered, the real query raises without a GPU (on a CUDA build
    the optimizer asks it, and ``gpu_check --dry-run``'s steps failed on
    2.14.1 with "CUDA driver version is insufficient")."""
    with CudaJob().active():
        assert torch.cuda.is_current_stream_capturing() is False
        assert torch.accelerator.current_stream().is_capturing() is False
        p = nn.Parameter(torch.ones(3))
        p.grad = torch.ones(3)
        opt = torch.optim.AdamW([p], lr=0.1)
        opt.step()  # the check, as the version at hand asks it
    assert p.detach().lt(1).all()


# =================================================== 2. clip_grad_norm_ offload
def _clip_offload(rank, world):
    torch.manual_seed(0)
    model = Net(n=2)
    for layer in model.layers:
        fully_shard(layer, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).mean().backward()
    params = [p for p in model.parameters() if p.grad is not None]  # (held rows)
    grads = [p.grad.clone() for p in params]
    want = clip_grad_norm_(model.parameters(), 0.01)  # gloo: CPU tensors are fine
    want_grads = [p.grad.clone() for p in params]
    for p, g in zip(params, grads):
        p.grad.copy_(g)
    groups = {id(g.pg): g.pg for u in model._units(True) for g in u.groups}
    job = CudaJob(nccl_groups=groups.values())
    with job.active():
        try:
            got = clip_grad_norm_(model.parameters(), 0.01)
        except RuntimeError as e:
            return {"error": str(e), "all_reduced": job.all_reduced}
    return {"norms": (got.item(), want.item()), "all_reduced": job.all_reduced,
            "grads_equal": all(torch.equal(p.grad, g) for p, g in zip(params, want_grads))}


def test_clip_grad_norm_offload_reduces_on_the_groups_device():
    """Item 2: with CPUOffloadPolicy the partial norm is a CPU tensor; over an
    NCCL group it must be all-reduced on CUDA (and come back)."""
    for res in run_distributed(_clip_offload, 2):
        assert "error" not in res, res
        assert res["all_reduced"] and all(d == "cuda" for d, _ in res["all_reduced"]), res
        assert res["norms"][0] == pytest.approx(res["norms"][1], rel=1e-6)
        assert res["grads_equal"]


# ============================================= 6. a root without parameters
def _paramless_root(rank, world):
    rt = StreamDouble()
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    ref = copy.deepcopy(model)
    cpu_mesh = init_device_mesh("cpu", (world,))
    with CudaJob().active(), recording(rt, use_double=False), \
            streams_mod.runtime_factory(lambda d: rt if d.type == "cuda" else None):
        # The blocks live on this machine's CPU; the root owns no parameter, so
        # its mesh may say CUDA (as in a GPU job) without anything allocated there.
        for block in model:
            fully_shard(block, mesh=cpu_mesh)
        fully_shard(model, mesh=init_device_mesh("cuda", (world,)))
        x = torch.randn(4 * world, 6, generator=torch.Generator().manual_seed(1))
        model(x[4 * rank:4 * rank + 4]).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    close = all(piece_close(p.grad, q.grad, param_info(p).local_range, atol=1e-6)
                for p, q in zip(model.parameters(), ref.parameters()))
    return {"kinds": sorted({(k, s) for k, s, _, _ in rt.issues}), "close": close,
            "protocol": check_stream_protocol(rt.log)}


def test_root_without_parameters_uses_side_streams():
    """Item 6: a Sequential of sharded blocks (no parameter of its own) takes
    its mesh's device: on CUDA, side streams (the CUDA runtime) and FSDP2's
    backward schedule, not the CPU stream manager."""
    for res in run_distributed(_paramless_root, 2):
        assert res["kinds"] == [("all_gather", "ag"), ("reduce_scatter", "rs")], res
        assert res["protocol"] == [] and res["close"]


# ====================================================== 3, 8. offload copies
def _offload_steps(rank, world, variant: str):
    """Two steps with every unit offloaded ("fsdp"; "hsdp": on a (2, 2) mesh),
    or only a frozen layers.0 ("frozen": host-to-device copies, none back)."""
    torch.manual_seed(0)
    base = Net(n=3)
    if variant == "frozen":
        base.layers[0].requires_grad_(False)
    mesh = init_device_mesh("cpu", (2, world // 2)) if variant == "hsdp" else None
    runs = {}
    for name in ("default", "double"):
        rt = StreamDouble() if name == "double" else IssueRecorder()
        model = copy.deepcopy(base)
        policy = CPUOffloadPolicy(pin_memory=True)
        for i, layer in enumerate(model.layers):
            fully_shard(layer, mesh=mesh,
                        offload_policy=policy if variant != "frozen" or i == 0 else None)
        fully_shard(model, mesh=mesh, offload_policy=policy if variant != "frozen" else None)
        per_unit_collectives(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with recording(rt, use_double=name == "double"):
            for step in range(2):
                x = torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * step + rank))
                rt.log.append(("mark", f"forward {step}"))
                loss = model(x).pow(2).mean()
                rt.log.append(("mark", f"backward {step}"))
                loss.backward()
                rt.log.append(("mark", f"optimizer {step}"))
                opt.step()
                opt.zero_grad()
        runs[name] = {"params": [p.detach().clone() for p in model.parameters()],
                      "log": rt.log, "issues": rt.issues}
    return {"equal": all(torch.equal(a, b) for a, b in zip(runs["default"]["params"],
                                                           runs["double"]["params"])),
            "log": runs["double"]["log"], "issues": runs["double"]["issues"]}


@functools.lru_cache(maxsize=None)
def _offload_results(world: int, variant: str):
    return run_distributed(_offload_steps, world, variant)


def _steps(log):
    """(forward index, backward index, optimizer index) of every step in the log."""
    marks = {e[1]: i for i, e in enumerate(log) if e[0] == "mark"}
    return [(marks[f"forward {s}"], marks[f"backward {s}"], marks[f"optimizer {s}"])
            for s in range(2)]


def _host_reads_waited(log) -> list[str]:
    bad = []
    for fwd, _, opt in _steps(log):
        h2d = [i for i in range(fwd, opt) if log[i][0] == "h2d"]
        if not h2d:
            bad.append("no host-to-device copy went through the runtime (non-blocking)")
            continue
        if any(log[i][1] != "compute" for i in h2d):
            bad.append("a shard's host-to-device copy left the compute stream")
        after = [e for e in log[h2d[-1]:opt] if e[:2] == ("record", "compute")]
        synced = {e[2] for e in log[h2d[-1]:opt] if e[0] == "sync"}
        if not any(e[2] in synced for e in after):
            bad.append("the optimizer step may rewrite a pinned shard before the last "
                       "host-to-device copy read it (no synchronised event after it)")
    return bad


@pytest.mark.parametrize("world,variant", [(2, "fsdp"), (4, "hsdp"), (2, "frozen")])
def test_offload_host_to_device_copies_are_synchronised(world, variant):
    """Item 3: the pinned shard is copied to the device without blocking; an
    event recorded after the step's last such copy is synchronised before
    optimizer.step() may rewrite the shard (also with no gradient copied back)."""
    for res in _offload_results(world, variant):
        assert res["equal"]
        assert _host_reads_waited(res["log"]) == []


def _gradient_copies(log, issues, hsdp) -> list[str]:
    bad = []
    for _, bwd, opt in _steps(log):
        d2h = [i for i in range(bwd, opt) if log[i][0] == "d2h"]
        if not d2h:
            bad.append("no device-to-host gradient copy went through the runtime")
            continue
        want = "ar" if hsdp else "rs"
        if any(log[i][1] != want for i in d2h):
            bad.append(f"a gradient copy-out ran on {sorted({log[i][1] for i in d2h})}, "
                       f"not the {want} stream")
        if not all(log[i][2] for i in d2h):
            bad.append("a gradient copy-out went to pageable memory")
        syncs = [i for i in range(bwd, opt) if log[i][0] == "sync"]
        if len(syncs) != 1 or syncs[0] < d2h[-1]:
            bad.append(f"{len(syncs)} CPU synchronisations in backward, want one after the "
                       "last copy-out")
    if hsdp:
        streams = sorted({s for k, s, _, _ in issues if k == "all_reduce"})
        if streams != ["ar"]:
            bad.append(f"HSDP all-reduces issued on {streams}, want their own stream only")
    return bad


@pytest.mark.parametrize("world,variant", [(2, "fsdp"), (4, "hsdp")])
def test_offload_gradient_copies_are_nonblocking(world, variant):
    """Item 8: gradients go to pinned host memory by a non-blocking copy on
    the reduce-scatter (HSDP: all-reduce) stream, synchronised once at the end
    of backward; the HSDP all-reduce runs on its own stream."""
    for res in _offload_results(world, variant):
        assert res["equal"]
        assert _gradient_copies(res["log"], res["issues"], variant == "hsdp") == []


# ======================================================== 4. aborted backward
class _Exploding(Net):
    boom = False

    def forward(self, x):
        x = self.inp(x)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 0 and self.boom:
                x = Boom.apply(x)  # raises after layers.1's reduce-scatter was launched
        return self.out(x)


def _aborted(rank, world):
    rt = StreamDouble()
    torch.manual_seed(0)
    model = _Exploding(n=3)
    with recording(rt):
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        per_unit_collectives(model)
        x = torch.randn(4, 3)
        raised = []
        for boom in (False, True, False):
            model.boom = boom
            try:
                model(x).sum().backward()
            except RuntimeError as e:
                raised.append(str(e))
    return {"raised": raised, "protocol": check_stream_protocol(rt.log)}


def test_aborted_backward_waits_for_its_reduce_scatters():
    """Item 4: a backward that raises leaves a reduce-scatter in flight; the
    next step drops it only after the compute stream waited for it."""
    for res in run_distributed(_aborted, 2):
        assert res["raised"] == ["boom"]
        assert res["protocol"] == []


# ============================================ 7. synchronous side-stream issues
def test_side_stream_collectives_run_on_the_side_streams():
    """Item 7: on the side streams every all-gather and reduce-scatter is
    issued with async_op=False (c10d launches it on the current, high-priority
    stream); gloo keeps async_op=True."""
    for res in _offload_results(2, "fsdp"):
        side = {(k, s, a) for k, s, a, _ in res["issues"] if k != "all_reduce"}
        assert side == {("all_gather", "ag", False), ("reduce_scatter", "rs", False)}, side
    for res in run_distributed(_default_path_issues, 2):
        assert res == {("all_gather", "cpu", True), ("reduce_scatter", "cpu", True)}, res


def _default_path_issues(rank, world):
    rt = IssueRecorder()
    with recording(rt, use_double=False):
        model = per_unit_collectives(shard(Net(n=2)))
        model(torch.randn(4, 3)).sum().backward()
    return {(k, s, a) for k, s, a, _ in rt.issues}


# ================================ 5. one collective order across communicators


def _issue_order(rank, world, scenario, depth, per_unit):
    skip = SKIPS[scenario].get(rank, set())
    region = REGIONS.get(scenario)
    torch.manual_seed(0)
    model = Chain()
    ref = copy.deepcopy(model)
    rt = StreamDouble()
    with recording(rt):
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        if per_unit:
            per_unit_collectives(model)
        model.set_prefetch_depth(depth)
        xs = torch.randn(world, 4, 3, generator=torch.Generator().manual_seed(7))
        for _ in range(2):
            model.zero_grad()
            model(xs[rank], skip, region).pow(2).mean().backward()
    for r in range(world):  # the reference: the mean of every rank's loss
        ref(xs[r], SKIPS[scenario].get(r, set()), region).pow(2).mean().div(world).backward()
    close = all(piece_close(p.grad, q.grad, param_info(p).local_range, atol=1e-6)
                for p, q in zip(model.parameters(), ref.parameters()))
    return {"sequence": [(k, n) for k, _, _, n in rt.issues], "close": close}


CASES = [(scenario, depth, per_unit) for scenario in SKIPS for depth in (0, 1)
         for per_unit in (True, False)]


def _issue_orders(rank, world):
    return {case: _issue_order(rank, world, *case) for case in CASES}


@functools.lru_cache(maxsize=None)
def _order_launch(world: int):
    try:  # a failed launch (the old code deadlocks) fails every case once, not 16 times
        return run_distributed(_issue_orders, world, timeout=150), None
    except Exception as e:  # noqa: BLE001
        return None, e


def _order_results(world: int):
    results, error = _order_launch(world)
    if error is not None:
        raise error
    return results


@pytest.mark.parametrize("scenario,depth,per_unit", CASES,
                         ids=[f"{s}-depth{d}-{'per_unit' if p else 'bucketed'}"
                              for s, d, p in CASES])
@pytest.mark.parametrize("world", [2, 4])
def test_one_collective_order_across_communicators(world, scenario, depth, per_unit):
    """Item 5: all-gathers and reduce-scatters (two process groups) are issued
    in one sequence, the same on every rank, when ranks' graphs differ (a
    block's output unused on some ranks, also the output of a checkpoint
    region) and with a checkpoint region of several units; gradients are the
    mean of every rank's. On the old code ranks interleave the two groups
    differently and the double deadlocks (the launch fails)."""
    res = [r[(scenario, depth, per_unit)] for r in _order_results(world)]
    for r in res[1:]:
        assert r["sequence"] == res[0]["sequence"]
    assert all(r["close"] for r in res)
