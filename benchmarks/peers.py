"""fsdp_compose against its peers, on the same model and data in one invocation.

    python -m benchmarks.peers                       # every shape, 2 gloo CPU ranks
    python -m benchmarks.peers --shape memory --repeats 5
    python -m benchmarks.peers --world-size 1        # adds "local" (plain PyTorch)
    python -m benchmarks.peers --profile fsdp_compose --shape overhead
    python -m benchmarks.peers --setting fp32 bf16 offload accum   # a table per setting
    python -m benchmarks.peers --compile             # each block torch.compile'd (inductor)
    torchrun --nproc-per-node 8 -m benchmarks.peers --impls fsdp_compose   # NCCL, one impl per run

Implementations (``--impls``):
  fsdp_compose  ``fsdp_compose.fully_shard`` on each block, then the root
  fsdp2         ``torch.distributed.fsdp.fully_shard``, same wrapping
  fsdp1         ``torch.distributed.fsdp.FullyShardedDataParallel``, one FSDP
                unit per block (``ModuleWrapPolicy``) + root, ``use_orig_params=True``
  ddp           ``torch.nn.parallel.DistributedDataParallel``
  local         plain PyTorch in one process (``--world-size 1`` only)

Settings (``--setting``, several allowed; default ``fp32``), applied identically
to every implementation that has them, skipped (and said so) for the others:
  fp32          today's run: fp32 parameters, gradients, collectives
  bf16          fsdp_compose / FSDP2: ``MixedPrecisionPolicy(param_dtype=bf16,
                reduce_dtype=fp32)`` on every unit; FSDP1: ``MixedPrecision`` with
                the same dtypes; DDP / local: ``torch.autocast(bf16)`` (fp32
                weights, gradients and all-reduce: a different recipe, shown for
                reference only). The loss is taken in fp32 (``out.float()``).
  offload       fsdp_compose / FSDP2: ``CPUOffloadPolicy`` (``pin_memory`` only
                with CUDA: pinning needs an accelerator); FSDP1:
                ``CPUOffload(offload_params=True)``, not on the gloo CPU path (it
                pins unconditionally); not DDP / local. On a CPU-only machine the
                "device" is the CPU too, so this times the offload bookkeeping, not
                host-device copies.
  accum         4 microbatches per step: the per-rank batch split in 4, each
                loss / 4, ``set_requires_gradient_sync(False)`` before the first 3
                backwards and True before the last (DDP / FSDP1: ``no_sync()``
                on the first 3); one optimizer step. fwd/bwd ms are summed over
                the microbatches.
  bf16-offload  bf16 and offload together
  muon          torch.optim.Muon over the 2-D weights (lr 0.02) and AdamW over
                the rest, the same optimizers on every implementation;
                fsdp_compose with ``shard_granularity="tensor"`` (each matrix
                whole on one rank: Newton-Schulz runs on one rank, exactly),
                FSDP2 on its DTensor shards; not FSDP1 (its 1-D flat views
                are not matrices). Loss checked against DDP.
Compiled (``--compile [blocks|model]``, backend ``--compile-backend``, default
inductor): every implementation compiled the same way after wrapping: each
block (``block.compile()``, the torchtitan recipe; the default) or the whole
model (``torch.compile(model)``); FSDP1 is left out unless named. Compilation
happens in the warmup steps (inductor's first compile takes tens of seconds on
a small CPU; later launches read its on-disk cache). Each table then shows,
per implementation (rank 0, first repeat), dynamo's graph breaks and graphs,
and the recompiles during the timed steps. Results go to peers_compile.json /
.png, so the eager results stay.

Several settings run in one invocation with the launches alternating over
settings and implementations (fp32: A B C, bf16: A B C, ..., then the next
repeat), so ratios within one run are comparable; one table per (shape,
setting), then a summary (fsdp_compose and FSDP2 step time and peak RSS per
setting, ours/FSDP2 ratios, ours/FSDP1 when FSDP1 ran, and the loss check). The
loss check compares fsdp_compose per step with DDP (else local, else FSDP2) for
fp32/offload/accum (tolerance 1e-4), and with FSDP2 (else FSDP1) for the bf16
settings (tolerance 1e-2). With several settings a failed launch drops that
(setting, implementation) and the run goes on; the errors are printed at the
end and the exit status is 2. In peers.json a setting other than fp32 is keyed
``<shape>:<setting>``.

Method. Every (implementation, repeat) is its own fresh set of rank processes
(gloo, rendezvous on a free port, one intra-op thread per rank: two ranks on
two cores; more threads oversubscribe and slow DDP's compute down). Ranks are
forked from a fork server that has imported torch, the implementations and the
benchmark models and nothing else, so they start in a fraction of a second
from the same ~200 MiB baseline RSS; a rank's peak RSS
(``getrusage(RUSAGE_SELF).ru_maxrss``) is then that implementation's peak,
and the table also shows it minus the RSS the rank had before building the
model. Launches alternate implementations (A B C D A B C D ...). Every launch
builds the model from the same seed and feeds every rank the same per-rank
batches; AdamW(lr=1e-3) built after wrapping; a step is forward + MSE loss +
backward + ``optim.step()`` + ``zero_grad()``. Warmup steps are run but not
timed. Reported per implementation: the median over repeats of (median over
timed steps of the slowest rank's step time); process CPU time per step (all
threads: less sensitive than wall time to a busy machine); peak RSS per rank
(max over ranks, median over repeats); the final loss (mean over ranks); and
the largest relative per-step loss difference against DDP. This orchestrating
process never imports torch (matplotlib only at the end, for the plot).
``benchmarks.before_after`` reuses these launches to compare two versions of
fsdp_compose in one run: its ranks import the library from the folder in
their config (``fsdp_compose_path``, forked from a server that did not
preload it, ``PRELOAD_FROM_PATH``), and time ``optimizer.step()`` alone after
the timed steps (``optim_steps``). Neither is set by this CLI.

Defaults (all four shapes, 4 implementations, 3 repeats) take ~11-15 minutes
on a 2-core machine: overhead 3 warmup + 15 timed steps, memory and deep 1 + 3
(their steps take seconds each on gloo: ~1.5 GiB of collectives per step per
rank), deep-small 2 + 5.

Under torchrun (RANK/WORLD_SIZE set) the processes are torchrun's: NCCL when
CUDA is there (peak = ``torch.cuda.max_memory_allocated``), one implementation
per run, repeats in-process. Rank 0 writes ``peers_torchrun_<impl>.json`` and
prints a table of every such file in ``--out`` with the same settings. (On CPU
under torchrun, RSS peaks are per process lifetime: repeats after the first
include the earlier ones. The CUDA path has not been run on a GPU yet.)
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import sys
import time

from benchmarks._launch import LaunchError, import_fsdp_compose_from, run_ranks, write_result
from benchmarks.shapes import SHAPES, Shape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "out")

IMPLS = ["fsdp_compose", "fsdp2", "fsdp1", "ddp", "local"]
LABEL = {"fsdp_compose": "fsdp_compose", "fsdp2": "FSDP2", "fsdp1": "FSDP1",
         "ddp": "DDP", "local": "local"}
OURS = "fsdp_compose"
PARITY_REF = "ddp"
PARITY_RTOL = 1e-4     # fsdp_compose vs DDP, per step, relative
LR = 1e-3

# --setting: the same training configuration applied to every implementation
# that has it (fsdp_compose and FSDP2 have all of them).
SETTINGS = ["fp32", "bf16", "offload", "accum", "bf16-offload", "muon"]
SETTING_WHAT = {
    "fp32": "fp32 parameters, gradients and collectives",
    "bf16": "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); FSDP1 "
            "MixedPrecision(same); DDP/local: torch.autocast(bf16), fp32 weights and reduction",
    "offload": "CPUOffloadPolicy (pin_memory only on CUDA); FSDP1 CPUOffload(offload_params=True)",
    "accum": "4 microbatches per step (the per-rank batch split in 4, loss / 4), "
             "set_requires_gradient_sync(False) on the first 3; DDP/FSDP1: no_sync()",
    "bf16-offload": "bf16 and offload together",
    "muon": "torch.optim.Muon (2-D weights, lr 0.02) + AdamW (the rest); fsdp_compose "
            "shard_granularity='tensor', FSDP2 on DTensor shards",
}
SUPPORTED = {  # implementation -> settings it runs (the others are skipped)
    "fsdp_compose": set(SETTINGS), "fsdp2": set(SETTINGS), "fsdp1": set(SETTINGS) - {"muon"},
    "ddp": {"fp32", "bf16", "accum", "muon"}, "local": {"fp32", "bf16", "accum", "muon"},
}
MUON_LR = 0.02
# Not on the gloo CPU path (this script's own ranks): FSDP1's CPUOffload pins
# its shards unconditionally, which raises without an accelerator.
CPU_UNSUPPORTED = {("fsdp1", "offload"): "CPUOffload pins memory: needs an accelerator",
                   ("fsdp1", "bf16-offload"): "CPUOffload pins memory: needs an accelerator"}
ACCUM_MICRO = 4
BF16_RTOL = 1e-2       # bf16 settings: fsdp_compose vs FSDP2 (no bit-identity to expect)
COMPILE_WHAT = {"blocks": "block.compile() on every block after wrapping",
                "model": "torch.compile(model) after wrapping"}


def _layout_module():
    """fsdp_compose/_plan/_layout.py loaded on its own (pure Python: importing the
    package would import torch into this orchestrating process)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "_fsdp_compose_layout", os.path.join(ROOT, "fsdp_compose", "_plan", "_layout.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def layout_line(shape: Shape, world: int) -> str:
    """How evenly one block unit's fp32 parameters spread over ``world`` ranks,
    in the row layout (the default) and the tensor layout (``shard_granularity=
    "tensor"``): max over mean bytes per rank, and padding in the collectives."""
    lay = _layout_module()
    slots = [lay.Slot(shape.hidden, shape.dim), lay.Slot(shape.hidden, 1),
             lay.Slot(shape.dim, shape.hidden), lay.Slot(shape.dim, 1)]
    total = sum(s.numel for s in slots)
    parts = []
    for g in lay.GRANULARITIES:
        plan = lay.plan(slots, world, 4, g)
        held = plan.rank_numel()
        parts.append(f"{g}: max/mean bytes per rank {max(held) / (total / world):.3f}, "
                     f"padding {100 * (plan.numel - total) / total:.2f}%")
    return f"   layout of a block unit over {world} rank(s): " + "; ".join(parts)


def _is_bf16(setting: str) -> bool:
    return setting.startswith("bf16")


def _is_offload(setting: str) -> bool:
    return setting.endswith("offload")


def _run_key(shape_name: str, setting: str) -> str:
    """Key of a (shape, setting) in the json files: the shape alone for fp32."""
    return shape_name if setting == "fp32" else f"{shape_name}:{setting}"


# =============================================================================
# Rank side (imports torch)
# =============================================================================
def _rss_now_mib() -> dict:
    import resource
    out = {"ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmHWM:", "VmRSS:")):
                    k, v = line.split(":")
                    out[k + "_mib"] = int(v.split()[0]) / 1024
    except OSError:
        pass
    return out


