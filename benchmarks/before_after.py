"""fsdp_compose before and after a change, with torch FSDP2, in one run.

    python -m benchmarks.before_after --ref main               # everything (peers, checkpoint)
    python -m benchmarks.before_after --ref main --part peers --shape overhead deep-small
    python -m benchmarks.before_after --ref main --part optim  # the optimizer step alone, cheaper
    python -m benchmarks.before_after --ref main --part checkpoint
    python -m benchmarks.before_after --ref main --quick       # a short sanity run

Three implementations, launch by launch in the same run: ``before``
(fsdp_compose at ``--ref``), ``after`` (fsdp_compose of this working tree,
uncommitted changes included) and ``FSDP2`` (``torch.distributed.fsdp``).
``--ref``'s ``fsdp_compose/`` is extracted by ``git archive`` into a temporary
folder (removed at the end); each rank imports the library from the folder its
variant names (``benchmarks._launch.import_fsdp_compose_from``), so the
benchmark code, model, data and torch are the same for both and only the
library differs. Launches interleave, one of each per repeat, the order
rotating (before, after, FSDP2; after, FSDP2, before; FSDP2, before, after;
...), so drift on a busy machine hits all three alike and none always takes
the same place. The tables show medians over the repeats and the ratios
after/before (with the range of the ratios within each repeat), after/FSDP2
and before/FSDP2.

Parts (``--part``, default ``all`` = peers and checkpoint):

``peers``
    ``benchmarks.peers``'s launches (fp32, 2 gloo ranks, its warmup and timed
    steps per shape), every shape by default: step time (median timed step of
    the slowest rank) and its process CPU time (all threads, gloo's too), peak
    RSS per rank, the losses (after against before: bit-identical or the
    largest relative difference), and then the optimizer step alone on the
    trained model (``optimizer.step()`` only, after one more forward and
    backward, ``--optim-steps`` times, max over ranks of each rank's median;
    wall time and the thread's CPU time, which other jobs on a busy machine
    change least): ``default``, the run's AdamW with torch's defaults (on CPU
    torch picks its for-loop implementation: foreach is for accelerators), and
    ``foreach``, ``AdamW(foreach=True)`` on the same parameters, alternating
    step by step. Issue 37's limit, after/before <= 1.03 for the step and the
    optimizer step, is marked on each time row (meaningful only for a full
    run).
``optim``
    The optimizer step alone, from launches with 1 warmup + 1 timed step
    (cheaper than ``peers``, which measures it too).
``checkpoint``
    ``benchmarks.checkpoint``'s launches (fresh ``torchrun`` processes each) on
    ``--ckpt-shape`` (the memory shape): take (``get_state_dict`` of model
    and AdamW, held), save (+ ``dcp.save``), load (+ ``dcp.load`` +
    ``set_state_dict``): wall time and the rise of peak RSS during the phase,
    max over ranks, and the checkpoint's size.

``--quick``: 2 repeats, fewer steps (peers: overhead 1 + 10, the others 1 + 1),
fewer optimizer steps, the checkpoint on ``deep-small``: a sanity check that
the run works (with ``--ref`` at this tree's code the ratios after/before are
noise around 1.0), not a measurement. Results also go to
``--out``/before_after.json.

On a busy 2-core machine (load 9-14 from other jobs) ``--quick`` with
before = after took 27 minutes; the medians' after/before ratios spread
0.49-1.15 in wall time but 0.94-1.04 in CPU time, which is what to read on a
busy machine. The peak RSS of ``deep-small`` moved by up to 300 MiB between
launches of the same code (its per-unit buffers come from glibc's heap, whose
reuse depends on thread timing), and so did fsdp_compose's save / load peak
rise in the checkpoint part (5-239 MiB; take: 222-234). Only a full run on a
quiet machine can hold a change to the 1.03 limit; a full run is an estimated
20 minutes there (about an hour at that load).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

from benchmarks import checkpoint, peers
from benchmarks.shapes import SHAPES

ROOT = peers.ROOT
VARIANTS = ["before", "after", "fsdp2"]
LABEL = {"before": "before", "after": "after", "fsdp2": "FSDP2"}
IMPL = {"before": "fsdp_compose", "after": "fsdp_compose", "fsdp2": "fsdp2"}
LIMIT = 1.03          # issue 37: after / before, step time and optimizer step
MIB_FLOOR = 16.0      # MiB: smaller peaks / rises get no ratio (noise)
PARTS = ["peers", "optim", "checkpoint", "all"]
OPTIM_STEPS = {"overhead": 30, "memory": 5, "deep": 5, "deep-small": 10}
QUICK_STEPS = {"overhead": (1, 10), "memory": (1, 1), "deep": (1, 1), "deep-small": (1, 1)}
QUICK_OPTIM_STEPS = {"overhead": 20, "memory": 3, "deep": 3, "deep-small": 3}
STEP_METRICS = [("step_ms", "step ms", ".2f", True), ("step_cpu_ms", "step CPU ms", ".2f", True)]
OPTIM_METRICS = [(f"optim_{k}{c}_ms", f"optim.step(){' CPU' if c else ''} ms, {k}", ".3f", True)
                 for k in ("default", "foreach") for c in ("", "_cpu")]
PEERS_METRICS = STEP_METRICS + OPTIM_METRICS + [
    ("peak_mib", "peak RSS MiB per rank", ".0f", False)]
CKPT_METRICS = [(f"{ph}_{k}", f"{ph} {u}", f, False) for ph in ("take", "save", "load")
                for k, u, f in (("s", "s", ".2f"), ("mib", "peak +MiB", ".0f"))] + [
                ("size_mib", "checkpoint MiB", ".0f", False)]


# ---------------------------------------------------------------- git
def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def default_ref() -> str:
    """The merge-base of HEAD and ``main`` (HEAD itself on main)."""
    try:
        return _git("merge-base", "HEAD", "main")
    except subprocess.CalledProcessError:
        return "main"


def extract(commit: str, dest: str) -> str:
    """``commit``'s ``fsdp_compose/`` into ``dest`` (``git archive``); ``dest``."""
    p = subprocess.Popen(["git", "-C", ROOT, "archive", "--format=tar", commit, "fsdp_compose"],
                         stdout=subprocess.PIPE)
    with tarfile.open(fileobj=p.stdout, mode="r|") as tf:
        try:
            tf.extractall(dest, filter="data")
        except TypeError:  # (a Python without extraction filters; git's own archive)
            tf.extractall(dest)
    if p.wait() != 0:
        raise RuntimeError(f"git archive {commit} fsdp_compose failed (exit {p.returncode})")
    return dest


