"""Checkpoint save / load time and memory: fsdp_compose vs torch FSDP2, both through DCP.

    python -m benchmarks.checkpoint [--shape memory] [--ranks 2] [--dir /tmp/ckpt_bench]

For each implementation, fresh ``torchrun`` processes build the benchmark
model (``benchmarks/models.py``), shard it the same way (each block, then the
root), take one AdamW step (so optimizer state exists), then time:

- take: ``get_state_dict`` of model and optimizer alone (kept until the
  phase ends: what holding a state dict costs);
- save: ``get_state_dict`` + ``dcp.save`` of model and optimizer;
- load: ``get_state_dict`` + ``dcp.load`` + ``set_state_dict`` of the same;
- ``load_checkpoint`` (fsdp_compose only), both modes, each in fresh
  ``torchrun`` processes of its own (the same build and one step, then the
  load of the checkpoint the first launch saved, as the first phase: no
  earlier phase's freed memory to reuse): the default (verify, then load in
  place through a bounded buffer) and ``staged=True`` (reads into a staging
  copy first; printed: its size, this rank's tensors in ``get_state_dict``,
  max over ranks). Also printed: the absolute peak RSS during the load and
  the peak before it (building the model and one training step): a resume
  that peaks above training is what runs out of memory.

Peak memory is the rise of each rank's peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs`` right before the phase) over its RSS before it:
what the phase itself costs. The max over ranks is printed, with wall times
(max over ranks, between barriers).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

IMPLS = ["fsdp_compose", "fsdp2"]


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _local_bytes(tree) -> int:
    """Bytes of this rank's tensors in a (nested) state dict: what a staging copy holds."""
    import torch
    from torch.distributed.tensor import DTensor
    if isinstance(tree, dict):
        return sum(_local_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_local_bytes(v) for v in tree)
    if isinstance(tree, DTensor):
        return tree.to_local().nbytes
    return tree.nbytes if isinstance(tree, torch.Tensor) else 0


def worker(impl: str, shape_name: str, path: str, per_item: bool = False,
           load_mode: str | None = None, fsdp_compose_path: str | None = None) -> None:
    if fsdp_compose_path:  # this version of the library (benchmarks.before_after)
        from benchmarks._launch import import_fsdp_compose_from
        import_fsdp_compose_from(fsdp_compose_path)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from benchmarks.models import SHAPES, build_model, make_data

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    shape = SHAPES[shape_name]
    model = build_model(shape, 0, torch.device("cpu"))
    if impl == "fsdp_compose":
        import fsdp_compose
        for b in model.blocks:
            fsdp_compose.fully_shard(b)
        fsdp_compose.fully_shard(model)
        get, set_ = fsdp_compose.get_state_dict, fsdp_compose.set_state_dict
    else:
        from torch.distributed.checkpoint import state_dict as dsd
        from torch.distributed.fsdp import fully_shard
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
        get, set_ = dsd.get_state_dict, dsd.set_state_dict
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = make_data(shape, 0, rank, 1, torch.device("cpu"))[0]
    (model(x) - y).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()

    train_peak = _rss_kib("VmHWM") / 1024  # building the model and one step

    def phase(fn):
        dist.barrier()
        before = _rss_kib("VmRSS")
        _reset_peak()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        dt = time.perf_counter() - t0
        return dt, (_rss_kib("VmHWM") - before) / 1024

    def save():
        msd, osd = get(model, opt)
        # per_item: one file per write item, so DCP's writer (which keeps every
        # tensor of a file until the file is done, and clones a view) holds one
        # box at a time
        writer = dcp.FileSystemWriter(path, single_file_per_rank=not per_item)
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer)

    def load():
        msd, osd = get(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
        set_(model, opt, model_state_dict=msd, optim_state_dict=osd)

    if load_mode is not None:  # load_checkpoint alone, first thing after the step
        import fsdp_compose
        before = _rss_kib("VmRSS") / 1024
        res = {"load": phase(lambda: fsdp_compose.load_checkpoint(
            model, opt, path, staged=load_mode == "staged")),
            "load_peak_mib": _rss_kib("VmHWM") / 1024, "train_peak_mib": train_peak,
            "rss_before_mib": before}
        if load_mode == "staged":
            res["staged_mib"] = _local_bytes(get(model, opt)) / 2**20
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, res)
        if rank == 0:
            print("RESULT " + json.dumps({"impl": impl, "ranks": out}), flush=True)
        dist.destroy_process_group()
        return

    held = []

    def take():  # the state dicts alone (ours: the conversion to FSDP2's form), kept alive
        held.append(get(model, opt))

    res = {"take": phase(take)}
    held.clear()
    res.update({"save": phase(save), "load": phase(load), "rss_mib": _rss_kib("VmRSS") / 1024})
    if impl == "fsdp_compose":  # which copy of the library ran (benchmarks.before_after)
        res["fsdp_compose_file"] = sys.modules["fsdp_compose"].__file__
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, res)
    if rank == 0:
        print("RESULT " + json.dumps({"impl": impl, "ranks": out}), flush=True)
    dist.destroy_process_group()


