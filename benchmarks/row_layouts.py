"""Equal chunks against uneven pieces, the two row layouts, on one training step (gloo).

    python -m benchmarks.row_layouts                       # memory shape, 2 ranks
    python -m benchmarks.row_layouts --world-size 4 --repeats 3

Each launch trains the benchmark shape (``benchmarks.shapes``, default
"memory": 8 blocks of Linear(2048,4096) + Linear(4096,2048)) with
``fsdp_compose.fully_shard`` on each block then the root and AdamW, with
every row layout forced to one form (``fsdp_compose._plan._layout.FORCE_EVEN``):
equal chunks (one equal-size all-gather / reduce-scatter per group) or
uneven pieces (each rank's boundary at the row nearest its even share; on
gloo both are the same per-rank broadcasts and one all-reduce, with pieces of
other sizes). Launches alternate between the two layouts (``--repeats`` each);
reported: the median step (wall: slowest rank; CPU: mean over ranks), the peak
RSS (largest rank), the all-gather / reduce-scatter bytes of a step, the
padding, and whether the losses are bit-identical across the layouts.
(docs/design.md, "Row-granular shards at scale".)
"""
from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks._launch import LaunchError, run_ranks
from benchmarks.shapes import SHAPES

_PRELOAD = ["torch", "torch.distributed", "fsdp_compose"]
LAYOUTS = {"equal": True, "uneven": False}


def _run(cfg: dict, rank: int, world: int) -> dict:
    import resource
    import time

    import torch
    import torch.distributed as dist

    from fsdp_compose import comm_stats, fully_shard, reset_comm_stats

    from fsdp_compose._plan import _layout
    from fsdp_compose._base._registry import unit_of
    from benchmarks.models import build_model, make_data

    shape = SHAPES[cfg["shape"]]
    model = build_model(shape, 0, torch.device("cpu"))
    _layout.FORCE_EVEN = LAYOUTS[cfg["layout"]]
    try:
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
    finally:
        _layout.FORCE_EVEN = None
    groups = [g for m in [model, *model.blocks] for g in unit_of(m).groups]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = cfg["warmup"] + cfg["steps"]
    data = make_data(shape, 0, rank, n, torch.device("cpu"))
    losses, wall, cpu = [], [], []
    for i, (x, y) in enumerate(data):
        if i == cfg["warmup"]:
            reset_comm_stats()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t1, c1 = time.perf_counter(), time.process_time()
        losses.append(loss.item())
        if i >= cfg["warmup"]:
            wall.append((t1 - t0) * 1e3)
            cpu.append((c1 - c0) * 1e3)
    s = comm_stats()
    return {"losses": losses, "wall_ms": wall, "cpu_ms": cpu,
            "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "ag_bytes": s.all_gather_bytes // cfg["steps"],
            "rs_bytes": s.reduce_scatter_bytes // cfg["steps"],
            "even": [g.layout.even for g in groups],
            "padding": sum(g.layout.padding for g in groups),
            "shard_numel": sum(g.shard_numel for g in groups)}


def _worker_entry(cfg_path: str) -> None:
    from benchmarks._launch import gloo_rank
    gloo_rank(cfg_path, _run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.row_layouts",
                                description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), default="memory")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="launches per layout (alternating)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(argv)
    runs: dict[str, list] = {k: [] for k in LAYOUTS}
    try:
        for _ in range(args.repeats):
            for layout in LAYOUTS:
                cfg = {"shape": args.shape, "layout": layout, "steps": args.steps,
                       "warmup": args.warmup, "threads": args.threads, "timeout": args.timeout}
                runs[layout].append(run_ranks("benchmarks.row_layouts", _PRELOAD, cfg,
                                              args.world_size, args.timeout,
                                              f"row_layouts ({layout}, world {args.world_size})"))
    except LaunchError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{args.shape} shape, {args.world_size} gloo ranks, AdamW fp32, {args.repeats} launches "
          f"per layout x {args.steps} steps (median; wall: slowest rank, CPU: mean over ranks)")
    print(f"{'layout':>7} {'wall ms':>8} {'CPU ms':>8} {'RSS MiB':>8} {'all-gather':>11} "
          f"{'reduce-sc.':>11} {'padding':>8} {'groups even':>11}")
    out = {}
    for layout, launches in runs.items():
        wall = [max(r["wall_ms"][i] for r in ranks) for ranks in launches
                for i in range(args.steps)]
        cpu = [statistics.mean(r["cpu_ms"][i] for r in ranks) for ranks in launches
               for i in range(args.steps)]
        rss = max(r["maxrss_mib"] for ranks in launches for r in ranks)
        r0 = launches[0][0]
        out[layout] = dict(wall=statistics.median(wall), cpu=statistics.median(cpu), rss=rss,
                           losses=[r["losses"] for ranks in launches for r in ranks])
        print(f"{layout:>7} {out[layout]['wall']:8.0f} {out[layout]['cpu']:8.0f} {rss:8.0f} "
              f"{r0['ag_bytes'] / 2**20:9.1f}Mi {r0['rs_bytes'] / 2**20:9.1f}Mi "
              f"{r0['padding']:8d} {sum(r0['even']):>5}/{len(r0['even'])}")
    a, b = out["equal"]["losses"], out["uneven"]["losses"]
    same = a == b
    worst = max(abs(x - y) / max(abs(x), 1e-30) for la, lb in zip(a, b) for x, y in zip(la, lb))
    print(f"uneven / equal: wall {out['uneven']['wall'] / out['equal']['wall']:.2f}x, CPU "
          f"{out['uneven']['cpu'] / out['equal']['cpu']:.2f}x; losses bit-identical across "
          f"layouts and launches: {same} (largest relative difference {worst:.1e}; the "
          f"first step's: {max(abs(la[0] - lb[0]) for la, lb in zip(a, b)):.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