def _wrap(impl: str, model, world: int, device, setting: str = "fp32"):
    """Apply ``impl`` under ``setting`` to ``model`` (an MLPStack); return the module to train."""
    import torch
    from benchmarks.models import MLPBlock

    bf16, offload = _is_bf16(setting), _is_offload(setting)
    if impl in ("local", "ddp") and offload:
        raise ValueError(f"{impl} has no setting {setting!r}")
    if impl == "local":
        return model
    if impl in ("fsdp_compose", "fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        if impl == "fsdp_compose":
            from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        else:
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        kw = {}
        if bf16:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
        if offload:  # pinning needs an accelerator (torch's CPUOffloadPolicy raises without)
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        if setting == "muon" and impl == "fsdp_compose":
            kw["shard_granularity"] = "tensor"
        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        return model
    if impl == "fsdp1":
        from torch.distributed.fsdp import CPUOffload, MixedPrecision
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        kw = {}
        if bf16:
            kw["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
        if offload:
            kw["cpu_offload"] = CPUOffload(offload_params=True)
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({MLPBlock}), use_orig_params=True,
                    device_id=device, **kw)  # CPU: torch.device("cpu") (None raises on CPU)
    if impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    raise ValueError(impl)


class _Optims:
    """Several optimizers stepped as one."""

    def __init__(self, optims):
        self.optims = optims

    def step(self):
        for o in self.optims:
            o.step()

    def zero_grad(self):
        for o in self.optims:
            o.zero_grad()


def _compile(model, impl: str, how: str, backend: str):
    """Compile ``model`` (as wrapped by ``impl``) the same way for every
    implementation: each block (``block.compile()``) or the whole model."""
    import torch
    if how == "model":
        return torch.compile(model, backend=backend)
    inner = model.module if impl in ("ddp", "fsdp1") else model
    for block in inner.blocks:  # FSDP1: its FSDP wrappers around the blocks
        block.compile(backend=backend)
    return model


def _compile_counts() -> dict:
    from torch._dynamo.utils import counters
    return {"breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["total"]}


def _make_optim(model, setting: str):
    import torch
    if setting != "muon":
        return torch.optim.AdamW(model.parameters(), lr=LR)
    params = list(model.parameters())
    return _Optims([torch.optim.Muon([p for p in params if p.ndim == 2], lr=MUON_LR),
                    torch.optim.AdamW([p for p in params if p.ndim != 2], lr=LR)])


def run_impl(cfg: dict, rank: int, world: int, device) -> dict:
    """One launch of one implementation on this rank; returns this rank's numbers."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from benchmarks.models import build_model, make_data

    impl, shape = cfg["impl"], Shape(**cfg["shape"])
    setting = cfg.get("setting", "fp32")
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    distributed = impl != "local"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    mem_start = _rss_now_mib()
    t_setup = time.time()

    model = build_model(shape, cfg["seed"], device)
    model = _wrap(impl, model, world, device, setting)
    optim = _make_optim(model, setting)  # (over the parameters: before compile wraps the model)
    if cfg.get("compile"):
        model = _compile(model, impl, cfg["compile"], cfg["compile_backend"])
    warmup, steps = cfg["warmup"], cfg["steps"]
    profile_steps = cfg.get("profile_steps", 0)
    n_total = warmup + steps + profile_steps
    data = make_data(shape, cfg["seed"], rank, n_total, device)
    local_numel = sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                      for p in model.parameters())  # FSDP2: DTensor -> local shard
    mem_setup = _rss_now_mib()
    t_setup_done = time.time()

    comm = None
    if impl == "fsdp_compose":
        import fsdp_compose
        comm = fsdp_compose

    # accum: ACCUM_MICRO microbatches per step, gradient sync on the last only.
    micro = ACCUM_MICRO if setting == "accum" else 1
    if micro > 1 and shape.batch % micro:
        raise ValueError(f"accum: batch {shape.batch} not divisible by {micro}")

    def sync_grads(last: bool):
        """Context for one microbatch's forward + backward (accum only)."""
        if micro == 1 or impl == "local":
            return contextlib.nullcontext()
        if impl in ("fsdp_compose", "fsdp2"):
            model.set_requires_gradient_sync(last)  # noqa: F821 (ruff: deleted at the end)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else model.no_sync()  # noqa: F821 (DDP, FSDP1)

    # bf16 on DDP / local: autocast (fp32 weights, bf16 matmuls, fp32 gradients).
    autocast = (functools.partial(torch.autocast, device.type, dtype=torch.bfloat16)
                if _is_bf16(setting) and impl in ("ddp", "local") else contextlib.nullcontext)

    def step(x, y):
        c0 = time.process_time()  # CPU time of all this process's threads (gloo's too)
        t0 = time.perf_counter()
        fwd = bwd = 0.0
        xs, ys = (x.chunk(micro), y.chunk(micro)) if micro > 1 else ((x,), (y,))
        total = None
        for k, (xm, ym) in enumerate(zip(xs, ys)):
            with sync_grads(k == micro - 1):
                ta = time.perf_counter()
                with autocast():
                    out = model(xm)  # noqa: F821
                loss = F.mse_loss(out.float(), ym)  # bf16 outputs: the loss in fp32
                if micro > 1:
                    loss = loss / micro  # equal chunks: the sum is the full batch's mean
                tb = time.perf_counter()
                loss.backward()
                tc = time.perf_counter()
            fwd += tb - ta
            bwd += tc - tb
            total = loss.detach() if total is None else total + loss.detach()
        optim.step()  # noqa: F821
        optim.zero_grad()  # noqa: F821
        sync()
        t3 = time.perf_counter()
        phases = None if cuda else (fwd, bwd, t3 - t0 - fwd - bwd, time.process_time() - c0)
        return total, t3 - t0, phases

    losses, times, phases = [], [], []
    for i in range(warmup):
        loss, _, _ = step(*data[i])
        losses.append(loss)
    sync()
    compiled = _compile_counts() if cfg.get("compile") else None
    if distributed:
        dist.barrier()
    if comm is not None:
        comm.reset_comm_stats()
    t_start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        loss, dt, ph = step(*data[i])
        losses.append(loss)
        times.append(dt)
        phases.append(ph)
    sync()
    t_total = time.perf_counter() - t_start
    if compiled is not None:  # frames converted / graphs made while timing: recompiles
        now = _compile_counts()
        compiled["timed_recompiles"] = max(now["frames"] - compiled["frames"],
                                           now["graphs"] - compiled["graphs"])
    stats = None
    if comm is not None:
        s = comm.comm_stats()
        stats = {k: v / max(steps, 1) for k, v in vars(s).items()}  # per step

    trace_path, prof_summary = None, None
    if profile_steps:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if distributed:
            dist.barrier()
        with profile(activities=acts, record_shapes=False) as prof:
            for i in range(warmup + steps, n_total):
                loss, _, _ = step(*data[i])
                losses.append(loss)
        tag = shape.name if setting == "fp32" else f"{shape.name}_{setting}"
        trace_path = os.path.join(cfg["out"], f"trace_{tag}_{impl}_w{world}_rank{rank}.json")
        prof.export_chrome_trace(trace_path)
        prof_summary = _summarise_profile(prof, profile_steps)

    if distributed:
        dist.barrier()
    mem_end = _rss_now_mib()  # (the peak is read here: the optimizer timing below adds state)
    res = {
        "impl": impl, "setting": setting, "rank": rank, "world": world, "device": str(device),
        "losses": [float(v) for v in losses],
        "step_s": times, "phase_s": phases, "total_s": t_total,
        "local_param_numel": local_numel,
        "peak_mib": (torch.cuda.max_memory_allocated(device) / 2**20 if cuda
                     else mem_end["ru_maxrss_mib"]),
        "mem_start": mem_start, "mem_setup": mem_setup, "mem_end": mem_end,
        "comm_per_step": stats, "trace": trace_path, "profile": prof_summary,
        "compiled": compiled,
        "torch": torch.__version__,
        "t_setup": t_setup, "t_setup_done": t_setup_done, "t_end": time.time(),
    }
    if cfg.get("optim_steps"):
        res["optim_step_s"], res["optim_step_cpu_s"] = _time_optim_steps(
            model, optim, data[-1], cfg["optim_steps"], setting, distributed, sync)
    del optim, model, data
    return res


def _time_optim_steps(model, optim, batch, n: int, setting: str, distributed: bool,
                      sync) -> tuple[dict, dict]:
    """``optimizer.step()`` alone, ``n`` times, on the trained model (cfg
    ``optim_steps``, after the peak memory was read): one more forward and
    backward makes the gradients, then each optimizer steps on them, alternating
    (an untimed first step each). ``default``: the run's own optimizer (AdamW
    with torch's defaults: on CPU its for-loop implementation, as torch uses
    foreach only on accelerators); ``foreach``: AdamW(foreach=True) on the same
    parameters (not under the muon setting). Seconds per step, this rank: wall
    time, and this thread's CPU time (with one intra-op thread the step runs on
    it: what a busy machine's other jobs change least)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    x, y = batch
    optim.zero_grad()
    F.mse_loss(model(x).float(), y).backward()
    optims = {"default": optim}
    if setting != "muon":
        optims["foreach"] = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    for o in optims.values():
        o.step()
    sync()
    if distributed:
        dist.barrier()
    times: dict = {k: [] for k in optims}
    cpu: dict = {k: [] for k in optims}
    for _ in range(n):
        for k, o in optims.items():
            c0, t0 = time.thread_time(), time.perf_counter()
            o.step()
            sync()
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.thread_time() - c0)
    optim.zero_grad()
    return times, cpu


def _summarise_profile(prof, n_steps: int) -> list:
    """Profiler events grouped by label (``fsdp_compose::phase (fqn)`` -> phase)."""
    groups: dict[str, dict] = {}
    for e in prof.key_averages():
        name = e.key.split(" (")[0]
        g = groups.setdefault(name, {"name": name, "count": 0, "cpu_total_ms": 0.0,
                                     "self_cpu_ms": 0.0})
        g["count"] += e.count
        g["cpu_total_ms"] += e.cpu_time_total / 1e3
        g["self_cpu_ms"] += e.self_cpu_time_total / 1e3
    rows = sorted(groups.values(), key=lambda g: -g["cpu_total_ms"])
    for g in rows:
        g["count"] /= n_steps
        g["cpu_total_ms"] /= n_steps
        g["self_cpu_ms"] /= n_steps
    return rows


def _worker_entry(cfg_path: str) -> None:
    """A rank spawned by this script (env: RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    t_enter = time.time()
    with open(cfg_path) as f:
        cfg = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cfg["pg_timeout"] > 10:  # a hang shows where each rank was, before the kill
        import faulthandler
        faulthandler.dump_traceback_later(cfg["pg_timeout"] - 5, exit=False)
    where = None
    if cfg.get("fsdp_compose_path"):  # this version of the library (benchmarks.before_after)
        where = import_fsdp_compose_from(cfg["fsdp_compose_path"])
    import torch
    torch.set_num_threads(cfg["threads"])
    import torch.distributed as dist
    from datetime import timedelta
    if cfg["impl"] != "local":
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=cfg["pg_timeout"]))
    try:
        res = run_impl(cfg, rank, world, torch.device("cpu"))
        res["t_enter"] = t_enter
        res["fsdp_compose_file"] = where
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    write_result(cfg, rank, res)


# =============================================================================
# Orchestrator side (no torch)
# =============================================================================
# Imported once by the fork server; every rank is forked from it (fast start,
# and the same ~torch-import RSS baseline for every implementation).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.nn.parallel",
            "torch.profiler", "fsdp_compose", "benchmarks.models"]