def launch(impl: str, shape: str, ranks: int, path: str, per_item: bool = False,
           load_mode: str | None = None, fsdp_compose_path: str | None = None) -> list[dict]:
    """One ``torchrun`` launch of :func:`worker`; every rank's result.
    ``fsdp_compose_path``: import fsdp_compose from that checkout (its top folder)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", "-m", "benchmarks.checkpoint",
           "--worker", impl, "--shape", shape, "--dir", path]
    cmd += ["--per-item-files"] if per_item else []
    cmd += ["--load-mode", load_mode] if load_mode else []
    cmd += ["--fsdp-compose-path", fsdp_compose_path] if fsdp_compose_path else []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        print(p.stdout[-3000:], p.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{impl} {load_mode or ''}: no result (exit {p.returncode})")
    return json.loads(line[len("RESULT "):])["ranks"]


def phases(ranks: list[dict]) -> dict:
    """A launch's take / save / load: (seconds, peak MiB), max over ranks."""
    return {k: (max(x[k][0] for x in ranks), max(x[k][1] for x in ranks))
            for k in ("take", "save", "load")}


def dir_mib(path: str) -> float:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="memory")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/fsdp_compose_ckpt_bench")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--per-item-files", action="store_true",
                    help="FileSystemWriter(single_file_per_rank=False): one file per tensor box")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--load-mode", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fsdp-compose-path", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.shape, args.dir, args.per_item_files, args.load_mode,
               args.fsdp_compose_path)
        return 0
    rows, safe = {}, {}

    def run(impl, path, load_mode=None):
        return launch(impl, args.shape, args.ranks, path, args.per_item_files, load_mode)

    for _rep in range(args.repeats):
        for impl in IMPLS:
            path = os.path.join(args.dir, impl)
            shutil.rmtree(path, ignore_errors=True)
            ranks = run(impl, path)
            size = dir_mib(path) * 2**20
            if impl == "fsdp_compose":  # load_checkpoint, both modes, fresh processes each
                for mode in ("in place", "staged"):
                    lr = run(impl, path, "staged" if mode == "staged" else "verified")
                    got = {"s": max(x["load"][0] for x in lr),
                           "peak": max(x["load"][1] for x in lr),
                           "abs": max(x["load_peak_mib"] for x in lr),
                           "train": max(x["train_peak_mib"] for x in lr),
                           "staged_mib": max(x.get("staged_mib", 0) for x in lr)}
                    print(f"{impl} load_checkpoint ({mode}): {got['s']:.2f} s, peak "
                          f"+{got['peak']:.0f} MiB (peak RSS {got['abs']:.0f} MiB during the "
                          f"load, {got['train']:.0f} MiB building + one step)"
                          + (f", staging copy {got['staged_mib']:.0f} MiB" if mode == "staged"
                             else ""), flush=True)
                    prev = safe.get(mode)
                    safe[mode] = got if prev is None else {k: min(prev[k], got[k]) for k in got}
            shutil.rmtree(path, ignore_errors=True)
            r = phases(ranks)
            r["size_mib"] = size / 2**20
            prev = rows.get(impl)
            rows[impl] = r if prev is None else {  # best of the repeats
                k: (min(prev[k][0], r[k][0]), min(prev[k][1], r[k][1])) if k != "size_mib"
                else r[k] for k in r}
    print(f"shape={args.shape} ranks={args.ranks} (max over ranks; peak = rise of peak RSS "
          "during the phase)")
    print(f"{'impl':<14}{'take s':>8}{'take peak MiB':>15}{'save s':>8}{'save peak MiB':>15}"
          f"{'load s':>8}{'load peak MiB':>15}{'ckpt MiB':>10}")
    for impl, r in rows.items():
        print(f"{impl:<14}{r['take'][0]:>8.2f}{r['take'][1]:>15.0f}"
              f"{r['save'][0]:>8.2f}{r['save'][1]:>15.0f}{r['load'][0]:>8.2f}"
              f"{r['load'][1]:>15.0f}{r['size_mib']:>10.0f}")
    for mode, got in safe.items():
        print(f"fsdp_compose load_checkpoint {mode + ':':<10}{got['s']:>6.2f} s, peak "
              f"+{got['peak']:.0f} MiB (absolute {got['abs']:.0f} MiB; training "
              f"{got['train']:.0f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
