"""2-D (dp, tp) training: fsdp_compose + tensor parallel against torch FSDP2 + tensor parallel.

    python -m benchmarks.tp                         # 4 gloo CPU ranks as (dp=2, tp=2), 3 repeats
    python -m benchmarks.tp --repeats 5 --dim 384 --layers 8

Both implementations train the demo Llama (``fsdp_compose/demo/model.py``) the
same way, through the demo's own ``shard_model``: each block is
``parallelize_module``-d over ``mesh["tp"]`` with the demo's ``tp_plan()``
(q/k/v and gate/up ``ColwiseParallel``, o/down ``RowwiseParallel``; norms
plain), then every block and the root (tied embedding/head, final norm) is
``fully_shard``-ed over ``mesh["dp"]``, by ``fsdp_compose.fully_shard`` or by
``torch.distributed.fsdp.fully_shard``. Same seed, same init, same
character-level batches of the shipped text (a dp rank's slice of each global
batch; the two ranks of a TP group read the same one); AdamW built after
sharding; a step is forward + cross-entropy + backward + gradient clipping to
norm 1.0 + ``optim.step()`` + ``zero_grad()``. Clipping: ours is
``fsdp_compose.clip_grad_norm_``; for FSDP2 (whose parameters are DTensors on
two different meshes here: TP projections on the 2-D mesh, norms and the
embedding on the dp mesh, a mix ``torch.nn.utils.clip_grad_norm_`` rejects)
the norm is taken per mesh with ``get_total_norm`` on the DTensor gradients,
made full, and combined. The gradient norms of the two are compared per step.

Method (as ``benchmarks/peers.py``): every (implementation, repeat) is a fresh
set of 4 rank processes forked from a fork server that has imported torch,
both implementations and the demo, so they start from the same baseline RSS;
gloo, one intra-op thread per rank (4 ranks on a 2-core machine: more threads
only oversubscribe). Launches alternate (ours, FSDP2, ours, FSDP2, ...).
Warmup steps run untimed. Reported per implementation: the median over
repeats of (median over timed steps of the slowest rank's step time); peak
RSS (``ru_maxrss``) of each rank, median over repeats, and the largest rank's
growth over its RSS before the model was built; the final loss (of the global
batch); and ours/FSDP2 ratios. The orchestrating process never imports torch.
Defaults (a 10.6M-parameter model, 5 repeats of both) take about 3 minutes
on a 2-core machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from benchmarks._launch import gloo_rank, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "out")
IMPLS = ["fsdp_compose", "fsdp2"]
LABEL = {"fsdp_compose": "fsdp_compose+TP", "fsdp2": "FSDP2+TP"}
MAX_NORM = 1.0


# =============================================================================
# Rank side (imports torch)
# =============================================================================
def _rss_mib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _live_rss_mib() -> float | None:
    """RSS now, after handing the heap's free pages back to the OS (glibc
    ``malloc_trim``): memory still in use, without what the allocator retains."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def _clip_fsdp2(params, max_norm: float):
    """Global-norm clipping of FSDP2 DTensor gradients living on several meshes:
    the norm over each mesh's gradients (a DTensor reduction), made full, then combined."""
    import torch
    grads = [p.grad for p in params if p.grad is not None]
    by_mesh: dict = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh, []).append(g)
    total = torch.zeros(())
    for group in by_mesh.values():
        total = total + torch.nn.utils.get_total_norm(group, 2.0).full_tensor().pow(2)
    total = total.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.to_local().mul_(coef)
    return total