def compile_sources(root: str) -> None:
    """Byte-compile ``root``'s fsdp_compose/ up front, so that neither version's
    first ranks compile it as they import it (an allocation pattern the other's
    would not have)."""
    import compileall
    compileall.compile_dir(os.path.join(root, "fsdp_compose"), quiet=1)


def describe(commit: str) -> dict:
    """The two versions, in words, and whether their fsdp_compose/ is the same."""
    changed = subprocess.run(["git", "-C", ROOT, "diff", "--quiet", commit, "--",
                              "fsdp_compose"]).returncode != 0
    untracked = _git("ls-files", "--others", "--exclude-standard", "fsdp_compose")
    dirty = _git("status", "--porcelain", "--", "fsdp_compose")
    head = _git("rev-parse", "--short=10", "HEAD")
    return {"before": f"{_git('rev-parse', '--short=10', commit)} "
                      f"({_git('log', '-1', '--format=%s', commit)[:60]})",
            "after": f"working tree at {head}" + (" + uncommitted changes" if dirty else ""),
            "same_code": not changed and not untracked}


# ---------------------------------------------------------------- launches
def order(rep: int) -> list[str]:
    """The variants' launch order in repeat ``rep``: one of each, rotating."""
    k = rep % len(VARIANTS)
    return VARIANTS[k:] + VARIANTS[:k]


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _check_source(variant: str, file: str | None, paths: dict) -> None:
    want = paths.get(variant)
    if want and not (file and os.path.realpath(file).startswith(os.path.realpath(want) + os.sep)):
        raise RuntimeError(f"{variant}: fsdp_compose came from {file}, not from {want}")


