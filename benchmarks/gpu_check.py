"""Everything a first GPU run should check, in one command, results in one folder.

    python -m benchmarks.gpu_check --out DIR              # one NVIDIA GPU, < 8 minutes
    python -m benchmarks.gpu_check --out DIR --dry-run    # CPU: small models, fake-CUDA job

Parts, each in its own process under its own time limit (``LIMITS``), so a
hang or a crash in one cannot eat the others' time; ``DIR/gpu_check.json``
and ``DIR/gpu_check.md`` are rewritten as each part ends, and a part writes
its partial results as each of its own items ends:

``env``
    torch, CUDA and NCCL versions, the GPU, free and total memory.
``ws1``
    Real NCCL at world size 1 (the library issues no collectives there): the
    demo model and a Llama-like ~1B model, bf16 ``MixedPrecisionPolicy``
    (param bf16, reduce fp32), 20 steps, against plain PyTorch doing the same
    arithmetic (an fp32 master copy, a bf16 working copy, gradients cast to
    fp32, AdamW on the master): per-step loss parity (a check) and the
    step-time ratio (the goal is at most 1.03; reported, not a check).
``fake_pg``
    World sizes 2 and 8 simulated in this one process with torch's fake
    process group: collectives do no transfer (their outputs are whatever the
    buffers held), everything else is real: the stream manager, side
    streams, events, buckets, the caching allocator. fsdp_compose against
    ``torch.distributed.fsdp.fully_shard`` (FSDP2) on the same ~1B model,
    bf16: step time, tokens/s, peak ``max_memory_allocated`` and
    ``max_memory_reserved``, CPU time per step inside each library's hooks
    (its profiler labels), host synchronisations per step
    (``torch.cuda.set_sync_debug_mode``), and for ours the planner
    (``tools.plan``) next to what the run held, figure by figure (within 10%:
    reported). Under ``fake_pg["trace"]`` (its own process and limit): a
    Chrome trace of two steps with CPU offload (``DIR/gpu_check_trace.json.gz``)
    and the per-stream timeline (``DIR/gpu_check_streams.png``, needs
    matplotlib; skipped, and said so, without it).
``sanitizer``
    A short run under torch's CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``):
    fake world size 2 as HSDP (2, 1) and (1, 2), bf16, CPU offload, a block
    skipped on odd steps. Zero reports expected (a check); a report is
    written whole into the JSON and printed.

The exit status is 1 if a check failed (loss parity, sanitizer), else 2 if a
part did not finish (error or time limit), else 0. At most ``MAX_FILES``
files in DIR (listed under ``files``): the JSON (every figure, units in the
key names), the table, the log of every part, the trace and the PNG.

``--dry-run`` runs the same parts end to end on CPU with small models (a few
steps): gloo at world size 1, the fake process group on CPU, and the CUDA
job doubles of ``benchmarks._fake_cuda`` (a visible GPU as far as torch's
queries and backend strings go; side streams, events and host copies
recorded by ``StreamDouble``, so the stream manager runs its NCCL-path
protocol). No GPU figure there (memory is None, times are CPU times, host
syncs are the double's ``event.synchronize()`` calls, no sanitizer), the
same JSON keys; ``tests/test_gpu_check.py`` runs it so the script cannot rot
between GPU runs.

Runs on torch 2.11 (CUDA 13) and the project's torch, with nothing beyond
torch (matplotlib optional).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PARTS = ["env", "ws1", "fake_pg", "trace", "sanitizer", "scale"]
KEYS = ["env", "ws1", "fake_pg", "sanitizer", "scale", "files"]  # the JSON's (trace: under fake_pg)
# seconds per part (one H100: the whole run stays under 8 minutes even if every
# part hits its limit); the dry run's on a 2-core CPU
LIMITS = {"env": 30, "ws1": 120, "fake_pg": 150, "trace": 60, "sanitizer": 90, "scale": 120}
DRY_LIMITS = {"env": 60, "ws1": 90, "fake_pg": 120, "trace": 90, "sanitizer": 90, "scale": 120}
MAX_FILES = 8
FILES = {
    "gpu_check.json": "every figure (units in the key names)",
    "gpu_check.md": "the tables a person reads",
    "gpu_check.log": "each part's output, in order",
    "gpu_check_trace.json.gz": "Chrome trace of two steps (ui.perfetto.dev opens .json.gz)",
    "gpu_check_streams.png": "per-stream timeline of the traced steps (needs matplotlib)",
}
LR = 1e-3
BF16_RTOL = 1e-2        # ws1: largest relative per-step loss difference accepted
RATIO_GOAL = 1.03       # ws1: step time over plain PyTorch's (a goal, reported)
PLAN_TOLERANCE = 0.10   # fake_pg: planner vs measured (reported)
NO_TRANSFER = ("fake process group: collectives do no transfer and cost no time; "
               "their outputs are whatever the buffers held (losses are meaningless)")

# (dim, layers, vocab, heads, seq, batch): the GPU run's models and the dry run's
MODELS = {
    "demo": (128, 4, 128, 4, 256, 8),             # ModelArgs' defaults
    "llama": (2048, 18, 32000, 16, 1024, 4),   # Llama-like, ~0.97B parameters (tied embedding)
    "llama-offload": (1024, 8, 32000, 8, 1024, 2),  # 134M: offload row, trace
    "llama-sanitizer": (256, 3, 512, 4, 128, 2),
    "llama-scale": (1024, 8, 32000, 8, 256, 2),
}
DRY_MODELS = {
    "demo": (64, 2, 64, 2, 32, 2),
    "llama": (96, 2, 128, 3, 32, 2),
    "llama-offload": (64, 2, 128, 2, 32, 2),
    "llama-sanitizer": (64, 3, 64, 2, 16, 2),
    "llama-scale": (64, 2, 128, 2, 16, 2),
}
# scale: one simulated world size, uneven pieces forced on ours (the padded
# equal-size collectives), ours and FSDP2: host time per step
SCALE_WORLD = 1024
SCALE_WARMUP, SCALE_TIMED = 2, 6
DRY_SCALE_WARMUP, DRY_SCALE_TIMED = 1, 2
# steps: (ws1 total, of which untimed first) and fake_pg's
WS1_STEPS, WS1_WARMUP = 20, 4
FAKE_WARMUP, FAKE_TIMED = 2, 8
DRY_WS1_STEPS, DRY_WS1_WARMUP = 3, 1
DRY_FAKE_WARMUP, DRY_FAKE_TIMED = 1, 2
# fake_pg rows: (key, world size, model, CPU offload)
FAKE_RUNS = [("2", 2, "llama", False), ("8", 8, "llama", False),
             ("2+offload", 2, "llama-offload", True)]


# =============================================================================
# Models (importable by tools.plan: "benchmarks.gpu_check:llama(...)")
# =============================================================================
def llama(dim: int, layers: int, vocab: int, heads: int, seq: int):
    """The demo's Llama-style Transformer (fsdp_compose.demo.model) of that size."""
    from fsdp_compose.demo.model import ModelArgs, Transformer
    return Transformer(ModelArgs(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads,
                                 max_seq_len=seq))


