"""Float8 all-gather against bf16 all-gather, fsdp_compose and FSDP2, in one run (gloo).

    python -m benchmarks.float8                       # memory shape, 2 ranks
    python -m benchmarks.float8 --shape deep-small --world-size 4 --repeats 2

Each launch trains the benchmark shape (``benchmarks.shapes``, default
"memory": 8 blocks of Linear(2048,4096) + GELU + Linear(4096,2048)) turned
into torchao float8 training (``convert_to_float8_training``), sharded per
block then the root, with ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` and AdamW, by fsdp_compose or by FSDP2, with the float8
all-gather on (``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``,
``precompute_float8_dynamic_scale_for_fsdp`` after each step) or off (the
weights gathered in bf16, cast to float8 after). The four configurations
alternate (``--repeats`` launches each). Reported: the median step (wall:
slowest rank; CPU: mean over ranks), the all-gather bytes of a step (ours:
``comm_stats``; FSDP2: the bytes its ``all_gather_single`` calls write), the
peak RSS (largest rank), and the last losses against FSDP2's with the same
gather. Needs torchao (the ``test`` extra). (docs/design.md, "All-gather
extension".)
"""
from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks._launch import LaunchError, run_ranks
from benchmarks.shapes import SHAPES

_PRELOAD = ["torch", "torch.distributed", "fsdp_compose"]
CONFIGS = [("fsdp_compose", "float8"), ("fsdp2", "float8"),
           ("fsdp_compose", "bf16"), ("fsdp2", "bf16")]


def _run(cfg: dict, rank: int, world: int) -> dict:
    import resource
    import time
    from unittest import mock

    import torch
    import torch.distributed as dist
    from torchao.float8 import (Float8LinearConfig, convert_to_float8_training,
                                precompute_float8_dynamic_scale_for_fsdp)

    from benchmarks.models import build_model, make_data
    from fsdp_compose import comm_stats, reset_comm_stats

    shape = SHAPES[cfg["shape"]]
    model = build_model(shape, 0, torch.device("cpu"))
    float8_gather = cfg["gather"] == "float8"
    convert_to_float8_training(model, config=Float8LinearConfig(
        enable_fsdp_float8_all_gather=float8_gather))
    if cfg["impl"] == "fsdp_compose":
        from fsdp_compose import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        fully_shard(b, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    fsdp2_bytes = [0]
    orig = dist.all_gather_single

    def counting(out, inp, *a, **k):
        fsdp2_bytes[0] += out.numel() * out.element_size()
        return orig(out, inp, *a, **k)

    n = cfg["warmup"] + cfg["steps"]
    data = make_data(shape, 0, rank, n, torch.device("cpu"))
    losses, wall, cpu = [], [], []
    with mock.patch.object(dist, "all_gather_single", counting):
        for i, (x, y) in enumerate(data):
            if i == cfg["warmup"]:
                reset_comm_stats()
                fsdp2_bytes[0] = 0
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if float8_gather:
                precompute_float8_dynamic_scale_for_fsdp(model)
            t1, c1 = time.perf_counter(), time.process_time()
            losses.append(loss.item())
            if i >= cfg["warmup"]:
                wall.append((t1 - t0) * 1e3)
                cpu.append((c1 - c0) * 1e3)
    ag = comm_stats().all_gather_bytes if cfg["impl"] == "fsdp_compose" else fsdp2_bytes[0]
    return {"losses": losses, "wall_ms": wall, "cpu_ms": cpu, "ag_bytes": ag // cfg["steps"],
            "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _worker_entry(cfg_path: str) -> None:
    from benchmarks._launch import gloo_rank
    gloo_rank(cfg_path, _run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.float8",
                                description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), default="memory")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="launches per configuration")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args(argv)
    runs: dict[tuple, list] = {c: [] for c in CONFIGS}
    try:
        for _ in range(args.repeats):
            for impl, gather in CONFIGS:
                cfg = {"shape": args.shape, "impl": impl, "gather": gather,
                       "steps": args.steps, "warmup": args.warmup, "threads": args.threads,
                       "timeout": args.timeout}
                runs[(impl, gather)].append(run_ranks(
                    "benchmarks.float8", _PRELOAD, cfg, args.world_size, args.timeout,
                    f"float8 ({impl}, {gather} all-gather, world {args.world_size})"))
    except LaunchError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{args.shape} shape, {args.world_size} gloo ranks, torchao float8 linears, bf16 "
          f"params / fp32 reduce, AdamW; {args.repeats} launch(es) per configuration x "
          f"{args.steps} steps (median; wall: slowest rank, CPU: mean over ranks)")
    print(f"{'impl':>13} {'all-gather':>10} {'bytes/step':>14} {'wall ms':>8} {'CPU ms':>8} "
          f"{'RSS MiB':>8} {'last loss - FSDP2':>18}")
    out = {}
    for (impl, gather), launches in runs.items():
        wall = [max(r["wall_ms"][i] for r in ranks) for ranks in launches
                for i in range(args.steps)]
        cpu = [statistics.mean(r["cpu_ms"][i] for r in ranks) for ranks in launches
               for i in range(args.steps)]
        out[(impl, gather)] = dict(
            wall=statistics.median(wall), cpu=statistics.median(cpu),
            rss=max(r["maxrss_mib"] for ranks in launches for r in ranks),
            bytes=launches[0][0]["ag_bytes"], loss=launches[0][0]["losses"])
    for (impl, gather), o in out.items():
        ref = out[("fsdp2", gather)]["loss"]
        diff = max(abs(a - b) for a, b in zip(o["loss"], ref))
        print(f"{impl:>13} {gather:>10} {o['bytes']:>14,} {o['wall']:8.0f} {o['cpu']:8.0f} "
              f"{o['rss']:8.0f} {diff:18.1e}")
    for impl in ("fsdp_compose", "fsdp2"):
        f8, bf = out[(impl, "float8")], out[(impl, "bf16")]
        print(f"{impl}: float8 / bf16 all-gather bytes {f8['bytes'] / bf['bytes']:.3f}, "
              f"wall {f8['wall'] / bf['wall']:.2f}x")
    for gather in ("float8", "bf16"):
        a, b = out[("fsdp_compose", gather)], out[("fsdp2", gather)]
        print(f"{gather} all-gather: fsdp_compose / FSDP2 wall {a['wall'] / b['wall']:.2f}x, "
              f"bytes {a['bytes'] / b['bytes']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