def peers_launch(variant: str, shape_name: str, args, paths: dict, optim_only: bool) -> dict:
    """One ``benchmarks.peers`` launch of ``variant``: the numbers the tables use."""
    shape = SHAPES[shape_name]
    if optim_only:
        warmup, steps = 1, 1
    elif args.quick:
        warmup, steps = QUICK_STEPS[shape_name]
    else:
        warmup, steps = shape.warmup, shape.steps
    n_optim = args.optim_steps or (QUICK_OPTIM_STEPS if args.quick else OPTIM_STEPS)[shape_name]
    cfg = {"impl": IMPL[variant], "shape": peers._shape_dict(shape), "setting": "fp32",
           "seed": 0, "steps": steps, "warmup": warmup, "threads": 1,
           "pg_timeout": args.timeout, "out": args.out, "compile": None,
           "compile_backend": "inductor", "optim_steps": n_optim}
    if paths.get(variant):
        cfg["fsdp_compose_path"] = paths[variant]
    ranks = peers.launch(cfg, args.world_size, args.timeout, preload=peers.PRELOAD_FROM_PATH)
    for r in ranks:
        _check_source(variant, r.get("fsdp_compose_file"), paths)
    L = peers.summarise_launch(ranks)
    rec = {"step_ms": L["step_ms"], "step_cpu_ms": L["phase_ms"][3], "peak_mib": L["peak_mib"],
           "losses": L["losses"], "warmup": warmup, "steps": steps, "optim_steps": n_optim}
    for k in ("default", "foreach"):
        rec[f"optim_{k}_ms"] = max(_median(r["optim_step_s"][k]) for r in ranks) * 1e3
        rec[f"optim_{k}_cpu_ms"] = max(_median(r["optim_step_cpu_s"][k]) for r in ranks) * 1e3
    return rec


def ckpt_launch(variant: str, args, paths: dict, tmpdir: str) -> dict:
    """One ``benchmarks.checkpoint`` launch of ``variant`` (take, save, load)."""
    path = os.path.join(tmpdir, f"ckpt_{variant}")
    shutil.rmtree(path, ignore_errors=True)
    try:
        ranks = checkpoint.launch(IMPL[variant], args.ckpt_shape, args.world_size, path,
                                  fsdp_compose_path=paths.get(variant))
        size = checkpoint.dir_mib(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    for r in ranks:
        _check_source(variant, r.get("fsdp_compose_file"), paths)
    rec = {"size_mib": size}
    for ph, (s, mib) in checkpoint.phases(ranks).items():
        rec[f"{ph}_s"], rec[f"{ph}_mib"] = s, mib
    return rec


# ---------------------------------------------------------------- report
def _ratio(a: float, b: float, floor: float) -> float | None:
    return a / b if b >= floor and a == a and b == b else None  # (nan != nan)


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}"


def table(title: str, runs: dict, metrics: list, limit: bool = True) -> list[str]:
    """Rows of ``metrics`` for the variants' launches ``runs[variant] = [record, ...]``:
    medians, after/before (and the range of the per-repeat ratios), after/FSDP2,
    before/FSDP2. ``limit``: mark after/before against LIMIT on time rows."""
    head = (f"   {'':<30} {'before':>10} {'after':>10} {'FSDP2':>10}  "
            f"{'after/before [per repeat]':<31} {'after/FSDP2':>11} {'before/FSDP2':>12}")
    lines = [title, head, "   " + "-" * (len(head) - 3)]
    for key, label, fmt, timed in metrics:
        vals = {v: [rec[key] for rec in runs.get(v, []) if key in rec] for v in VARIANTS}
        if not any(vals.values()):
            continue
        med = {v: _median(vals[v]) for v in VARIANTS}
        # no ratio over a rise of peak RSS within allocator noise (FSDP2's +0..4 MiB)
        floor = 1e-9 if timed or key.endswith("_s") else MIB_FLOOR
        ab = _ratio(med["after"], med["before"], floor)
        pairs = [a / b for a, b in zip(vals["after"], vals["before"]) if b >= floor]
        cell = _fmt_ratio(ab)
        if pairs and len(pairs) > 1:
            cell += f" [{min(pairs):.2f}..{max(pairs):.2f}]"
        if limit and timed and ab is not None:
            cell += " ok" if ab <= LIMIT else f" OVER {LIMIT}"
        nums = " ".join(f"{med[v]:>10{fmt}}" if vals[v] else f"{'-':>10}" for v in VARIANTS)
        lines.append(f"   {label:<30} {nums}  {cell:<31} "
                     f"{_fmt_ratio(_ratio(med['after'], med['fsdp2'], floor)):>11} "
                     f"{_fmt_ratio(_ratio(med['before'], med['fsdp2'], floor)):>12}")
    return lines