#: For a run whose ranks import fsdp_compose themselves, each from its
#: ``cfg["fsdp_compose_path"]`` (``benchmarks.before_after``: two versions in one
#: run): the same without the library, plus torch modules it imports. One fork
#: server serves a whole process, so every launch of such a run must use it.
PRELOAD_FROM_PATH = [m for m in _PRELOAD if m != "fsdp_compose"] + [
    "torch.distributed.tensor", "torch.distributed.checkpoint"]


def _launch_once(cfg: dict, world: int, timeout: float, preload: list[str]) -> list[dict]:
    return run_ranks("benchmarks.peers", preload, cfg, world, timeout,
                     f"{cfg['impl']} ({cfg['shape']['name']}, world {world})")


def launch(cfg: dict, world: int, timeout: float,
           preload: list[str] | None = None) -> list[dict]:
    """Run one implementation in ``world`` fresh processes; retry once on a port race.
    ``preload``: the fork server's modules (default: torch, the implementations
    and the models)."""
    preload = _PRELOAD if preload is None else preload
    try:
        return _launch_once(cfg, world, timeout, preload)
    except LaunchError as e:
        if "ddress already in use" not in str(e) and "EADDRINUSE" not in str(e):
            raise
        return _launch_once(cfg, world, timeout, preload)


