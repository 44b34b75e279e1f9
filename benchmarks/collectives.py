"""gloo all-gather / reduce-scatter: torch's tensor collectives vs fsdp_compose's in-place ones.

    python -m benchmarks.collectives [--world-size 2] [--sizes 0.0625 1 4 16 64] [--repeats 11]

``fsdp_compose._comm._collectives`` builds them, for CPU tensors on gloo, from one
broadcast per rank (all-gather) and an in-place all-reduce (reduce-scatter;
over 2 ranks up to 1 MiB a send/recv exchange instead); see its "[Note: gloo
collectives]". For every size (MiB of the unsharded fp32
buffer: the all-gather output, the reduce-scatter input) each repeat runs, in
an order that alternates between repeats:

- all-gather, torch (``all_gather_single`` / ``all_gather_into_tensor``) and
  ours: a fresh output buffer every time (as in training, where the unsharded
  buffer is allocated at every unshard), then wait;
- reduce-scatter (AVG), torch (``reduce_scatter_single`` /
  ``reduce_scatter_tensor``) and ours: a fresh random input every time, made
  outside the timed region; the timed region ends with the S-element result.

With ``--uneven-row R`` a third all-gather runs too, ``ag_uneven``: the
layout alternative of uneven rank pieces (rank chunks of whole rows of R
elements, alternately one row more and one row less than ``S``, laid end to
end with no padding), gathered by the same per-rank broadcasts straight into
their (uneven) views; ``ag_ours`` then stands for the equal, padded chunks
(every chunk the largest piece, ``S`` + one row), as fsdp_compose lays them out.

A barrier precedes every timed call. Wall ms is the slowest rank's, CPU ms
(``time.process_time()``: every thread of the process, gloo's included) the
mean over ranks; the table prints the median over repeats of each and the
ratio ours / torch. One untimed round per size first also checks that the two
agree (all-gather bit for bit). Raw times go to ``--out`` as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

from benchmarks._launch import LaunchError, run_ranks, write_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "out", "collectives.json")
VARIANTS = ["ag_torch", "ag_ours", "rs_torch", "rs_ours"]
_PRELOAD = ["torch", "torch.distributed", "fsdp_compose._comm._collectives"]


# =============================================================================
# Rank side
# =============================================================================

def _run(cfg: dict, rank: int, world: int) -> dict:
    import time
    import warnings

    import torch
    import torch.distributed as dist

    from fsdp_compose._comm import _collectives as C

    warnings.filterwarnings("ignore", category=FutureWarning, message=".*deprecated.*")
    ag_torch = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs_torch = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    AVG = dist.ReduceOp.AVG

    out: dict = {"sizes": {}, "ag_name": ag_torch.__name__, "rs_name": rs_torch.__name__}
    for mib in cfg["sizes"]:
        S = max(1, int(mib * 2**20) // 4 // world)
        n = S * world
        gen = torch.Generator().manual_seed(rank)
        shard = torch.randn(S, generator=gen)

        row = cfg.get("uneven_row") or 0
        if row:  # equal chunks padded to the largest uneven piece (see the docstring)
            sizes = [S + (row if r % 2 == 0 else -row) for r in range(world)]
            sizes[-1] += S * world - sum(sizes)
            S = max(sizes)
            n = S * world
            shard = torch.randn(S, generator=gen)
            mine = shard[:sizes[rank]]

        def call(variant: str, flat):
            if variant == "ag_uneven":  # the alternative layout: no padding, uneven views
                full = torch.empty(sum(sizes))
                views = full.split(sizes)
                views[rank].copy_(mine)
                works = [dist.broadcast(v, src=r, async_op=True) for r, v in enumerate(views)]
                for w in works:
                    w.wait()
                return full
            if variant == "ag_torch":
                full = torch.empty(n)
                ag_torch(full, shard, async_op=True).wait()
                return full
            if variant == "ag_ours":
                full = torch.empty(n)
                C.all_gather(full, shard, None).wait()
                return full
            if variant == "rs_torch":
                res = torch.empty(S)
                rs_torch(res, flat, op=AVG, async_op=True).wait()
                return res
            return C.reduce_scatter(flat, None, AVG).wait()

        # untimed round: warm up, and check that ours computes what torch does
        variants = VARIANTS + (["ag_uneven"] if row else [])
        got = {v: call(v, torch.randn(n, generator=torch.Generator().manual_seed(7 + rank)))
               for v in variants}
        assert torch.equal(got["ag_ours"], got["ag_torch"]), f"{mib} MiB: all-gathers differ"
        if row:
            for r, v in enumerate(got["ag_uneven"].split(sizes)):
                assert torch.equal(v, got["ag_ours"].view(world, S)[r, :sizes[r]]), "uneven"
        torch.testing.assert_close(got["rs_ours"], got["rs_torch"])
        del got

        times = {v: {"wall_ms": [], "cpu_ms": []} for v in variants}
        for i in range(cfg["repeats"]):
            for v in (variants if i % 2 == 0 else variants[::-1]):
                flat = torch.randn(n, generator=gen) if v.startswith("rs") else None
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                res = call(v, flat)
                t1, c1 = time.perf_counter(), time.process_time()
                times[v]["wall_ms"].append((t1 - t0) * 1e3)
                times[v]["cpu_ms"].append((c1 - c0) * 1e3)
                del res, flat
        out["sizes"][str(mib)] = {"numel": n, "times": times}
    return out


def _worker_entry(cfg_path: str) -> None:
    """A rank (env: RANK, WORLD_SIZE, MASTER_ADDR/PORT); writes result<rank>.json."""
    with open(cfg_path) as f:
        cfg = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    import faulthandler
    faulthandler.dump_traceback_later(max(1, cfg["timeout"] - 5), exit=False)
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg["timeout"]))
    try:
        res = _run(cfg, rank, world)
        res["torch"] = torch.__version__
    finally:
        dist.destroy_process_group()
    write_result(cfg, rank, res)


# =============================================================================
# Orchestrator side (no torch)
# =============================================================================

def summarise(ranks: list[dict], sizes: list[float]) -> list[dict]:
    """One row per (collective, size): medians over repeats, and ours / torch
    (for "uneven all-gather": uneven pieces / fsdp_compose's equal chunks)."""
    rows = []
    pairs = [("ag", "all-gather", "torch", "ours"), ("rs", "reduce-scatter", "torch", "ours")]
    if "ag_uneven" in ranks[0]["sizes"][str(sizes[0])]["times"]:
        pairs.append(("ag", "uneven all-gather", "ours", "uneven"))
    for coll, label, base, new in pairs:
        for mib in sizes:
            med = {}
            for impl, key in (("torch", base), ("ours", new)):
                per_rank = [r["sizes"][str(mib)]["times"][f"{coll}_{key}"] for r in ranks]
                wall = [max(ts) for ts in zip(*(t["wall_ms"] for t in per_rank))]
                cpu = [statistics.fmean(cs) for cs in zip(*(t["cpu_ms"] for t in per_rank))]
                med[impl] = (statistics.median(wall), statistics.median(cpu))
            rows.append({"collective": label, "mib": mib,
                         "torch_wall_ms": med["torch"][0], "ours_wall_ms": med["ours"][0],
                         "torch_cpu_ms": med["torch"][1], "ours_cpu_ms": med["ours"][1],
                         "wall_ratio": med["ours"][0] / med["torch"][0],
                         "cpu_ratio": med["ours"][1] / med["torch"][1]})
    return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'collective':<15}{'MiB':>8} | {'torch wall':>10}{'ours wall':>10}{'ratio':>7} | "
            f"{'torch CPU':>10}{'ours CPU':>10}{'ratio':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['collective']:<15}{r['mib']:>8g} | {r['torch_wall_ms']:>10.2f}"
                     f"{r['ours_wall_ms']:>10.2f}{r['wall_ratio']:>7.2f} | "
                     f"{r['torch_cpu_ms']:>10.2f}"
                     f"{r['ours_cpu_ms']:>10.2f}{r['cpu_ratio']:>7.2f}")
    return "\n".join(lines)