def _loss_line(runs: dict) -> str | None:
    first = {v: runs[v][0]["losses"] for v in VARIANTS if runs.get(v)}
    if "before" not in first or "after" not in first:
        return None
    b, a = first["before"], first["after"]
    same = "bit-identical" if a == b else f"max rel diff {peers.max_rel_diff(a, b):.1e}"
    line = f"   losses, after vs before: {same} over {len(a)} steps"
    if "fsdp2" in first:
        line += f"; after vs FSDP2: max rel diff {peers.max_rel_diff(a, first['fsdp2']):.1e}"
    return line


def report(results: dict) -> str:
    """Every table of a run (``results`` as written to before_after.json)."""
    m = results["meta"]
    out = [f"== before: fsdp_compose at {m['before']}\n   after:  fsdp_compose, {m['after']}\n"
           f"   FSDP2:  torch {m.get('torch') or '?'} torch.distributed.fsdp.fully_shard\n"
           f"   {m['world']} gloo rank(s), 1 thread each, {m['repeats']} repeat(s), launches "
           f"interleaved (order rotating){', --quick' if m.get('quick') else ''}"]
    if m.get("same_code"):
        out.append("   (before and after are the same code: their ratios show the noise)")
    for part, metrics in (("peers", PEERS_METRICS), ("optim", OPTIM_METRICS)):
        for shape_name, runs in results.get(part, {}).items():
            rec = next(iter(runs.get("after") or runs.get("before") or runs["fsdp2"]))
            what = ("the optimizer step alone" if part == "optim" else
                    f"{rec['warmup']} warmup + {rec['steps']} timed steps")
            title = (f"\n== {part} '{shape_name}': {SHAPES[shape_name].what}\n   {what}; "
                     f"optimizer step: {rec['optim_steps']} steps each (AdamW)")
            lines = table(title, runs, metrics)
            if part == "peers" and (loss := _loss_line(runs)):
                lines.append(loss)
            out.append("\n".join(lines))
    if results.get("checkpoint"):
        title = (f"\n== state dict on '{m['ckpt_shape']}' (fsdp_compose: get_state_dict / "
                 "set_state_dict; FSDP2: torch's), DCP, AdamW after one step\n"
                 "   seconds and rise of peak RSS during the phase, max over ranks")
        out.append("\n".join(table(title, results["checkpoint"], CKPT_METRICS, limit=False)))
    rows = []
    for part in ("peers", "optim"):
        for shape_name, runs in results.get(part, {}).items():
            for key, label, _, _ in (STEP_METRICS + OPTIM_METRICS if part == "peers"
                                     else OPTIM_METRICS):
                a = [r[key] for r in runs.get("after", []) if key in r]
                b = [r[key] for r in runs.get("before", []) if key in r]
                r = _ratio(_median(a), _median(b), 1e-9) if a and b else None
                if r is not None:
                    rows.append(f"   {part:<6} {shape_name:<11} {label:<30} {r:>6.3f} "
                                f"{'ok' if r <= LIMIT else 'OVER'}")
    if rows:
        out.append(f"\n== after / before (limit {LIMIT}: medians"
                   + (", --quick: too few steps to hold anyone to it)" if m.get("quick") else ")")
                   + "\n" + "\n".join(rows))
    return "\n".join(out)