def _shape_dict(shape: Shape) -> dict:
    return {k: getattr(shape, k) for k in shape.__dataclass_fields__}


# ---------------------------------------------------------------- reduction
def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def summarise_launch(ranks: list[dict]) -> dict:
    """One launch (all ranks) -> the numbers the table uses."""
    n = len(ranks[0]["step_s"])
    slowest = [max(r["step_s"][i] for r in ranks) for i in range(n)]
    phases = None
    if ranks[0]["phase_s"] and ranks[0]["phase_s"][0] is not None:
        phases = [_median([max(r["phase_s"][i][k] for r in ranks) for i in range(n)]) * 1e3
                  for k in range(4)]
    n_loss = len(ranks[0]["losses"])
    return {
        "step_ms": _median(slowest) * 1e3,
        "mean_step_ms": max(r["total_s"] for r in ranks) / max(n, 1) * 1e3,
        "phase_ms": phases,  # forward, backward, optimizer, CPU time (medians over steps)
        "peak_mib": max(r["peak_mib"] for r in ranks),
        "peak_mib_per_rank": [r["peak_mib"] for r in ranks],
        "setup_mib": max(r["mem_setup"]["ru_maxrss_mib"] for r in ranks),
        "start_mib": max(r["mem_start"]["ru_maxrss_mib"] for r in ranks),
        "losses": [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(n_loss)],
        "local_param_numel": [r["local_param_numel"] for r in ranks],
        "comm_per_step": ranks[0]["comm_per_step"],
        "compiled": ranks[0].get("compiled"),
    }


