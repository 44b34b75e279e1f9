"""What the divergence checks cost per step (docs/design.md, "Divergence"), A/B in one run.

    python -m benchmarks.divergence                       # overhead shape, 2 gloo ranks
    python -m benchmarks.divergence --shape memory --rounds 4 --steps 2

One set of rank processes trains the shape's model (fsdp_compose on each
block, then the root; AdamW; forward + MSE loss + backward + step +
zero_grad). Rounds rotate three modes in the same processes (the order
rotates too), after warmup steps:
  check  the step check (the default: on gloo at every root forward start, see
         [Note: one check per step]), and gloo works waited in slices
         (``_divergence.wait``);
  waits  the sliced waits only (the step check off);
  off    neither: a plain ``wait()``, as before the checks existed.
The lazy-init check runs once, before the timing. Per round and mode: the
median step time of the slowest rank (wall) and of its process CPU time;
reported: the median over rounds, and the median of the per-round ratios to
"off" (paired: the modes of one round ran within a second of each other);
and the time spent inside the step checks themselves, per step (a direct
measure where the machine's noise hides a few percent).
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
    from fsdp_compose import fully_shard
    from fsdp_compose._comm import _divergence

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
    sliced, plain = _divergence.wait, (lambda work, *_, **__: work.wait())
    inside = [0.0, 0.0, 0]  # wall, CPU seconds inside the step checks; checks

    def timed_before(self, *args, _real=_divergence.StepChecks.before):
        if not self.enabled:
            return _real(self, *args)
        t0, c0, n = time.perf_counter(), time.process_time(), self.issued
        _real(self, *args)
        inside[0] += time.perf_counter() - t0
        inside[1] += time.process_time() - c0
        inside[2] += self.issued - n  # (on gloo: at forward starts only)
    _divergence.StepChecks.before = timed_before

    def timed_settle(self, _real=_divergence.StepChecks.settle):  # (its wait, deferred)
        t0, c0 = time.perf_counter(), time.process_time()
        _real(self)
        inside[0] += time.perf_counter() - t0
        inside[1] += time.process_time() - c0
    _divergence.StepChecks.settle = timed_settle

    def step() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0, time.process_time() - c0

    def set_mode(mode: str) -> None:
        model._fsdp_unit.ctx.checks.enabled = mode == "check"  # the root's (made at step 1)
        _divergence.wait = plain if mode == "off" else sliced

    modes = ("check", "waits", "off")
    for _ in range(cfg["warmup"]):
        step()
    inside[:] = [0.0, 0.0, 0]
    times = {k: [] for m in modes for k in (m, "cpu_" + m)}
    for r in range(cfg["rounds"]):
        for mode in modes[r % 3:] + modes[:r % 3]:
            set_mode(mode)
            dist.barrier()
            ts = torch.tensor([step() for _ in range(cfg["steps"])])  # (steps, 2)
            dist.all_reduce(ts, op=dist.ReduceOp.MAX)  # the slowest rank, per step
            times[mode].append(statistics.median(ts[:, 0].tolist()))
            times["cpu_" + mode].append(statistics.median(ts[:, 1].tolist()))
    steps = cfg["rounds"] * cfg["steps"]  # in check mode
    times["inside"] = [inside[0] / steps, inside[1] / steps, inside[2] / steps]
    set_mode("check")
    dist.destroy_process_group()
    write_result(cfg, rank, times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=list(SHAPES), default="overhead")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=60, help="rounds of the three modes")
    p.add_argument("--steps", type=int, default=3, help="timed steps per round and mode")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)
    cfg = {"shape": args.shape, "rounds": args.rounds, "steps": args.steps,
           "warmup": args.warmup}
    res = run_ranks("benchmarks.divergence", ["torch", "fsdp_compose", "benchmarks.models"],
                    cfg, args.world_size, args.timeout, "divergence A/B")[0]
    print(f"shape {args.shape}, {args.world_size} gloo ranks, {args.rounds} rounds x "
          f"{args.steps} steps per mode (the slowest rank's step; median of round medians)")
    for what, pre in (("wall", ""), ("CPU (process)", "cpu_")):
        off = res[pre + "off"]
        line = [f"{what:>13}: off {statistics.median(off) * 1e3:8.3f} ms"]
        for mode in ("waits", "check"):
            ratios = [a / b for a, b in zip(res[pre + mode], off)]
            line.append(f"{mode} {statistics.median(res[pre + mode]) * 1e3:8.3f} ms (x"
                        f"{statistics.median(ratios):.4f} paired, rounds {min(ratios):.2f}"
                        f"-{max(ratios):.2f})")
        print("; ".join(line))
    wall, cpu, n = res["inside"]
    print(f"inside the step checks (check mode, rank 0): {n:.1f} checks per step, "
          f"{wall * 1e3:.3f} ms wall and {cpu * 1e3:.3f} ms CPU per step (the wall time "
          "includes waiting for the slowest rank to reach the check)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