def run_impl(cfg: dict, rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import fsdp_compose
    from fsdp_compose.demo.data import BatchSampler, CharTokenizer, load_text
    from fsdp_compose.demo.model import ModelArgs, Transformer
    from fsdp_compose.demo.train import make_mesh, shard_model

    impl = cfg["impl"]
    rss_start = _rss_mib()
    mesh = make_mesh(cfg["tp"], torch.device("cpu"))
    text = load_text()
    tok = CharTokenizer(text)
    sampler = BatchSampler(tok.encode(text), global_batch=cfg["batch"], seq_len=cfg["seq_len"],
                           rank=mesh["dp"].get_local_rank(), world_size=mesh["dp"].size(),
                           seed=cfg["seed"])
    torch.manual_seed(cfg["seed"])
    model = Transformer(ModelArgs(vocab_size=tok.vocab_size, dim=cfg["dim"],
                                  n_layers=cfg["layers"], n_heads=cfg["dim"] // 32,
                                  max_seq_len=cfg["seq_len"]))
    n_params = sum(p.numel() for p in model.parameters())
    no_decay = {n for n, p in model.named_parameters() if p.ndim < 2}
    if impl == "fsdp_compose":
        shard_model(model, mesh)
        clip = fsdp_compose.clip_grad_norm_
    else:
        from torch.distributed.fsdp import fully_shard
        shard_model(model, mesh, fully_shard=fully_shard)
        clip = _clip_fsdp2
    named = list(model.named_parameters())
    optim = torch.optim.AdamW(
        [{"params": [p for n, p in named if n not in no_decay], "weight_decay": 0.1},
         {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0}],
        lr=cfg["lr"], betas=(0.9, 0.95))
    rss_setup = _rss_mib()
    params = [p for _, p in named]

    def step(i):
        x, y = sampler.batch(i)  # (b, s), (b, s)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        norm = clip(params, MAX_NORM)
        optim.step()
        optim.zero_grad()
        return loss.detach(), norm.detach(), time.perf_counter() - t0

    losses, norms, times, peaks = [], [], [], []
    for i in range(cfg["warmup"] + cfg["steps"]):
        if i == cfg["warmup"]:
            dist.barrier()
        loss, norm, dt = step(i)
        losses.append(loss)
        norms.append(norm)
        peaks.append(_rss_mib())
        if i >= cfg["warmup"]:
            times.append(dt)
    history = torch.stack(losses).float()  # (steps,): this dp slice's loss
    dist.all_reduce(history)  # the ranks of a TP group hold the same loss
    dist.barrier()
    peak = _rss_mib()
    live = _live_rss_mib()  # the model, its gradients and optimizer state still alive
    return {"impl": impl, "rank": rank, "step_s": times,
            "losses": (history / world).tolist(), "norms": [float(n) for n in norms],
            "n_params": n_params, "rss_start_mib": rss_start, "rss_setup_mib": rss_setup,
            "peak_mib": peak, "peak_mib_per_step": peaks, "live_mib": live,
            "torch": torch.__version__}


def _worker_entry(cfg_path: str) -> None:
    gloo_rank(cfg_path, run_impl, dump_before_timeout=True)


# =============================================================================
# Orchestrator side (no torch)
# =============================================================================
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp",
            "torch.distributed.tensor.parallel", "fsdp_compose", "fsdp_compose.demo.train"]


def launch(cfg: dict, world: int) -> list[dict]:
    """One implementation in ``world`` fresh rank processes; every rank's result."""
    return run_ranks("benchmarks.tp", _PRELOAD, cfg, world, cfg["timeout"], cfg["impl"])


def summarise_launch(ranks: list[dict]) -> dict:
    n = len(ranks[0]["step_s"])
    slowest = [max(r["step_s"][i] for r in ranks) for i in range(n)]
    return {"step_ms": statistics.median(slowest) * 1e3,
            "peak_mib": [r["peak_mib"] for r in ranks],
            "growth_mib": max(r["peak_mib"] - r["rss_start_mib"] for r in ranks),
            "live_mib": max(r["live_mib"] or float("nan") for r in ranks),
            "losses": ranks[0]["losses"], "norms": ranks[0]["norms"],
            "peak_mib_per_step": [r["peak_mib_per_step"] for r in ranks],
            "n_params": ranks[0]["n_params"], "torch": ranks[0]["torch"]}