def summarise_impl(launches: list[dict]) -> dict:
    steps = [L["step_ms"] for L in launches]
    peaks = [L["peak_mib"] for L in launches]
    phases = None
    if launches[0]["phase_ms"] is not None:
        phases = [_median([L["phase_ms"][k] for L in launches]) for k in range(4)]
    losses = launches[0]["losses"]
    deterministic = all(L["losses"] == losses for L in launches)
    return {
        "step_ms": _median(steps), "step_ms_min": min(steps), "step_ms_max": max(steps),
        "step_ms_repeats": steps,
        "peak_mib": _median(peaks), "peak_mib_min": min(peaks), "peak_mib_max": max(peaks),
        "peak_mib_repeats": peaks,
        "setup_mib": _median([L["setup_mib"] for L in launches]),
        "start_mib": _median([L["start_mib"] for L in launches]),
        "phase_ms": phases, "losses": losses, "final_loss": losses[-1],
        "repeats_identical_losses": deterministic,
        "local_param_numel": launches[0]["local_param_numel"],
        "comm_per_step": launches[0]["comm_per_step"],
        "compiled": launches[0].get("compiled"),
    }


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=float("nan"))


def parity_ref(summary: dict, setting: str) -> tuple[str | None, float]:
    """Which implementation fsdp_compose's losses are checked against, and the tolerance.

    fp32, offload, accum: DDP (else local, else FSDP2); the same arithmetic, so
    a tight tolerance. bf16 settings: FSDP2 (else FSDP1), as DDP/local run
    autocast, a different recipe (fp32 weights, bf16 only in the matmuls).
    """
    order = ["fsdp2", "fsdp1"] if _is_bf16(setting) else [PARITY_REF, "local", "fsdp2"]
    name = next((i for i in order if i in summary), None)
    return name, (BF16_RTOL if _is_bf16(setting) else PARITY_RTOL)


def shape_report(shape: Shape, summary: dict, meta: dict,
                 setting: str | None = None) -> tuple[str, dict]:
    """The printed table for one shape (under one setting), and its parity verdict.
    ``setting`` None: fp32, and the header does not name it (the default run)."""
    impls = [i for i in IMPLS if i in summary]
    ours = summary.get(OURS)
    ref_name, rtol = parity_ref(summary, setting or "fp32")
    ref = summary.get(ref_name)
    title = f"== shape '{shape.name}': {shape.what}"
    if setting is not None:
        title = (f"== shape '{shape.name}', setting '{setting}': {SETTING_WHAT[setting]}\n"
                 f"   {shape.what}")
    lines = [
        title,
        f"   {shape.numel / 1e6:.2f}M params, batch {shape.batch} x {shape.dim} per rank, "
        f"{meta['world']} rank(s) {meta['backend']}, {meta['threads']} thread(s)/rank, "
        f"{meta['warmup']} warmup + {meta['steps']} timed steps x {meta['repeats']} repeat(s), "
        f"AdamW",
    ]
    if meta.get("compile"):
        lines.append(f"   compiled: {COMPILE_WHAT[meta['compile']]}, backend "
                     f"{meta['compile_backend']} (compilation in the warmup steps)")
    lines.append(layout_line(shape, meta["world"]))
    mem_name = "peak MiB" + (" RSS" if meta["backend"] == "gloo" else " cuda")
    head = (f"   {'impl':<13} {'step ms':>9} {'[min..max]':>17} {'fwd/bwd/opt ms':>20} "
            f"{'CPU ms':>8} {mem_name:>13} {'(+MiB)':>7} {'final loss':>11} {'ours/x time':>11} "
            f"{'ours/x CPU':>10} {'ours/x mem':>10} {'dloss vs ' + LABEL.get(ref_name, '-'):>13}")
    lines += [head, "   " + "-" * (len(head) - 3)]
    for i in impls:
        s = summary[i]
        ph = "/".join(f"{v:.1f}" for v in s["phase_ms"][:3]) if s["phase_ms"] else "-"
        cpu = f"{s['phase_ms'][3]:.1f}" if s["phase_ms"] else "-"
        rt = f"{ours['step_ms'] / s['step_ms']:.2f}" if ours else "-"
        rc = (f"{ours['phase_ms'][3] / s['phase_ms'][3]:.2f}"
              if ours and ours["phase_ms"] and s["phase_ms"] else "-")
        rm = f"{ours['peak_mib'] / s['peak_mib']:.2f}" if ours else "-"
        dl = f"{max_rel_diff(s['losses'], ref['losses']):.1e}" if ref else "-"
        rng = f"[{s['step_ms_min']:.1f}..{s['step_ms_max']:.1f}]"
        lines.append(f"   {LABEL[i]:<13} {s['step_ms']:>9.2f} {rng:>17} {ph:>20} {cpu:>8} "
                     f"{s['peak_mib']:>13.0f} {s['peak_mib'] - s['start_mib']:>+7.0f} "
                     f"{s['final_loss']:>11.6f} {rt:>11} {rc:>10} "
                     f"{rm:>10} {dl:>13}")
    lines.append("   step ms: median over repeats of the median timed step (slowest rank); "
                 "CPU ms: process CPU time per step (all threads), max over ranks; "
                 "peak: max over ranks, median over repeats;\n"
                 "   (+MiB): peak minus the rank's RSS before the model was built (torch "
                 "imported, process group up)")
    if ours:
        ratios = [f"ours/{LABEL[i]} time {ours['step_ms'] / summary[i]['step_ms']:.2f}, "
                  f"mem {ours['peak_mib'] / summary[i]['peak_mib']:.2f}"
                  for i in impls if i != OURS]
        if ratios:
            lines.append("   ratios (<1: fsdp_compose faster / smaller): " + "; ".join(ratios))
        c = ours.get("comm_per_step")
        if c:
            lines.append(
                f"   fsdp_compose collectives/step: {c['all_gather_calls']:.0f} all-gather "
                f"({c['all_gather_bytes'] / 2**20:.1f} MiB), {c['reduce_scatter_calls']:.0f} "
                f"reduce-scatter ({c['reduce_scatter_bytes'] / 2**20:.1f} MiB), "
                f"{c['all_reduce_calls']:.0f} all-reduce")
    counts = [f"{LABEL[i]} {c['breaks']} breaks / {c['graphs']} graphs / "
              f"{c['timed_recompiles']} recompiles" for i in impls
              if (c := summary[i].get("compiled")) is not None]
    if counts:
        lines.append("   dynamo (rank 0, first repeat; recompiles: while timing): "
                     + "; ".join(counts))
    parity = {"ref": ref_name, "rtol": rtol}
    if ours and ref and ref_name != OURS:
        d = max_rel_diff(ours["losses"], ref["losses"])
        parity.update(max_rel_diff=d, ok=bool(d <= rtol), steps=len(ours["losses"]))
        lines.append(f"   loss parity fsdp_compose vs {LABEL[ref_name]}: max rel diff over "
                     f"{len(ours['losses'])} steps = {d:.2e} -> "
                     f"{'OK' if d <= rtol else 'MISMATCH'} (tol {rtol:g})")
    if setting is not None and _is_bf16(setting) and ("ddp" in impls or "local" in impls):
        lines.append("   (DDP/local under bf16: torch.autocast, not a parameter dtype: "
                     "their losses and memory are a different recipe's)")
    nondet = [LABEL[i] for i in impls if not summary[i]["repeats_identical_losses"]]
    if nondet:
        lines.append(f"   note: losses differ between repeats for {', '.join(nondet)}")
    return "\n".join(lines), parity