def summary_line(rows: list[dict], world: int) -> str:
    big = max(r["mib"] for r in rows)
    parts = []
    for label in ("all-gather", "reduce-scatter"):
        r = next(r for r in rows if r["collective"] == label and r["mib"] == big)
        parts.append(f"{label} {r['torch_wall_ms']:.1f} -> {r['ours_wall_ms']:.1f} ms wall "
                     f"({r['wall_ratio']:.2f}x), "
                     f"{r['torch_cpu_ms']:.1f} -> {r['ours_cpu_ms']:.1f} ms "
                     f"CPU ({r['cpu_ratio']:.2f}x)")
    return f"{world} gloo ranks, {big:g} MiB, torch -> ours: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.collectives",
                                description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="gloo CPU ranks to spawn")
    p.add_argument("--sizes", type=float, nargs="+", default=[0.0625, 1, 4, 16, 64],
                   help="MiB of the unsharded fp32 buffer")
    p.add_argument("--repeats", type=int, default=11, help="timed calls per variant and size")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--timeout", type=float, default=300, help="seconds for the whole launch")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON output file")
    p.add_argument("--uneven-row", type=int, default=0, metavar="R",
                   help="also time uneven rank pieces of R-element rows against equal "
                        "padded chunks (the 'uneven all-gather' rows: torch = equal, "
                        "ours = uneven)")
    args = p.parse_args(argv)

    cfg = {"sizes": args.sizes, "repeats": args.repeats, "threads": args.threads,
           "timeout": args.timeout, "uneven_row": args.uneven_row}
    try:
        ranks = run_ranks("benchmarks.collectives", _PRELOAD, cfg, args.world_size, args.timeout,
                          f"collectives (world {args.world_size})")
    except LaunchError as e:
        print(e, file=sys.stderr)
        return 1
    rows = summarise(ranks, args.sizes)
    print(f"{args.world_size} gloo ranks, {args.threads} thread(s) each, median of {args.repeats}; "
          f"torch = {ranks[0]['ag_name']} / {ranks[0]['rs_name']}; ratio = ours / torch; "
          f"times in ms (wall: slowest rank, CPU: mean over ranks)")
    print(format_table(rows))
    line = summary_line(rows, args.world_size)
    print(line)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": dict(cfg, world_size=args.world_size, torch=ranks[0]["torch"],
                                  python=platform.python_version(), machine=platform.machine(),
                                  cpus=os.cpu_count()),
                   "rows": rows, "summary": line,
                   "raw": [r["sizes"] for r in ranks]}, f, indent=1)
    print(f"wrote {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