def skipping_llama(dim: int, layers: int, vocab: int, heads: int, seq: int):
    """``llama`` whose forward skips the blocks in ``model.skip`` (a set of indices)."""
    from fsdp_compose.demo.model import ModelArgs, Transformer

    class Skipping(Transformer):
        skip: frozenset = frozenset()

        def forward(self, tokens):
            s = tokens.shape[1]
            h = self.tok_embeddings(tokens)
            cos, sin = self.rope_cos[:s], self.rope_sin[:s]
            for i, layer in enumerate(self.layers):
                if i not in self.skip:
                    h = layer(h, cos, sin)
            return self.output(self.norm(h))

    return Skipping(ModelArgs(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads,
                              max_seq_len=seq))


def _spec(name: str, models: dict) -> str:
    dim, layers, vocab, heads, seq, _ = models[name]
    return f"benchmarks.gpu_check:llama({dim}, {layers}, {vocab}, {heads}, {seq})"


# =============================================================================
# The machine: a GPU, or the dry run's CUDA job doubles on CPU
# =============================================================================
class Gpu:
    """One CUDA device, for real."""

    dry = False
    mesh_type = "cuda"
    ws1_backend = "nccl"

    def __init__(self):
        import torch
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA device (use --dry-run on a CPU machine)")
        self.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(self.device)

    def job(self):
        return contextlib.nullcontext()

    def sync(self):
        import torch
        torch.cuda.synchronize()

    def timed(self):
        """A step timer: ``with t: step()`` per step, then ``t.ms()``."""
        return _CudaTimer()

    def reset_memory(self):
        import torch
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    def memory(self) -> dict:
        import torch
        return {"max_memory_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
                "max_memory_reserved_mib": torch.cuda.max_memory_reserved() / 2**20}

    def count_syncs(self, fn) -> tuple[int, str, list]:
        """Host synchronisations while ``fn()`` runs, how they were counted,
        and where each came from (the innermost frame of a library or of
        this script, as ``file:line function``)."""
        import traceback
        import warnings

        import torch
        torch.cuda.synchronize()
        sites, armed = [], []

        def show(message, category, filename, lineno, file=None, line=None):
            # (not before fn(): switching the mode on warns once per process,
            # which counted as a sync of the part's first run)
            if "synchroniz" not in str(message) or not armed:
                return
            ours = [f for f in traceback.extract_stack()[:-1]
                    if any(k in f.filename for k in ("fsdp_compose", "benchmarks",
                                                     "_fully_shard", "torch/optim"))]
            f = ours[-1] if ours else None
            sites.append(f"{'/'.join(f.filename.rsplit('/', 2)[-2:])}:{f.lineno} {f.name}" if f
                         else f"{filename}:{lineno}")

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            armed.append(True)
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return len(sites), "torch.cuda.set_sync_debug_mode('warn') warnings", sites

    def activities(self):
        from torch.profiler import ProfilerActivity
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]


class _CudaTimer:
    def __init__(self):
        self.pairs, self._start = [], None

    def __enter__(self):
        import torch
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def __exit__(self, *exc):
        import torch
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pairs.append((self._start, end))

    def ms(self) -> list[float]:
        import torch
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in self.pairs]


class _CpuTimer:
    def __init__(self):
        self.times, self._start = [], 0.0

    def __enter__(self):
        self._start = time.perf_counter()

    def __exit__(self, *exc):
        self.times.append(1e3 * (time.perf_counter() - self._start))

    def ms(self) -> list[float]:
        return list(self.times)


class DryRun:
    """The CPU stand-in (see the module doc): tensors on CPU, every stream
    manager on a ``StreamDouble``, torch's CUDA queries answered by ``CudaJob``."""

    dry = True
    mesh_type = "cpu"
    ws1_backend = "gloo"

    def __init__(self):
        import torch
        torch.set_num_threads(1)
        self.device = torch.device("cpu")
        self.doubles: list = []

    def _runtime(self, device):
        from benchmarks._fake_cuda import StreamDouble
        d = StreamDouble()
        self.doubles.append(d)
        return d

    @contextlib.contextmanager
    def job(self):
        from benchmarks._fake_cuda import CudaJob
        from fsdp_compose._comm import _streams
        with CudaJob().active(), _streams.runtime_factory(self._runtime):
            yield

    def sync(self):
        pass

    def timed(self):
        return _CpuTimer()

    def reset_memory(self):
        gc.collect()

    def memory(self) -> dict:
        return {"max_memory_allocated_mib": None, "max_memory_reserved_mib": None}

    def _syncs(self) -> int:
        return sum(1 for d in self.doubles for e in d.log if e[0] == "sync")

    def count_syncs(self, fn) -> tuple[int, str, list]:
        before = self._syncs()
        fn()
        return (self._syncs() - before,
                "event.synchronize() calls on the stream double (dry run)", [])

    def activities(self):
        from torch.profiler import ProfilerActivity
        return [ProfilerActivity.CPU]