def settings_summary(rows: list, meta: dict) -> str:
    """One line per (shape, setting): fsdp_compose and FSDP2 (and FSDP1 when run)."""
    fsdp1 = any("fsdp1" in summ for _, _, summ, _ in rows)

    def num(summ, impl, key, fmt):
        return format(summ[impl][key], fmt) if impl in summ else "-"

    def ratio(summ, impl, key):
        if OURS not in summ or impl not in summ:
            return "-"
        return f"{summ[OURS][key] / summ[impl][key]:.2f}"

    head = (f"   {'shape':<9} {'setting':<13} {'ours ms':>9} {'FSDP2 ms':>9} {'ours/FSDP2':>10} "
            f"{'ours MiB':>9} {'FSDP2 MiB':>9} {'ours/FSDP2':>10}")
    if fsdp1:
        head += f" {'ours/FSDP1 t':>12} {'ours/FSDP1 m':>12}"
    head += f" {'loss check (max rel diff)':>34}"
    lines = [f"== summary: step time and peak RSS per rank, fsdp_compose (ours) vs FSDP2, "
             f"{meta['world']} rank(s) {meta['backend']}, median of {meta['repeats']} "
             f"repeat(s)", head, "   " + "-" * (len(head) - 3)]
    for shape_name, st, summ, par in rows:
        line = (f"   {shape_name:<9} {st:<13} {num(summ, OURS, 'step_ms', '.1f'):>9} "
                f"{num(summ, 'fsdp2', 'step_ms', '.1f'):>9} {ratio(summ, 'fsdp2', 'step_ms'):>10} "
                f"{num(summ, OURS, 'peak_mib', '.0f'):>9} "
                f"{num(summ, 'fsdp2', 'peak_mib', '.0f'):>9} "
                f"{ratio(summ, 'fsdp2', 'peak_mib'):>10}")
        if fsdp1:
            line += f" {ratio(summ, 'fsdp1', 'step_ms'):>12} {ratio(summ, 'fsdp1', 'peak_mib'):>12}"
        if "ok" in par:
            chk = (f"vs {LABEL[par['ref']]} {par['max_rel_diff']:.1e} "
                   f"{'OK' if par['ok'] else 'MISMATCH'}")
        else:
            chk = "-"
        lines.append(line + f" {chk:>34}")
    lines.append("   ratios < 1: fsdp_compose faster / smaller. Loss check: fp32/offload/accum "
                 f"vs DDP (else local, else FSDP2), tol {PARITY_RTOL:g}; bf16 settings vs FSDP2 "
                 f"(else FSDP1), tol {BF16_RTOL:g}")
    return "\n".join(lines)


