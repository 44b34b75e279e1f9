"""What the divergence checks cost per step (docs/design.md, "Divergence"), A/B in one run.

    python -m benchmarks.divergence                       # overhead shape, 2 gloo ranks
    python -m benchmarks.divergence --shape memory --rounds 4 --steps 2

One set of rank processes trains the shape's model (fsdp_compose on each
block, then the root; AdamW; forward + MSE loss + backward + step +
zero_grad). Rounds alternate the checks on and off in the same processes
(on/off, off/on, on/off, ...), after warmup steps with the checks on. "off"
is the code without them: no step check at root forwards and backward starts
(``_divergence.STEP_CHECK``), and gloo works waited with a plain ``wait()``
instead of in slices (``_divergence.wait``). The lazy-init check runs once,
before the timing. Per round: the median step time of the slowest rank;
reported: the median over rounds of each mode, and the median of the paired
per-round ratios (on / off).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from benchmarks._launch import run_ranks, write_result
from benchmarks.shapes import SHAPES


def _worker_entry(cfg_path: str) -> None:
    with open(cfg_path) as f:
        cfg = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from benchmarks.models import build_model, make_data
    from fsdp_compose import _divergence, fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    shape = SHAPES[cfg["shape"]]
    model = build_model(shape, 0, torch.device("cpu"))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(shape, 0, rank, 1, torch.device("cpu"))
    x, y = data[0]
    sliced, plain = _divergence.wait, (lambda work: work.wait())

    def step() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0, time.process_time() - c0

    def set_checks(on: bool) -> None:
        _divergence.STEP_CHECK = on
        _divergence.wait = sliced if on else plain

    for _ in range(cfg["warmup"]):
        step()
    times = {"on": [], "off": [], "cpu_on": [], "cpu_off": []}
    for r in range(cfg["rounds"]):
        order = ("on", "off") if r % 2 == 0 else ("off", "on")
        for mode in order:
            set_checks(mode == "on")
            dist.barrier()
            ts = torch.tensor([step() for _ in range(cfg["steps"])])  # (steps, 2)
            dist.all_reduce(ts, op=dist.ReduceOp.MAX)  # the slowest rank, per step
            times[mode].append(statistics.median(ts[:, 0].tolist()))
            times["cpu_" + mode].append(statistics.median(ts[:, 1].tolist()))
    set_checks(True)
    dist.destroy_process_group()
    write_result(cfg, rank, times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=list(SHAPES), default="overhead")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20, help="on/off pairs")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round and mode")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)
    cfg = {"shape": args.shape, "rounds": args.rounds, "steps": args.steps,
           "warmup": args.warmup}
    res = run_ranks("benchmarks.divergence", ["torch", "fsdp_compose", "benchmarks.models"],
                    cfg, args.world_size, args.timeout, "divergence A/B")[0]
    print(f"shape {args.shape}, {args.world_size} gloo ranks, {args.rounds} rounds x "
          f"{args.steps} steps per mode (the slowest rank's step; median of round medians)")
    for what, on_key, off_key in (("wall", "on", "off"), ("CPU (process)", "cpu_on", "cpu_off")):
        on, off = statistics.median(res[on_key]), statistics.median(res[off_key])
        ratios = [a / b for a, b in zip(res[on_key], res[off_key])]
        print(f"{what:>13}: checks on {on * 1e3:8.3f} ms, off {off * 1e3:8.3f} ms, on / off "
              f"{on / off:.4f}; paired per-round ratio: median {statistics.median(ratios):.4f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