# =============================================================================
# Training pieces shared by the parts
# =============================================================================
def _batches(vocab: int, batch: int, seq: int, n: int, device, seed: int = 0) -> list:
    import torch
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((t[:, :-1].to(device), t[:, 1:].to(device)))
    return out


def _loss(model, x, y):
    import torch.nn.functional as F
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


class Sharded:
    """A model sharded by ``fully_shard`` (ours or FSDP2's): each block, then
    the root, bf16 parameters and fp32 reduction (``offload``: CPU offload)."""

    def __init__(self, impl: str, model, mesh, offload: bool = False, pin: bool = True,
                 plan_cfg=None):
        import torch
        if impl == "fsdp_compose":
            from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        else:
            from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy,
                                                fully_shard)
        self.model = model
        if plan_cfg is not None:  # ours, as tools.plan shards it (the same settings)
            from tools.plan import select_blocks, shard
            shard(model, select_blocks(model, ()), plan_cfg, mesh)
        else:
            kw = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.float32)}
            if offload:
                kw["offload_policy"] = CPUOffloadPolicy(pin_memory=pin)
            for block in model.layers:
                fully_shard(block, **kw)
            fully_shard(model, **kw)
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(self, x, y):
        loss = _loss(self.model, x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


class MasterWeights:
    """Plain PyTorch doing what bf16 ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)`` does at world size 1: fp32 master parameters, a bf16
    working copy refreshed from them every step, gradients cast to fp32,
    AdamW on the master."""

    def __init__(self, model):
        import torch
        self.master = model
        self.work = copy.deepcopy(model).to(torch.bfloat16)
        self.pairs = list(zip(model.parameters(), self.work.parameters()))
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(self, x, y):
        import torch
        with torch.no_grad():
            for m, w in self.pairs:
                w.copy_(m)
        loss = _loss(self.work, x, y)
        loss.backward()
        for m, w in self.pairs:
            m.grad, w.grad = w.grad.float(), None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _label_ms(prof, prefixes: tuple, steps: int) -> float:
    """CPU ms per step inside profiler labels starting with ``prefixes``
    (nested labels counted once: the union of their intervals, per thread)."""
    from torch.autograd import DeviceType
    by_thread: dict = {}
    for e in prof.events():  # (a CUDA profile mirrors labels on the device: not CPU time)
        if e.name.startswith(prefixes) and e.device_type == DeviceType.CPU:
            by_thread.setdefault(e.thread, []).append((e.time_range.start, e.time_range.end))
    total = 0.0
    for ivs in by_thread.values():
        end = float("-inf")
        for a, b in sorted(ivs):
            if b > end:
                total += b - max(a, end)
                end = b
    return total / 1e3 / max(steps, 1)


HOOK_LABELS = {"fsdp_compose": ("fsdp_compose::",), "fsdp2": ("FSDP::",)}


@contextlib.contextmanager
def _fake_world(world: int):
    """torch's fake process group as rank 0 of ``world`` for the block: a job
    of its own (the groups fully_shard makes for it are its, fsdp_compose/_base/_job.py)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


# =============================================================================
# Parts (each runs in its own process: ``--part NAME``)
# =============================================================================
class Result:
    """A part's result dict, written to ``path`` (atomically) at every update."""

    def __init__(self, path: str):
        self.path, self.data = path, {}

    def set(self, key: str, value) -> None:
        self.data[key] = value
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.set("checks", self.data.get("checks", []) + [
            {"name": name, "ok": bool(ok), "detail": detail}])


def part_env(mach, res: Result, args) -> None:
    import platform

    import torch
    res.set("torch", torch.__version__)
    res.set("python", platform.python_version())
    res.set("dry_run", mach.dry)
    res.set("cuda", torch.version.cuda)
    if mach.dry:
        res.set("note", "dry run: CPU, small models; no GPU figure is real")
        res.set("gpu", None)
        return
    try:
        v = torch.cuda.nccl.version()  # (major, minor, patch[, suffix]); an int on old torch
        res.set("nccl", ".".join(map(str, v)) if isinstance(v, tuple) else str(v))
    except Exception as e:  # noqa: BLE001 - a build without NCCL: say so, go on
        res.set("nccl", f"unknown ({type(e).__name__}: {e})")
    props = torch.cuda.get_device_properties(mach.device)
    free, total = torch.cuda.mem_get_info(mach.device)
    res.set("gpu", {"name": props.name, "capability": f"{props.major}.{props.minor}",
                    "multiprocessors": props.multi_processor_count,
                    "free_mib": free / 2**20, "total_mib": total / 2**20,
                    "count": torch.cuda.device_count()})
    res.set("cudnn", torch.backends.cudnn.version())
    res.set("bf16_supported", torch.cuda.is_bf16_supported())


def part_ws1(mach, res: Result, args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    models = DRY_MODELS if mach.dry else MODELS
    steps, warmup = (DRY_WS1_STEPS, DRY_WS1_WARMUP) if mach.dry else (WS1_STEPS, WS1_WARMUP)
    res.set("what", f"world size 1 on {mach.ws1_backend} (the library issues no collectives "
                    "at world size 1), bf16 MixedPrecisionPolicy(param bf16, reduce fp32), "
                    f"{steps} steps; plain PyTorch: fp32 master + bf16 working copy, the same "
                    f"arithmetic; step times: median of steps {warmup + 1}..{steps}")
    dist.init_process_group(mach.ws1_backend, store=dist.HashStore(), rank=0, world_size=1)
    out = {}
    try:
        t = torch.ones(4, device=mach.device)
        dist.all_reduce(t)  # the backend itself works (the library will not call it)
        mach.sync()
        res.set("backend", {"name": dist.get_backend(), "all_reduce_ok": t.sum().item() == 4})
        for name in ("demo", "llama"):
            dim, layers, vocab, heads, seq, batch = models[name]
            data = _batches(vocab, batch, seq, steps, mach.device)
            row = {"dim": dim, "layers": layers, "vocab": vocab, "seq": seq, "batch": batch}
            for impl in ("plain", "fsdp_compose"):
                mach.reset_memory()
                torch.manual_seed(0)
                with torch.device(mach.device):
                    model = llama(dim, layers, vocab, heads, seq)
                row["params"] = _numel(model)
                with mach.job():
                    if impl == "plain":
                        runner = MasterWeights(model)
                    else:
                        runner = Sharded(impl, model, init_device_mesh(mach.mesh_type, (1,)))
                    timer, losses = mach.timed(), []
                    for i, (x, y) in enumerate(data):
                        if i < warmup:
                            losses.append(runner.step(x, y))
                        else:
                            with timer:
                                losses.append(runner.step(x, y))
                    ms = timer.ms()
                row[impl] = {"losses": [float(v) for v in losses], "step_ms": _median(ms),
                             "tokens_per_s": batch * seq / (_median(ms) / 1e3),
                             **mach.memory()}
                del runner, model
            a, b = row["fsdp_compose"]["losses"], row["plain"]["losses"]
            diff = max(abs(p - q) / max(abs(q), 1e-12) for p, q in zip(a, b))
            row["loss_max_rel_diff"] = diff
            row["step_time_ratio"] = row["fsdp_compose"]["step_ms"] / row["plain"]["step_ms"]
            row["ratio_goal"] = RATIO_GOAL
            row["ratio_within_goal"] = row["step_time_ratio"] <= RATIO_GOAL
            out[name] = row
            res.set("models", out)
            res.check(f"ws1 loss parity {name}", diff <= BF16_RTOL,
                      f"max relative per-step loss difference {diff:.2e} (tolerance {BF16_RTOL})")
    finally:
        dist.destroy_process_group()


def _measured_plan(units, model, opt, data) -> dict:
    """tools.plan's figures, read off two more steps of ours (tools._measure's
    Tracker at every schedule event; comm_stats of the last step)."""
    import torch

    from fsdp_compose import comm_stats, reset_comm_stats
    from tools._measure import Tracker, _storage_bytes
    out = {}
    with Tracker(units) as tracker:
        for i, (x, y) in enumerate(data):
            if i == len(data) - 1:
                reset_comm_stats()
            _loss(model, x, y).backward()
            if i == len(data) - 1:
                out["grad_bytes"] = _storage_bytes(p.grad for p in model.parameters()
                                                   if p.grad is not None)
            opt.step()
            opt.zero_grad(set_to_none=True)
    c = comm_stats()
    groups = [g for u in units for g in u.groups]
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    out.update(param_bytes=_storage_bytes(g.shard for g in groups),
               optim_bytes=_storage_bytes(state),
               unsharded_forward_peak_bytes=tracker.peak["forward"],
               unsharded_backward_peak_bytes=tracker.peak["backward"],
               all_gather_bytes=c.all_gather_bytes, all_gather_calls=c.all_gather_calls,
               reduce_scatter_bytes=c.reduce_scatter_bytes,
               reduce_scatter_calls=c.reduce_scatter_calls,
               all_reduce_bytes=c.all_reduce_bytes, all_reduce_calls=c.all_reduce_calls)
    return out


def _fake_run(mach, impl: str, world: int, name: str, models: dict, warmup: int, timed: int,
              plan_cfg=None, offload: bool = False) -> dict:
    """One implementation at fake world size ``world`` (the fake group is up)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import profile
    dim, layers, vocab, heads, seq, batch = models[name]
    n = warmup + timed + 1 + 2 + 2
    data = _batches(vocab, batch, seq, n, mach.device)
    mach.reset_memory()
    torch.manual_seed(0)
    with mach.job():
        with torch.device(mach.device):
            model = llama(dim, layers, vocab, heads, seq)
        runner = Sharded(impl, model, init_device_mesh(mach.mesh_type, (world,)),
                         offload=offload, plan_cfg=plan_cfg)
        it = iter(data)
        for _ in range(warmup):
            runner.step(*next(it))
        mach.sync()
        mach.reset_memory()
        timer = mach.timed()
        for _ in range(timed):
            with timer:
                runner.step(*next(it))
        ms = timer.ms()
        row = {"step_ms": _median(ms), "step_ms_each": ms,
               "tokens_per_s": batch * seq / (_median(ms) / 1e3), **mach.memory()}
        syncs, how, sites = mach.count_syncs(lambda: runner.step(*next(it)))  # noqa: F821 (del below)
        row["host_syncs_per_step"], row["host_syncs_counted_by"] = syncs, how
        row["host_sync_sites"] = sites
        with profile(activities=[mach.activities()[0]]) as prof:  # CPU only: the hooks
            for _ in range(2):
                runner.step(*next(it))
            mach.sync()
        row["hook_cpu_ms_per_step"] = _label_ms(prof, HOOK_LABELS[impl], 2)
        row["hook_labels"] = f"{HOOK_LABELS[impl][0]}* (union per thread, under the profiler)"
        if plan_cfg is not None:
            from fsdp_compose._base._registry import unit_of
            units = [unit_of(model)] + [unit_of(b) for b in model.layers]
            row["measured_plan"] = _measured_plan(units, model, runner.opt,
                                                  [next(it), next(it)])
        del runner, model
    return row


def part_fake_pg(mach, res: Result, args) -> None:
    from tools.plan import (FIGURES, PlanConfig, compare, plan_world, predicted_for_rank,
                            rel_diff)
    models = DRY_MODELS if mach.dry else MODELS
    warmup, timed = (DRY_FAKE_WARMUP, DRY_FAKE_TIMED) if mach.dry else (FAKE_WARMUP, FAKE_TIMED)
    res.set("note", NO_TRANSFER)
    res.set("what", "bf16 MixedPrecisionPolicy(param bf16, reduce fp32), AdamW; rank 0 of N "
                    f"simulated; {warmup} untimed step(s), median of {timed} timed; memory peaks "
                    "over the timed steps; tokens/s per simulated rank; each row's model under "
                    "'model'")
    worlds = {}
    for key, world, name, offload in FAKE_RUNS:
        dim, layers, vocab, heads, seq, batch = models[name]
        cfg = PlanConfig(model=_spec(name, models), mp="bf16", offload=offload, schedule="cuda")
        wp = plan_world(cfg, world)  # (its own fake group, gone again)
        row = worlds[key] = {
            "note": NO_TRANSFER, "world_size": world, "offload": offload,
            "model": f"{name}: dim {dim}, {layers} layers, vocab {vocab}, batch {batch} x seq "
                     f"{seq}, {wp.row['params'] / 1e6:,.1f}M parameters"
                     + (", CPUOffloadPolicy(pin_memory=True)" if offload else "")}
        with _fake_world(world):
            for impl in ("fsdp_compose", "fsdp2"):
                try:
                    row[impl] = _fake_run(mach, impl, world, name, models, warmup, timed,
                                          plan_cfg=cfg if impl == "fsdp_compose" else None,
                                          offload=offload)
                except Exception:  # noqa: BLE001 - the other implementation still runs
                    row[impl] = {"error": traceback.format_exc()}
                res.set("world_sizes", worlds)
        ours = row.get("fsdp_compose", {})
        if "measured_plan" in ours:
            measured = ours.pop("measured_plan")
            _, worst = compare(wp, [measured])
            pred = predicted_for_rank(wp, 0)
            state = 0 if offload else pred["param_bytes"] + pred["grad_bytes"] + pred["optim_bytes"]
            peak = max(pred["unsharded_forward_peak_bytes"], pred["unsharded_backward_peak_bytes"])
            row["planner"] = {
                "figures": {k: {"predicted": pred[k], "measured": measured[k],
                                "rel_diff": rel_diff(pred[k], measured[k])} for k in FIGURES},
                "worst_rel_diff": worst, "within_10pct": worst <= PLAN_TOLERANCE,
                "predicted_device_state_plus_unsharded_peak_mib": (state + peak) / 2**20,
                "max_memory_allocated_mib": ours.get("max_memory_allocated_mib"),
                "note": "figures: the planner's own quantities, sampled at every schedule "
                        "event of two steps (tools._measure.Tracker); max_memory_allocated "
                        "also holds activations and autograd temporaries, which the planner "
                        "does not model" + (" (offload: shards, gradients and optimizer "
                                            "state are in host memory)" if offload else "")}
        for impl in ("fsdp_compose", "fsdp2"):
            if "error" in row.get(impl, {}):
                res.check(f"fake_pg {key} {impl} runs", False,
                          row[impl]["error"].strip().splitlines()[-1])
        res.set("world_sizes", worlds)


def part_trace(mach, res: Result, args) -> None:
    import gzip
    import shutil

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import profile, record_function

    from tools import timeline
    models = DRY_MODELS if mach.dry else MODELS
    name, world = "llama-offload", 2
    dim, layers, vocab, heads, seq, batch = models[name]
    res.set("what", f"{name} (dim {dim}, {layers} layers, vocab {vocab}), fake world size "
                    f"{world}, bf16 + CPUOffloadPolicy(pin_memory=True): two profiled steps "
                    "after two untimed ones. " + NO_TRANSFER)
    data = _batches(vocab, batch, seq, 4, mach.device)
    with _fake_world(world), mach.job():
        torch.manual_seed(0)
        with torch.device(mach.device):
            model = llama(dim, layers, vocab, heads, seq)
        runner = Sharded("fsdp_compose", model, init_device_mesh(mach.mesh_type, (world,)),
                         offload=True)
        for x, y in data[:2]:
            runner.step(x, y)
        mach.sync()
        with profile(activities=mach.activities()) as prof:
            for i, (x, y) in enumerate(data[2:]):
                with record_function(f"train_step {i}"):
                    runner.step(x, y)
            mach.sync()
    out = args.out
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        path = os.path.join(out, "gpu_check_trace.json.gz")
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    res.set("trace", os.path.basename(path))
    res.set("hook_cpu_ms_per_step", _label_ms(prof, HOOK_LABELS["fsdp_compose"], 2))
    spans = timeline.stream_spans(path)
    res.set("streams", {k: {"busy_ms": timeline._union_len(v) / 1e3,
                            "events": spans["kinds"].get(k, {})}
                        for k, v in spans["streams"].items()})
    res.set("side_stream_overlap", {k: {"busy_ms": ms, "share_under_compute": share}
                                    for k, (ms, share) in timeline.stream_overlap(spans).items()})
    if not spans["streams"]:
        res.set("png", None)
        res.set("png_skipped", "no device events in the trace (CPU profile)")
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        res.set("png", None)
        res.set("png_skipped", "matplotlib is not installed")
        return
    png = timeline.plot_streams(spans, f"fsdp_compose, {name}, fake world size {world}, "
                                       "bf16 + CPU offload: CUDA streams of two steps "
                                       "(collectives do no transfer)",
                                os.path.join(out, "gpu_check_streams.png"))
    res.set("png", os.path.basename(png))


def _sanitizer_errors(e: BaseException):
    """The sanitizer's ``CUDASanitizerErrors`` (its ``errors`` list; an
    empty one if only its message survived), if ``e`` is or wraps one."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ == "CUDASanitizerErrors":
            return e if hasattr(e, "errors") else _Found([])
        if "CUDASanitizerErrors" in str(e):  # re-raised by autograd's engine as another type
            return _Found([])
        e = e.__cause__ or e.__context__
    return None


class _Found:
    def __init__(self, errors):
        self.errors = errors


def part_sanitizer(mach, res: Result, args) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    models = DRY_MODELS if mach.dry else MODELS
    dim, layers, vocab, heads, seq, batch = models["llama-sanitizer"]
    enabled = "TORCH_CUDA_SANITIZER" in os.environ and not mach.dry
    res.set("enabled", enabled)
    res.set("what", f"fake world size 2 as HSDP (2, 1) and (1, 2), bf16 MixedPrecisionPolicy, "
                    f"CPUOffloadPolicy(pin_memory=True), layers.1 skipped on odd steps, "
                    f"4 steps each (dim {dim}, {layers} layers)"
                    + ("" if enabled else "; dry run: no sanitizer on CPU, the same steps run"))
    res.set("what", res.data["what"] + "; then fake world size 8, uneven pieces forced (the "
                                       "padded equal-size collectives and their staging "
                                       "copies), bf16")
    reports, runs = [], {}
    for shape in ((2, 1), (1, 2), (8,)):
        key = "x".join(map(str, shape)) if len(shape) == 2 else f"padded{shape[0]}"
        data = _batches(vocab, batch, seq, 4, mach.device)
        with _fake_world(math.prod(shape)), mach.job():
            torch.manual_seed(0)
            with torch.device(mach.device):
                model = skipping_llama(dim, layers, vocab, heads, seq)
            if len(shape) == 2:
                mesh = init_device_mesh(mach.mesh_type, shape, mesh_dim_names=("rep", "shard"))
                runner = Sharded("fsdp_compose", model, mesh, offload=True)
            else:
                from tools.plan import PlanConfig
                mesh = init_device_mesh(mach.mesh_type, shape)
                runner = Sharded("fsdp_compose", model, mesh, plan_cfg=PlanConfig(
                    model="-", mp="bf16", row_layout="uneven", schedule="cuda"))
            done = 0
            try:
                for i, (x, y) in enumerate(data):
                    model.skip = frozenset({1}) if i % 2 else frozenset()
                    runner.step(x, y)
                    done += 1
                mach.sync()
            except Exception as e:  # noqa: BLE001
                found = _sanitizer_errors(e)
                if found is None:
                    raise
                text = ("\n\n".join(str(err) for err in found.errors) if found.errors else
                        traceback.format_exc() + "\n(the sanitizer printed each error to "
                        "stderr: see gpu_check.log)")
                reports.append({"mesh": key, "step": done, "report": text})
                print(f"CUDA sanitizer report (mesh {key}, step {done}):\n{text}", flush=True)
            runs[key] = {"steps_done": done}
            del runner, model
        res.set("runs", runs)
        res.set("reports", reports)
    res.check("sanitizer reports", not reports,
              f"{len(reports)} report(s)" if enabled else
              "0 (not enabled: dry run; the same steps ran)")


def part_scale(mach, res: Result, args) -> None:
    """Fake world size ``SCALE_WORLD``, rank 0: ours with every row layout
    forced to uneven pieces (each all-gather and reduce-scatter the padded
    equal-size one, [Note: padded collectives] in fsdp_compose/_comm/_collectives.py)
    and FSDP2, alternating; the host (CPU) time of the thread that issues a
    step, and ours' collectives per step against the planner's."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compose import comm_stats, reset_comm_stats
    from tools.plan import PlanConfig, plan_world
    models = DRY_MODELS if mach.dry else MODELS
    name, world = "llama-scale", SCALE_WORLD
    warmup, timed = (DRY_SCALE_WARMUP, DRY_SCALE_TIMED) if mach.dry else (SCALE_WARMUP,
                                                                          SCALE_TIMED)
    dim, layers, vocab, heads, seq, batch = models[name]
    cfg = PlanConfig(model=_spec(name, models), mp="bf16", row_layout="uneven", schedule="cuda")
    wp = plan_world(cfg, world)  # (its own fake group, gone again)
    res.set("what", f"{name} (dim {dim}, {layers} layers, vocab {vocab}, batch {batch} x seq "
                    f"{seq}), fake world size {world}, rank 0, bf16 MixedPrecisionPolicy; ours "
                    f"with uneven pieces forced; {warmup} untimed step(s), median of {timed}; "
                    "host = CPU time of the issuing thread. " + NO_TRANSFER)
    res.set("planner", {k: wp.row[k] for k in (
        "all_gather_calls", "reduce_scatter_calls", "all_reduce_calls", "all_gather_bytes",
        "reduce_scatter_bytes", "nccl_ops", "nccl_ops_list_forms", "uneven_groups")})
    data = _batches(vocab, batch, seq, warmup + timed + 1, mach.device)
    rows = {}
    with _fake_world(world):
        for impl in ("fsdp_compose", "fsdp2"):
            try:
                with mach.job():
                    torch.manual_seed(0)
                    with torch.device(mach.device):
                        model = llama(dim, layers, vocab, heads, seq)
                    mesh = init_device_mesh(mach.mesh_type, (world,))
                    runner = Sharded(impl, model, mesh,
                                     plan_cfg=cfg if impl == "fsdp_compose" else None)
                    it = iter(data)
                    for _ in range(warmup):
                        runner.step(*next(it))
                    mach.sync()
                    host, wall = [], []
                    for _ in range(timed):
                        t0, c0 = time.perf_counter(), time.thread_time()
                        runner.step(*next(it))
                        host.append(1e3 * (time.thread_time() - c0))
                        mach.sync()
                        wall.append(1e3 * (time.perf_counter() - t0))
                    row = {"host_ms": _median(host), "host_ms_each": host,
                           "wall_ms": _median(wall)}
                    if impl == "fsdp_compose":
                        reset_comm_stats()
                        runner.step(*next(it))
                        mach.sync()
                        c = comm_stats()
                        row["collectives"] = {
                            k: getattr(c, k) for k in ("all_gather_calls",
                                                       "reduce_scatter_calls",
                                                       "all_reduce_calls", "all_gather_bytes",
                                                       "reduce_scatter_bytes")}
                        from fsdp_compose._base._registry import unit_of
                        groups = [g for m in [model, *model.layers]
                                  for g in unit_of(m).groups]
                        row["padded_groups"] = sum(g.padded() for g in groups)
                    rows[impl] = row
                    del runner, model
            except Exception:  # noqa: BLE001 - the other implementation still runs
                rows[impl] = {"error": traceback.format_exc()}
            res.set("runs", rows)
    ours, f2 = rows.get("fsdp_compose", {}), rows.get("fsdp2", {})
    for impl, row in rows.items():
        if "error" in row:
            res.check(f"scale {impl} runs", False, row["error"].strip().splitlines()[-1])
    if "collectives" in ours:
        same = all(ours["collectives"][k] == wp.row[k] for k in ours["collectives"])
        res.check("scale: collectives per step = the planner's", same,
                  f"{ours['collectives']} vs planner {res.data['planner']}")
        res.check("scale: padded groups", ours["padded_groups"] > 0,
                  f"{ours['padded_groups']} groups take the padded collectives")
    if "host_ms" in ours and "host_ms" in f2:
        res.set("host_ratio_ours_over_fsdp2", ours["host_ms"] / f2["host_ms"])


PART_FNS = {"env": part_env, "ws1": part_ws1, "fake_pg": part_fake_pg, "trace": part_trace,
            "sanitizer": part_sanitizer, "scale": part_scale}


def run_part(args) -> int:
    """Child side: one part, its result in ``args.result``."""
    res = Result(args.result)
    t0 = time.perf_counter()
    mach = DryRun() if args.dry_run else Gpu()
    try:
        PART_FNS[args.part](mach, res, args)
    except BaseException:
        res.set("error", traceback.format_exc())
        traceback.print_exc()
        return 1
    finally:
        res.set("seconds", time.perf_counter() - t0)
    return 0


# =============================================================================
# Orchestrator (parent): no torch import
# =============================================================================
def _status(part: dict) -> str:
    return part.get("part", {}).get("status", "not run")


def _failed_checks(report: dict) -> list[dict]:
    out = []
    for key in ("env", "ws1", "fake_pg", "sanitizer"):
        sec = report.get(key) or {}
        out += [c for c in sec.get("checks", []) if not c["ok"]]
        out += [c for c in (sec.get("trace") or {}).get("checks", []) if not c["ok"]]
    return out


def _fmt(v, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return str(v)


def render_md(report: dict, dry: bool) -> str:
    """The tables a person reads (every figure is also in the JSON)."""
    env = report.get("env") or {}
    gpu = env.get("gpu") or {}
    lines = [f"# GPU check{' (dry run: CPU, small models, no GPU figure is real)' if dry else ''}",
             "", f"torch {env.get('torch', '?')}, CUDA {env.get('cuda')}, NCCL {env.get('nccl')}, "
             f"GPU {gpu.get('name', '-')} ({_fmt(gpu.get('free_mib'), 0)} of "
             f"{_fmt(gpu.get('total_mib'), 0)} MiB free)", "",
             "| part | status | seconds | limit s |",
             "|---|---|---|---|"]
    for key in PARTS:
        sec = report.get(key) if key != "trace" else (report.get("fake_pg") or {}).get("trace")
        p = (sec or {}).get("part", {})
        lines.append(f"| {key} | {p.get('status', 'not run')} | {_fmt(p.get('seconds'))} | "
                     f"{p.get('limit_s', '-')} |")
    failed = _failed_checks(report)
    lines += ["", "Checks: " + ("all passed" if not failed else
                                "FAILED: " + "; ".join(f"{c['name']}: {c['detail']}"
                                                        for c in failed))]
    ws1 = (report.get("ws1") or {}).get("models") or {}
    if ws1:
        lines += ["", "## World size 1 (bf16), ours vs plain PyTorch", "",
                  (report.get("ws1") or {}).get("what", ""), "",
                  "| model | params | step ms ours | step ms plain | ratio (goal <= 1.03) | "
                  "tokens/s ours | max alloc MiB ours / plain | loss max rel diff |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, r in ws1.items():
            o, p = r.get("fsdp_compose", {}), r.get("plain", {})
            lines.append(
                f"| {name} | {r.get('params', 0) / 1e6:,.1f}M | {_fmt(o.get('step_ms'), 2)} | "
                f"{_fmt(p.get('step_ms'), 2)} | {_fmt(r.get('step_time_ratio'), 3)} | "
                f"{_fmt(o.get('tokens_per_s'), 0)} | {_fmt(o.get('max_memory_allocated_mib'), 0)}"
                f" / {_fmt(p.get('max_memory_allocated_mib'), 0)} | "
                f"{_fmt(r.get('loss_max_rel_diff'), 6)} |")
    fake = report.get("fake_pg") or {}
    worlds = fake.get("world_sizes") or {}
    if worlds:
        lines += ["", "## Simulated ranks (fake process group), ours vs FSDP2", "",
                  f"**{NO_TRANSFER}.** {fake.get('what', '')}", "",
                  "| world | impl | step ms | tokens/s | max alloc MiB | max reserved MiB | "
                  "hook CPU ms/step | host syncs/step |", "|---|---|---|---|---|---|---|---|"]
        for world, row in worlds.items():
            for impl in ("fsdp_compose", "fsdp2"):
                r = row.get(impl) or {}
                if "error" in r:
                    lines.append(f"| {world} | {impl} | error: "
                                 f"{r['error'].strip().splitlines()[-1][:120]} |||||")
                    continue
                lines.append(
                    f"| {world} | {impl} | {_fmt(r.get('step_ms'), 2)} | "
                    f"{_fmt(r.get('tokens_per_s'), 0)} | "
                    f"{_fmt(r.get('max_memory_allocated_mib'), 0)}"
                    f" | {_fmt(r.get('max_memory_reserved_mib'), 0)} | "
                    f"{_fmt(r.get('hook_cpu_ms_per_step'), 2)} | "
                    f"{_fmt(r.get('host_syncs_per_step'))} |")
        lines += [""] + [f"- {world}: {row.get('model', '')}" for world, row in worlds.items()]
        for world, row in worlds.items():
            plan = row.get("planner")
            if not plan:
                continue
            lines += ["", f"Planner vs measured, {world} (ours; worst "
                          f"{100 * plan['worst_rel_diff']:.1f}%, "
                          f"{'within' if plan['within_10pct'] else 'NOT within'} 10%); "
                          f"planned device state + unsharded peak "
                          f"{_fmt(plan['predicted_device_state_plus_unsharded_peak_mib'], 0)} MiB"
                          f" vs max_memory_allocated "
                          f"{_fmt(plan['max_memory_allocated_mib'], 0)} MiB "
                          "(activations not planned)", "",
                      "| figure | predicted | measured | diff |", "|---|---|---|---|"]
            lines += [f"| {k} | {v['predicted']:,} | {v['measured']:,} | "
                      f"{100 * v['rel_diff']:.2f}% |" for k, v in plan["figures"].items()]
    trace = fake.get("trace") or {}
    if trace:
        lines += ["", "## Trace", "", trace.get("what", ""), "",
                  f"trace: {trace.get('trace')}; timeline: "
                  f"{trace.get('png') or 'not drawn (' + str(trace.get('png_skipped')) + ')'}"]
        for k, v in (trace.get("side_stream_overlap") or {}).items():
            lines.append(f"- {k}: {v['busy_ms']:.2f} ms busy, "
                         f"{100 * v['share_under_compute']:.0f}% under compute")
    scale = report.get("scale") or {}
    if scale.get("runs"):
        lines += ["", "## One collective per bucket at scale (fake process group)", "",
                  scale.get("what", ""), "",
                  "| impl | host ms/step | wall ms/step | collectives per step |",
                  "|---|---|---|---|"]
        for impl, r in scale["runs"].items():
            if "error" in r:
                lines.append(f"| {impl} | error: {r['error'].strip().splitlines()[-1][:120]} |||")
                continue
            c = r.get("collectives")
            lines.append(f"| {impl} | {_fmt(r.get('host_ms'), 2)} | {_fmt(r.get('wall_ms'), 2)} "
                         f"| {'-' if c is None else c} |")
        plan = scale.get("planner") or {}
        lines += ["", f"host time ours / FSDP2: {_fmt(scale.get('host_ratio_ours_over_fsdp2'), 3)};"
                      f" planner: {plan}"]
    san = report.get("sanitizer") or {}
    if san:
        lines += ["", "## CUDA sanitizer", "", san.get("what", ""), "",
                  f"enabled: {san.get('enabled')}; reports: {len(san.get('reports', []))}"]
        for r in san.get("reports", []):
            lines += ["", f"mesh {r['mesh']}, step {r['step']}:", "```", r["report"], "```"]
    return "\n".join(lines) + "\n"


def _write(out: str, report: dict, dry: bool) -> None:
    files = {}
    for name, what in FILES.items():
        if name in ("gpu_check.json", "gpu_check.md") or os.path.exists(os.path.join(out, name)):
            files[name] = what
    report["files"] = files
    for name, text in (("gpu_check.json", json.dumps(report, indent=1, default=str)),
                       ("gpu_check.md", render_md(report, dry))):
        tmp = os.path.join(out, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out, name))


def orchestrate(args) -> int:
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    stale = [n for n in FILES if os.path.exists(os.path.join(out, n))]
    for n in stale:  # a rerun into the same folder: no file from the last run passes for new
        os.remove(os.path.join(out, n))
    others = [n for n in os.listdir(out) if n not in FILES]
    if len(others) + len(FILES) > MAX_FILES:
        raise SystemExit(f"gpu_check: {out} holds other files ({', '.join(others[:5])}); "
                         f"give an empty folder (at most {MAX_FILES} files in all)")
    limits = DRY_LIMITS if args.dry_run else LIMITS
    report: dict = {k: {} for k in KEYS}
    log_path = os.path.join(out, "gpu_check.log")
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp, open(log_path, "w") as log:
        for part in args.parts:
            limit = limits[part] * args.limit_scale
            result_path = os.path.join(tmp, f"{part}.json")
            cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--part", part, "--out", out,
                   "--result", result_path] + (["--dry-run"] if args.dry_run else [])
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
            env.pop("TORCH_CUDA_SANITIZER", None)
            if part == "sanitizer" and not args.dry_run:
                env["TORCH_CUDA_SANITIZER"] = "1"
            log.write(f"===== {part} (limit {limit:.0f} s): {' '.join(cmd[1:])}\n")
            log.flush()
            print(f"gpu_check: {part} (limit {limit:.0f} s) ...", flush=True)
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=limit)
                status = "ok" if code == 0 else f"failed (exit code {code})"
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):  # (it may just have ended)
                    os.killpg(proc.pid, 9)
                proc.wait()
                status = f"timed out after {limit:.0f} s"
            seconds = time.perf_counter() - t0
            log.write(f"===== {part}: {status}, {seconds:.1f} s\n")
            log.flush()
            try:
                with open(result_path) as f:
                    sec = json.load(f)
            except (OSError, ValueError):
                sec = {}
            if "error" in sec:
                status = "error"
            sec["part"] = {"status": status, "seconds": round(seconds, 2), "limit_s": limit}
            if part == "trace":
                report["fake_pg"]["trace"] = sec
            else:
                sec.update({k: v for k, v in report[part].items() if k == "trace"})
                report[part] = sec
            _write(out, report, args.dry_run)
            print(f"gpu_check: {part}: {status} ({seconds:.1f} s)", flush=True)
    _write(out, report, args.dry_run)
    n_files = len(os.listdir(out))
    failed = _failed_checks(report)
    parts = [report[k] if k != "trace" else report["fake_pg"].get("trace", {})
             for k in args.parts]
    incomplete = [p for p, sec in zip(args.parts, parts) if _status(sec) != "ok"]
    print(render_md(report, args.dry_run))
    print(f"gpu_check: {time.perf_counter() - t_all:.0f} s, {n_files} files in {out}; "
          f"{len(failed)} check(s) failed; parts not finished: {incomplete or 'none'}")
    if n_files > MAX_FILES:
        print(f"gpu_check: {n_files} files in {out}, more than {MAX_FILES}")
        return 2
    return 1 if failed else 2 if incomplete else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the results (at most 8 files)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, small models, the fake-CUDA job (no GPU needed)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS,
                   help="run only these parts (default: all, in this order)")
    p.add_argument("--limit-scale", type=float, default=1.0,
                   help="multiply every part's time limit (a slow or busy machine)")
    p.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)    # child: one part
    p.add_argument("--result", help=argparse.SUPPRESS)                 # child: its result file
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.part:
        return run_part(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