def plot(results: dict, path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    shapes = list(results["shapes"])
    fig, axes = plt.subplots(len(shapes), 2, figsize=(11, 3.6 * len(shapes)), squeeze=False)
    colors = {"fsdp_compose": "#d62728", "fsdp2": "#1f77b4", "fsdp1": "#9467bd",
              "ddp": "#7f7f7f", "local": "#2ca02c"}
    for row, name in enumerate(shapes):
        summ = results["shapes"][name]["impls"]
        impls = [i for i in IMPLS if i in summ]
        ours = summ.get(OURS)
        for col, (key, unit) in enumerate([("step_ms", "median step time (ms)"),
                                           ("peak_mib", "peak memory per rank (MiB)")]):
            ax = axes[row][col]
            vals = [summ[i][key] for i in impls]
            lo = [summ[i][key] - summ[i][key + "_min"] for i in impls]
            hi = [summ[i][key + "_max"] - summ[i][key] for i in impls]
            names = [LABEL[i] for i in impls]
            bars = ax.bar(names, vals, yerr=[lo, hi], capsize=3,
                          color=[colors[i] for i in impls])
            if key == "peak_mib":  # what each rank held before the model existed
                ax.bar(names, [summ[i]["start_mib"] for i in impls], color="white", alpha=0.45,
                       hatch="//", edgecolor="black", linewidth=0,
                       label="RSS before the model (torch + process group)")
                ax.legend(fontsize=7, loc="lower right")
            for b, i, h in zip(bars, impls, hi):
                txt = f"{summ[i][key]:.1f}" if key == "step_ms" else f"{summ[i][key]:.0f}"
                if ours and i != OURS:
                    txt += f"\nours/x {ours[key] / summ[i][key]:.2f}"
                ax.annotate(txt, (b.get_x() + b.get_width() / 2, b.get_height() + h),
                            ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                            textcoords="offset points")
            ax.set_ylabel(unit)
            ax.set_title(f"{name}: {unit.split(' (')[0]}", fontsize=10)
            ax.margins(y=0.25)
    m = results["meta"]
    fig.suptitle(f"fsdp_compose vs peers - {m['world']} rank(s) {m['backend']}, "
                 f"torch {m['torch']}, {m['repeats']} repeat(s) (bars: median, whiskers: min..max)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _progress(total: int):
    try:
        from tqdm import tqdm
        if not sys.stderr.isatty():
            return None, False
        return tqdm(total=total, unit="launch", dynamic_ncols=True, leave=False), True
    except ImportError:
        return None, False


def orchestrate(args) -> int:
    t_begin = time.monotonic()
    world = args.world_size
    impls = args.impls or [i for i in IMPLS if (i != "local" or world == 1)
                           and not (args.compile and i == "fsdp1")]
    if "local" in impls and world != 1:
        sys.exit("peers: 'local' (plain PyTorch, one process) needs --world-size 1")
    shapes = [SHAPES[s] for s in args.shape]
    os.makedirs(args.out, exist_ok=True)
    meta = {"world": world, "backend": "gloo", "threads": args.threads, "repeats": args.repeats,
            "torch": None, "python": platform.python_version(),
            "cpus": os.cpu_count(), "seed": args.seed, "lr": LR, "impls": impls,
            "compile": args.compile, "compile_backend": args.compile_backend}
    results = {"meta": meta, "shapes": {}}

    if args.profile:
        if args.profile == "local" and world != 1:
            sys.exit("peers: --profile local needs --world-size 1")
        return profile_only(args, shapes, world)

    settings = args.setting
    named = settings != ["fp32"]  # name the setting in the tables (not in the default run)
    meta["settings"] = settings
    plan = {st: [i for i in impls if st in SUPPORTED[i] and (i, st) not in CPU_UNSUPPORTED]
            for st in settings}
    for st in settings:
        skipped = [f"{LABEL[i]} ({CPU_UNSUPPORTED.get((i, st), 'no such setting')})"
                   for i in impls if i not in plan[st]]
        if skipped:
            print(f"setting '{st}': skipping {', '.join(skipped)}")
    failures = []  # with several settings, a failed launch drops that (setting, impl) only
    n_launch = len(shapes) * args.repeats * sum(len(v) for v in plan.values())
    bar, have_bar = _progress(n_launch)
    log = bar.write if have_bar else print
    reports, all_ok, rows = [], True, []
    for shape in shapes:
        steps = args.steps if args.steps is not None else shape.steps
        warmup = args.warmup if args.warmup is not None else shape.warmup
        raw: dict[str, dict[str, list]] = {st: {i: [] for i in plan[st]} for st in settings}
        for rep in range(args.repeats):
            for st in settings:  # alternate: A B C D A B C D ..., every setting per repeat
                for impl in plan[st]:
                    if (shape.name, st, impl) in {f[:3] for f in failures}:
                        continue
                    cfg = {"impl": impl, "shape": _shape_dict(shape), "setting": st,
                           "seed": args.seed, "steps": steps, "warmup": warmup,
                           "threads": args.threads, "pg_timeout": args.timeout,
                           "out": args.out, "compile": args.compile,
                           "compile_backend": args.compile_backend}
                    t0, t0_wall = time.monotonic(), time.time()
                    try:
                        ranks = launch(cfg, world, args.timeout)
                    except LaunchError as e:
                        if not named:
                            raise
                        failures.append((shape.name, st, impl, str(e)))
                        log(f"[{shape.name} {st} {rep + 1}/{args.repeats}] {LABEL[impl]:<13} "
                            f"FAILED (dropped from this setting): {str(e).splitlines()[0]}")
                        continue
                    meta["torch"] = meta["torch"] or ranks[0]["torch"]
                    L = summarise_launch(ranks)
                    startup = max(r["t_setup"] for r in ranks) - t0_wall
                    setup = max(r["t_setup_done"] - r["t_setup"] for r in ranks)
                    raw[st][impl].append({"summary": L, "ranks": ranks})
                    tag = f"{shape.name} {st}" if named else shape.name
                    log(f"[{tag} {rep + 1}/{args.repeats}] {LABEL[impl]:<13} "
                        f"{L['step_ms']:9.2f} ms/step  peak {L['peak_mib']:7.0f} MiB/rank  "
                        f"final loss {L['losses'][-1]:.6f}  ({time.monotonic() - t0:.1f} s: "
                        f"start {startup:.1f}, model+wrap {setup:.1f})")
                    if have_bar:
                        bar.update(1)
        for st in settings:
            failed = {f[2] for f in failures if f[:2] == (shape.name, st)}
            summary = {i: summarise_impl([x["summary"] for x in raw[st][i]])
                       for i in plan[st] if i not in failed}
            m = dict(meta, steps=steps, warmup=warmup)
            text, parity = shape_report(shape, summary, m, st if named else None)
            if failed:
                text += (f"\n   FAILED, no numbers: {', '.join(LABEL[i] for i in sorted(failed))}"
                         f" (errors at the end)")
            reports.append(text)
            all_ok &= parity.get("ok", True)
            rows.append((shape.name, st, summary, parity))
            results["shapes"][_run_key(shape.name, st)] = {
                "shape": _shape_dict(shape), "setting": st,
                "numel": shape.numel, "steps": steps, "warmup": warmup,
                "impls": summary, "parity": parity,
                "launches": {i: [x["ranks"] for x in raw[st][i]] for i in summary},
                "failed": sorted(failed),
            }
    if named:
        reports.append(settings_summary(rows, meta))
    if have_bar:
        bar.close()
    meta["runtime_s"] = time.monotonic() - t_begin
    print()
    print("\n\n".join(reports))
    name = "peers_compile" if args.compile else "peers"  # the eager results stay
    json_path = os.path.join(args.out, f"{name}.json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    png = plot(results, os.path.join(args.out, f"{name}.png"))
    print(f"\nwrote {json_path}" + (f" and {png}" if png else
                                    " (no plot: pip install matplotlib, or .[bench])"))
    print(f"total runtime {meta['runtime_s']:.0f} s")
    for shape_name, st, impl, err in failures:
        print(f"\nFAILED: {LABEL[impl]} on '{shape_name}', setting '{st}':\n{err}",
              file=sys.stderr)
    if failures:
        return 2
    if not all_ok:
        print("LOSS PARITY FAILED (fsdp_compose vs its reference), see above", file=sys.stderr)
        return 1
    return 0


def print_profile(rows: list, step_ms: float | None, top: int = 25) -> None:
    print(f"   {'label / op':<58} {'calls/step':>10} {'cpu ms/step':>12} {'self ms/step':>12}")
    for g in rows[:top]:
        print(f"   {g['name'][:58]:<58} {g['count']:>10.1f} {g['cpu_total_ms']:>12.2f} "
              f"{g['self_cpu_ms']:>12.2f}")


def profile_only(args, shapes: list, world: int) -> int:
    impl = args.profile
    settings = [st for st in args.setting if st in SUPPORTED[impl]]
    named = settings != ["fp32"]
    for shape, st in ((sh, st) for sh in shapes for st in settings):
        warmup = args.warmup if args.warmup is not None else shape.warmup
        cfg = {"impl": impl, "shape": _shape_dict(shape), "setting": st,
               "seed": args.seed, "steps": args.steps if args.steps is not None else 3,
               "warmup": warmup, "profile_steps": args.profile_steps, "threads": args.threads,
               "pg_timeout": args.timeout, "out": args.out, "compile": args.compile,
               "compile_backend": args.compile_backend}
        ranks = launch(cfg, world, args.timeout)
        L = summarise_launch(ranks)
        where = f"'{shape.name}', setting '{st}'" if named else f"'{shape.name}'"
        print(f"== profile {LABEL[impl]} on {where} ({world} rank(s)); unprofiled "
              f"step {L['step_ms']:.2f} ms; {args.profile_steps} profiled steps")
        print(f"   traces: {', '.join(r['trace'] for r in ranks)}")
        print("   rank 0, grouped by label (the unit FQN in '(...)' dropped), per step:")
        print_profile(ranks[0]["profile"], L["step_ms"])
        print()
    return 0


# ---------------------------------------------------------------- torchrun
def torchrun_main(args) -> int:
    import torch
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if args.profile:
        args.impls = [args.profile]
    if args.impls is None or len(args.impls) != 1:
        sys.exit("peers under torchrun: pass exactly one implementation, e.g. --impls fsdp_compose "
                 "(each implementation needs its own processes for a clean peak memory)")
    impl = args.impls[0]
    if impl == "local":
        sys.exit("peers under torchrun: 'local' is single-process; run it without torchrun")
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(args.threads)
        dist.init_process_group("gloo")
    backend = dist.get_backend()
    os.makedirs(args.out, exist_ok=True)
    mine = {"meta": {"world": world, "backend": backend, "threads": args.threads,
                     "repeats": args.repeats, "torch": torch.__version__,
                     "python": platform.python_version(), "seed": args.seed, "lr": LR,
                     "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                     else platform.processor(), "compile": args.compile,
                     "compile_backend": args.compile_backend},
            "impl": impl, "shapes": {}}
    tag = "torchrun_compile" if args.compile else "torchrun"  # compiled results apart
    settings = args.setting
    named = settings != ["fp32"]
    runs = [(SHAPES[n], st) for n in args.shape for st in settings]
    for shape, st in runs:
        if st not in SUPPORTED[impl]:
            continue
        steps = args.steps if args.steps is not None else shape.steps
        warmup = args.warmup if args.warmup is not None else shape.warmup
        cfg = {"impl": impl, "shape": _shape_dict(shape), "setting": st, "seed": args.seed,
               "steps": steps, "warmup": warmup, "out": args.out,
               "profile_steps": args.profile_steps if args.profile else 0,
               "compile": args.compile, "compile_backend": args.compile_backend}
        launches = []
        for _ in range(args.repeats):
            res = run_impl(cfg, rank, world, device)
            gathered = [None] * world
            dist.all_gather_object(gathered, res)
            launches.append(gathered)
            if args.profile and rank == 0:
                print(f"== profile {LABEL[impl]} on '{_run_key(shape.name, st)}': traces "
                      f"{', '.join(r['trace'] for r in gathered)}")
                print_profile(res["profile"], None)
                break
            if device.type == "cuda":
                torch.cuda.empty_cache()
        mine["shapes"][_run_key(shape.name, st)] = {"steps": steps, "warmup": warmup,
                                                    "launches": launches}
    dist.destroy_process_group()
    if rank != 0:
        return 0
    path = os.path.join(args.out, f"peers_{tag}_{impl}.json")
    with open(path, "w") as f:
        json.dump(mine, f)
    print(f"wrote {path}")
    # A table of every torchrun result in --out with the same settings.
    results = {"meta": dict(mine["meta"], impls=[]), "shapes": {}}
    reports, rows = [], []
    for shape, st in runs:
        key = _run_key(shape.name, st)
        if key not in mine["shapes"]:
            continue
        summary = {}
        for other in IMPLS:
            p = os.path.join(args.out, f"peers_{tag}_{other}.json")
            if not os.path.exists(p):
                continue
            with open(p) as f:
                d = json.load(f)
            s = d["shapes"].get(key)
            same = (d["meta"]["world"] == world and d["meta"]["backend"] == backend
                    and s and s["steps"] == mine["shapes"][key]["steps"]
                    and s["warmup"] == mine["shapes"][key]["warmup"])
            if same:
                summary[other] = summarise_impl([summarise_launch(L) for L in s["launches"]])
        m = dict(mine["meta"], **{k: mine["shapes"][key][k] for k in ("steps", "warmup")},
                 repeats=args.repeats)
        text, parity = shape_report(shape, summary, m, st if named else None)
        reports.append(text)
        rows.append((shape.name, st, summary, parity))
        results["meta"]["impls"] = sorted(set(results["meta"]["impls"]) | set(summary))
        results["shapes"][key] = {"setting": st, "impls": summary, "parity": parity}
    if named:
        reports.append(settings_summary(rows, results["meta"]))
    print("\n\n".join(reports))
    with open(os.path.join(args.out, f"peers_{tag}.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(args.out, f"peers_{tag}.png"))
    return 0


# ---------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.peers", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", nargs="+", choices=list(SHAPES), default=list(SHAPES),
                   help="which model shapes")
    p.add_argument("--world-size", type=int, default=2, help="gloo CPU ranks to spawn")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per launch (default per shape: "
                        + ", ".join(f"{s.name} {s.steps}" for s in SHAPES.values()) + ")")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps per launch (default per shape: "
                        + ", ".join(f"{s.name} {s.warmup}" for s in SHAPES.values()) + ")")
    p.add_argument("--repeats", type=int, default=3, help="launches per implementation")
    p.add_argument("--setting", nargs="+", choices=SETTINGS, default=["fp32"],
                   help="training settings, each applied to every implementation that has it; "
                        "several run in one invocation, launches alternating")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=None,
                   help="subset of implementations (default: all but 'local'; "
                        "'local' is added at --world-size 1)")
    p.add_argument("--out", default=DEFAULT_OUT, help="output folder (json, png, traces)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--seed", type=int, default=0, help="model init and data")
    p.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    p.add_argument("--profile", choices=IMPLS, default=None, metavar="IMPL",
                   help="instead of benchmarking: write a torch.profiler chrome trace of "
                        "--profile-steps steps of IMPL (after warmup) to --out, per rank")
    p.add_argument("--profile-steps", type=int, default=3, help="steps in the trace")
    p.add_argument("--compile", nargs="?", const="blocks", choices=list(COMPILE_WHAT),
                   default=None, help="compile every implementation the same way after "
                   "wrapping: each block (the default) or the whole model")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args._worker:
        _worker_entry(args._worker)
        return 0
    if min(args.world_size, args.repeats, args.threads) < 1 or \
            (args.steps is not None and args.steps < 1) or \
            (args.warmup is not None and args.warmup < 0):
        sys.exit("peers: --world-size, --repeats, --threads, --steps must be >= 1, --warmup >= 0")
    args.out = os.path.abspath(args.out)
    args.setting = list(dict.fromkeys(args.setting))  # in the order given, once each
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return torchrun_main(args)
    try:
        return orchestrate(args)
    except LaunchError as e:
        print(f"\npeers: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