# ---------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.before_after",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--ref", default=None,
                   help="git ref of 'before' (default: the merge-base of HEAD and main)")
    p.add_argument("--part", choices=PARTS, default="all",
                   help="peers (step time, optimizer step, peak RSS), optim (the optimizer "
                        "step alone), checkpoint (take / save / load), all (default) = "
                        "peers + checkpoint")
    p.add_argument("--quick", action="store_true",
                   help="a short sanity run: 2 repeats, few steps, checkpoint on deep-small")
    p.add_argument("--shape", nargs="+", choices=list(SHAPES), default=list(SHAPES),
                   help="peers / optim shapes (default: all)")
    p.add_argument("--ckpt-shape", choices=list(SHAPES), default=None,
                   help="checkpoint shape (default: memory; --quick: deep-small)")
    p.add_argument("--repeats", type=int, default=None,
                   help="launches per variant (default 3; --quick 2)")
    p.add_argument("--optim-steps", type=int, default=None,
                   help="timed optimizer steps per launch (default per shape: " + ", ".join(
                       f"{k} {v}" for k, v in OPTIM_STEPS.items()) + "; fewer with --quick)")
    p.add_argument("--world-size", type=int, default=2, help="gloo CPU ranks (default 2)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per launch (default 600)")
    p.add_argument("--out", default=peers.DEFAULT_OUT,
                   help="folder for before_after.json (default: benchmarks/out)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.ckpt_shape = args.ckpt_shape or ("deep-small" if args.quick else "memory")
    args.out = os.path.abspath(args.out)
    parts = ["peers", "checkpoint"] if args.part == "all" else [args.part]
    ref = args.ref or default_ref()
    try:
        commit = _git("rev-parse", "--verify", f"{ref}^{{commit}}")
    except subprocess.CalledProcessError:
        sys.exit(f"before_after: no commit {ref!r} in {ROOT}")
    t0 = time.monotonic()
    names = describe(commit)
    results = {"meta": {"ref": ref, "commit": commit, "before": names["before"],
                        "after": names["after"], "same_code": names["same_code"],
                        "world": args.world_size, "repeats": args.repeats, "quick": args.quick,
                        "ckpt_shape": args.ckpt_shape, "python": platform.python_version(),
                        "cpus": os.cpu_count(), "torch": None}}
    tmp = tempfile.mkdtemp(prefix="fsdp_compose_before_")
    try:
        paths = {"before": extract(commit, tmp), "after": ROOT}
        for root in paths.values():
            compile_sources(root)
        print(f"before: {names['before']} (extracted to {tmp})\nafter:  {names['after']}",
              flush=True)
        for part in parts:
            if part in ("peers", "optim"):
                res = results[part] = {}
                for shape_name in args.shape:
                    runs = res[shape_name] = {v: [] for v in VARIANTS}
                    for rep in range(args.repeats):
                        for v in order(rep):
                            t = time.monotonic()
                            rec = peers_launch(v, shape_name, args, paths, part == "optim")
                            runs[v].append(rec)
                            print(f"[{part} {shape_name} {rep + 1}/{args.repeats}] {LABEL[v]:<7}"
                                  f"{rec['step_ms']:10.2f} ms/step (CPU {rec['step_cpu_ms']:.2f})"
                                  f"  optim.step() {rec['optim_default_ms']:.3f} (CPU "
                                  f"{rec['optim_default_cpu_ms']:.3f}) / foreach "
                                  f"{rec['optim_foreach_ms']:.3f} (CPU "
                                  f"{rec['optim_foreach_cpu_ms']:.3f}) ms  peak "
                                  f"{rec['peak_mib']:.0f} MiB  ({time.monotonic() - t:.1f} s)",
                                  flush=True)
            else:
                runs = results["checkpoint"] = {v: [] for v in VARIANTS}
                for rep in range(args.repeats):
                    for v in order(rep):
                        t = time.monotonic()
                        rec = ckpt_launch(v, args, paths, tmp)
                        runs[v].append(rec)
                        print(f"[checkpoint {args.ckpt_shape} {rep + 1}/{args.repeats}] "
                              f"{LABEL[v]:<7} take {rec['take_s']:.2f} s +{rec['take_mib']:.0f}"
                              f" MiB, save {rec['save_s']:.2f} s +{rec['save_mib']:.0f} MiB, "
                              f"load {rec['load_s']:.2f} s +{rec['load_mib']:.0f} MiB "
                              f"({time.monotonic() - t:.1f} s)", flush=True)
    except peers.LaunchError as e:
        print(f"\nbefore_after: {e}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        import importlib.metadata
        results["meta"]["torch"] = importlib.metadata.version("torch")
    except Exception:  # noqa: BLE001 (a name in the header only)
        pass
    results["meta"]["runtime_s"] = time.monotonic() - t0
    print()
    print(report(results))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "before_after.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {path}\ntotal runtime {results['meta']['runtime_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