def summarise_impl(launches: list[dict]) -> dict:
    steps = [L["step_ms"] for L in launches]
    world = len(launches[0]["peak_mib"])
    return {"step_ms": statistics.median(steps), "step_ms_repeats": steps,
            "peak_mib": [statistics.median(L["peak_mib"][r] for L in launches)
                         for r in range(world)],
            "growth_mib": statistics.median(L["growth_mib"] for L in launches),
            "live_mib": statistics.median(L["live_mib"] for L in launches),
            "losses": launches[0]["losses"], "norms": launches[0]["norms"],
            "repeats_identical": all(L["losses"] == launches[0]["losses"] for L in launches)}


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def report(summary: dict, meta: dict) -> str:
    ours, ref = summary["fsdp_compose"], summary["fsdp2"]
    lines = [
        f"== demo Llama: dim {meta['dim']}, {meta['layers']} layers, "
        f"{meta['n_params'] / 1e6:.2f}M params; {meta['world']} gloo ranks as "
        f"(dp={meta['world'] // meta['tp']}, tp={meta['tp']}), {meta['threads']} thread/rank; "
        f"global batch {meta['batch']} x {meta['seq_len']} tokens; "
        f"{meta['warmup']} warmup + {meta['steps']} timed steps x {meta['repeats']} repeats; "
        f"AdamW, clip 1.0; torch {meta['torch']}",
    ]
    head = (f"   {'impl':<16} {'step ms':>8} {'repeats':>26}  "
            f"{'peak RSS MiB rank 0/1/2/3':>26} {'(+MiB)':>7} {'live MiB':>9} {'final loss':>11}")
    lines += [head, "   " + "-" * (len(head) - 3)]
    for impl in IMPLS:
        s = summary[impl]
        reps = "/".join(f"{v:.0f}" for v in s["step_ms_repeats"])
        peaks = "/".join(f"{v:.0f}" for v in s["peak_mib"])
        lines.append(f"   {LABEL[impl]:<16} {s['step_ms']:>8.1f} {reps:>26}  {peaks:>26} "
                     f"{s['growth_mib']:>+7.0f} {s['live_mib']:>9.0f} {s['losses'][-1]:>11.6f}")
    peak_ratio = max(ours["peak_mib"]) / max(ref["peak_mib"])
    lines.append(f"   ours/FSDP2: step time {ours['step_ms'] / ref['step_ms']:.2f}x, "
                 f"peak RSS (max over ranks) {peak_ratio:.2f}x")
    n0 = abs(ours["norms"][0] - ref["norms"][0]) / ref["norms"][0]
    lines.append(f"   ours vs FSDP2 over {len(ours['losses'])} steps: loss max rel diff "
                 f"{_max_rel(ours['losses'], ref['losses']):.1e}; clip grad norm rel diff "
                 f"{n0:.1e} at step 0, max {_max_rel(ours['norms'], ref['norms']):.1e} "
                 "(rounding differences grow as training goes)")
    lines.append("   step ms: median over repeats (listed) of the median timed step of the "
                 "slowest rank; peak RSS: ru_maxrss per rank, median over repeats; (+MiB): "
                 "largest rank's peak minus its RSS before the model was built;\n"
                 "   live MiB: RSS after training and glibc malloc_trim(0) (max over ranks): "
                 "what is still in use, without the free heap the allocator kept")
    nondet = [LABEL[i] for i in IMPLS if not summary[i]["repeats_identical"]]
    if nondet:
        lines.append(f"   note: losses differ between repeats for {', '.join(nondet)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tp", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dim", type=int, default=384, help="a multiple of 32 (heads of 32)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=12, help="timed steps")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--timeout", type=float, default=300, help="seconds per launch")
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.tp < 2 or args.world_size % args.tp or (args.dim // 32) % args.tp:
        p.error("--tp must be >= 2 and divide --world-size and the --dim/32 heads")

    t_begin = time.monotonic()
    cfg = {k: getattr(args, k) for k in ("tp", "dim", "layers", "seq_len", "batch", "warmup",
                                         "steps", "lr", "seed", "threads", "timeout")}
    raw: dict[str, list] = {i: [] for i in IMPLS}
    for rep in range(args.repeats):
        for impl in IMPLS:  # alternate
            t0 = time.monotonic()
            L = summarise_launch(launch(dict(cfg, impl=impl), args.world_size))
            raw[impl].append(L)
            print(f"[{rep + 1}/{args.repeats}] {LABEL[impl]:<16} {L['step_ms']:8.1f} ms/step  "
                  f"peak {max(L['peak_mib']):6.0f} MiB/rank  final loss {L['losses'][-1]:.6f}  "
                  f"({time.monotonic() - t0:.1f} s)", flush=True)
    summary = {i: summarise_impl(raw[i]) for i in IMPLS}
    first = raw[IMPLS[0]][0]
    meta = dict(cfg, world=args.world_size, repeats=args.repeats, torch=first["torch"],
                n_params=first["n_params"], python=platform.python_version(),
                cpus=os.cpu_count(), runtime_s=time.monotonic() - t_begin)
    print()
    print(report(summary, meta))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "tp.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "impls": summary, "launches": raw}, f, indent=1)
    print(f"\nwrote {path}; total runtime {meta['runtime_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
