"""Per-rank timeline of training steps: compute, all-gather and reduce-scatter per unit.

    python -m tools.timeline                                  # demo Llama, 2 gloo ranks
    python -m tools.timeline --dim 512 --layers 6 --world-size 2 --steps 2 --out benchmarks/out

Runs a few training steps on gloo CPU ranks (the same model and options as
``python -m tools.plan``) under ``torch.profiler`` and writes, per rank, the
Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing) and a
PNG with one row per unit (root at the top, in forward order) and three
lanes in each row:

- compute: the unit's forward (from its pre-forward to its post-forward,
  its inner units' time excluded) and backward (from its pre-backward to its
  post-backward); in grey, the time inside the unit's own hooks, which
  includes waiting for its all-gather;
- all-gather: when each of the unit's all-gathers ran (gloo's worker
  threads: one broadcast per rank); a bucket is drawn on its first unit;
- reduce-scatter: when its reduce-scatter ran (a bucket: on its last unit;
  a small one over 2 ranks is a point-to-point exchange: from its receive
  posted to the data landed).

A last row shows the optimizer step. Overlap, or its absence, is visible at
a glance; the command also prints, per rank, how much of the collectives'
time ran under compute.

Where the times come from: the profiler labels the library emits
(``fsdp_compose::<phase> (<unit>)``), zero-length marks this tool adds at
every schedule event (``fsdp_compose.schedule::<event> (<unit>)``, from the
same seam as ``fsdp_compose.record_schedule``), the c10d ops that issue each
collective on the main thread and the ``gloo:*`` events on gloo's threads
(matched to the issues in order; a receive's ``gloo:recv`` event is on the
main thread). gloo CPU ranks only: on CUDA the profiler
shows NCCL kernels instead, not read here.

For a CUDA trace (``python -m benchmarks.gpu_check``), ``stream_spans`` /
``plot_streams`` draw the device side instead: one lane per CUDA stream
(kernels, copies, memsets), and ``stream_overlap`` says how much of each side
stream's work ran under the compute stream's.
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import sys

_LABEL = re.compile(r"^fsdp_compose::(\w+) \((.*)\)$")
_MARK = re.compile(r"^fsdp_compose\.schedule::(\w+) \((.*)\)$")
MARK_PREFIX = "fsdp_compose.schedule::"


class _Marks:
    """A ``record_schedule`` sink that leaves a zero-length profiler event
    at every schedule event."""

    def __enter__(self):
        from fsdp_compose._base import _common
        self._prev, _common._trace = _common._trace, self
        return self

    def __exit__(self, *exc):
        from fsdp_compose._base import _common
        _common._trace = self._prev

    def append(self, item: tuple) -> None:
        import torch
        event, fqn, _ = item
        with torch.profiler.record_function(f"{MARK_PREFIX}{event} ({fqn})"):
            pass


def profile_rank(rank: int, world: int, cfg, steps: int, warmup: int, out: str) -> str:
    """On a rank: ``warmup`` steps, then ``steps`` profiled; the trace's path."""
    from torch.profiler import ProfilerActivity, profile, record_function
    from tools._measure import setup, train_step
    model, _, optim, inputs = setup(cfg, rank, world)
    for _ in range(warmup):
        train_step(model, optim, inputs)
    with profile(activities=[ProfilerActivity.CPU]) as prof, _Marks():
        for i in range(steps):
            with record_function(f"train_step {i}"):
                train_step(model, optim, inputs)
    path = os.path.join(out, f"timeline_rank{rank}.json")
    prof.export_chrome_trace(path)
    return path


# ------------------------------------------------------------------ reading
def _spans(trace_path: str) -> dict:
    """The trace as what the plot needs: per unit, compute / hook / all-gather /
    reduce-scatter intervals (µs), the optimizer's, and the unit order."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    main = next(e["tid"] for e in events if _LABEL.match(e["name"]))
    mine = sorted((e for e in events if e["tid"] == main), key=lambda e: e["ts"])
    labels = [(e["ts"], e["ts"] + e["dur"], *_LABEL.match(e["name"]).groups())
              for e in mine if _LABEL.match(e["name"])]
    marks = [(e["ts"], *_MARK.match(e["name"]).groups()) for e in mine if _MARK.match(e["name"])]
    out = {"compute": {}, "hooks": {}, "all_gather": {}, "reduce_scatter": {}, "order": [],
           "optimizer": [(e["ts"], e["ts"] + e["dur"]) for e in mine
                         if e["name"].startswith("Optimizer.step#")],
           "steps": [e["ts"] for e in mine if e["name"].startswith("train_step ")]}

    def add(kind: str, unit: str, a: float, b: float) -> None:
        if b > a:
            out[kind].setdefault(unit, []).append((a, b))

    for a, b, phase, unit in labels:
        if phase in ("pre_forward", "pre_backward"):
            add("hooks", unit, a, b)
        if phase == "pre_forward" and unit not in out["order"]:
            out["order"].append(unit)
    # compute: a stack of units, pushed when a pre-forward / pre-backward hook
    # ends and popped at the unit's post-forward / post-backward mark
    points = sorted([(b, "push", u) for a, b, ph, u in labels if ph in ("pre_forward",
                                                                         "pre_backward")]
                    + [(t, "pop", u) for t, ev, u in marks if ev in ("post_forward",
                                                                      "post_backward")])
    busy = sorted((a, b) for a, b, _, _ in labels)  # inside a hook: not compute
    stack, at = [], None
    for t, what, unit in points:
        if stack and at is not None:
            for a, b in _minus((at, t), busy):
                add("compute", stack[-1], a, b)
        if what == "push":
            stack.append(unit)
        elif unit in stack:
            stack.remove(unit)
        at = t
    # collectives: issues on the main thread, in order, matched to gloo's runs
    ag_marks = [(t, u) for t, ev, u in marks if ev == "all_gather"]
    for kind, issue, run in (("all_gather", "c10d::broadcast_", "gloo:broadcast"),
                             ("reduce_scatter", "c10d::allreduce_", "gloo:all_reduce")):
        issues = [e["ts"] for e in mine if e["name"] == issue]
        runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                      if e["name"] == run and e["tid"] != main)
        for ts, (a, b) in zip(issues, runs):
            if any(ph == "used_flags" and x <= ts <= y for x, y, ph, _ in labels):
                continue  # a reduction's used-flags all-reduce, not a collective of its own
            unit = _owner(ts, labels, kind, ag_marks)
            if unit is not None:
                add(kind, unit, a, b)
    # a small reduce-scatter over 2 ranks is a point-to-point exchange ([Note:
    # gloo collectives] in fsdp_compose/_comm/_gloo.py): drawn from its
    # receive's gloo:recv event (posted -> landed, on the main thread)
    issues = [e["ts"] for e in mine if e["name"] == "c10d::recv_"]
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "gloo:recv")
    for ts, (a, b) in zip(issues, runs):
        unit = _owner(ts, labels, "reduce_scatter", ag_marks)
        if unit is not None:
            add("reduce_scatter", unit, a, b)
    return out


def _owner(ts: float, labels: list, kind: str, ag_marks: list) -> str | None:
    """The unit a collective issued at ``ts`` belongs to: the label of that
    kind around it (buckets, reduce-scatters), else (an all-gather issued by
    a unit's own unshard) the unit of the next all-gather schedule event."""
    inside = [(a, u) for a, b, ph, u in labels if ph == kind and a <= ts <= b]
    if inside:
        return max(inside)[1]
    if kind == "all_gather":
        i = bisect.bisect_left(ag_marks, (ts, ""))
        return ag_marks[i][1] if i < len(ag_marks) else None
    return None


def _minus(span: tuple, busy: list) -> list:
    """``span`` without the intervals in ``busy`` (sorted)."""
    a, b = span
    out = []
    for x, y in busy:
        if y <= a or x >= b:
            continue
        if x > a:
            out.append((a, x))
        a = max(a, y)
    if b > a:
        out.append((a, b))
    return out


def _union_len(intervals: list) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def overlap(spans: dict, kind: str) -> tuple[float, float]:
    """(ms of ``kind`` collectives, the share of it that ran under compute)."""
    coll = [iv for ivs in spans[kind].values() for iv in ivs]
    compute = [iv for ivs in spans["compute"].values() for iv in ivs]
    total = _union_len(coll)
    if not total:
        return 0.0, 0.0
    both = _union_len(coll) + _union_len(compute) - _union_len(coll + compute)
    return total / 1e3, both / total


# ----------------------------------------------------------------- drawing
COLORS = {"compute": "#4477aa", "hooks": "#bbbbbb", "all_gather": "#ee7733",
          "reduce_scatter": "#228833", "optimizer": "#aa3377"}
LANES = {"compute": 0.0, "hooks": 0.0, "all_gather": 0.3, "reduce_scatter": 0.6}


def plot(spans: dict, title: str, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    units = spans["order"] + [u for k in ("compute", "all_gather", "reduce_scatter")
                              for u in spans[k] if u not in spans["order"]]
    units = list(dict.fromkeys(units))
    every = [iv for k in ("compute", "hooks", "all_gather", "reduce_scatter")
             for ivs in spans[k].values() for iv in ivs] + spans["optimizer"]
    t0 = min([a for a, _ in every] + spans["steps"])
    rows = len(units) + 1
    fig, ax = plt.subplots(figsize=(14, 0.55 * rows + 1.6))
    for i, unit in enumerate(units):
        y = rows - 1 - i
        for kind in ("compute", "hooks", "all_gather", "reduce_scatter"):
            ivs = [((a - t0) / 1e3, (b - a) / 1e3) for a, b in spans[kind].get(unit, [])]
            if ivs:
                ax.broken_barh(ivs, (y + LANES[kind], 0.28), facecolors=COLORS[kind])
    ivs = [((a - t0) / 1e3, (b - a) / 1e3) for a, b in spans["optimizer"]]
    ax.broken_barh(ivs, (0.3, 0.28), facecolors=COLORS["optimizer"])
    for i, t in enumerate(spans["steps"]):
        x = (t - t0) / 1e3
        ax.axvline(x, color="black", lw=0.6, ls="--")
        ax.text(x, rows - 0.05, f" step {i + 1}", fontsize=8, va="top")
    ax.set_yticks([rows - 1 - i + 0.45 for i in range(len(units))] + [0.45])
    ax.set_yticklabels([u or "<root>" for u in units] + ["optimizer"])
    ax.set_ylim(-0.1, rows)
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(handles=[Patch(color=COLORS[k], label=k.replace("_", "-")) for k in
                       ("compute", "hooks", "all_gather", "reduce_scatter", "optimizer")],
              loc="upper center", bbox_to_anchor=(0.5, -0.5 / rows - 0.08), ncol=5,
              fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------- CUDA streams (GPU)
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def stream_spans(trace_path: str) -> dict:
    """The device side of a CUDA profiler trace, per stream: ``{"streams":
    {name: [(start, end) µs, ...]}, "copies": {name: [...]} (the copies and
    memsets among them), "kinds": {name: {"kernel": n, "gpu_memcpy": n, ...}},
    "steps": [start µs of each ``train_step`` label, on the device if the
    trace has it there]}``. The busiest
    stream is named ``compute (stream N)``, the others ``stream N`` (the trace
    numbers streams as CUPTI does, not as torch.cuda.Stream does). Empty
    ``streams`` for a CPU-only trace. Reads ``.json`` or ``.json.gz``."""
    import gzip
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    by_stream: dict = {}
    copies: dict = {}
    kinds: dict = {}
    for e in events:
        if e.get("cat") not in DEVICE_CATS:
            continue
        sid = (e.get("args") or {}).get("stream", e.get("tid"))
        iv = (e["ts"], e["ts"] + e["dur"])
        by_stream.setdefault(sid, []).append(iv)
        if e["cat"] != "kernel":
            copies.setdefault(sid, []).append(iv)
        k = kinds.setdefault(sid, {})
        k[e["cat"]] = k.get(e["cat"], 0) + 1
    busiest = max(by_stream, key=lambda s: _union_len(by_stream[s]), default=None)
    name = {s: (f"compute (stream {s})" if s == busiest else f"stream {s}") for s in by_stream}
    steps = [e for e in events if e["name"].startswith("train_step ")]
    on_device = [e for e in steps if e.get("cat") == "gpu_user_annotation"]  # (CUDA traces)
    return {"streams": {name[s]: sorted(v) for s, v in sorted(by_stream.items(),
                                                            key=lambda kv: kv[0] != busiest)},
            "copies": {name[s]: sorted(v) for s, v in copies.items()},
            "kinds": {name[s]: k for s, k in kinds.items()},
            "steps": sorted(e["ts"] for e in (on_device or steps))}


def stream_overlap(spans: dict) -> dict:
    """Per side stream: (ms busy, the share of it that ran while the compute
    stream was busy too)."""
    streams = spans["streams"]
    compute = next((v for k, v in streams.items() if k.startswith("compute")), [])
    out = {}
    for name, ivs in streams.items():
        if ivs is compute:
            continue
        total = _union_len(ivs)
        both = total + _union_len(compute) - _union_len(ivs + compute)
        out[name] = (total / 1e3, both / total if total else 0.0)
    return out


def plot_streams(spans: dict, title: str, path: str) -> str:
    """One lane per CUDA stream (kernels, copies, memsets), step starts dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    streams = spans["streams"]
    every = [a for ivs in streams.values() for a, _ in ivs] + spans["steps"]
    t0 = min(every)
    fig, ax = plt.subplots(figsize=(14, 0.6 * len(streams) + 1.6))
    for i, (name, ivs) in enumerate(streams.items()):
        y = len(streams) - 1 - i
        ax.broken_barh([((a - t0) / 1e3, (b - a) / 1e3) for a, b in ivs], (y + 0.1, 0.8),
                       facecolors=COLORS["compute"] if name.startswith("compute")
                       else COLORS["reduce_scatter"])
        copies = spans.get("copies", {}).get(name, [])
        if copies:  # copies and memsets drawn over the lane's kernels
            ax.broken_barh([((a - t0) / 1e3, (b - a) / 1e3) for a, b in copies],
                           (y + 0.1, 0.8), facecolors=COLORS["all_gather"])
    for i, t in enumerate(spans["steps"]):
        x = (t - t0) / 1e3
        ax.axvline(x, color="black", lw=0.6, ls="--")
        ax.text(x, len(streams) - 0.05, f" step {i + 1}", fontsize=8, va="top")
    ax.set_yticks([len(streams) - 1 - i + 0.5 for i in range(len(streams))])
    ax.set_yticklabels(list(streams))
    ax.set_ylim(0, len(streams))
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(handles=[Patch(color=COLORS["compute"], label="compute-stream kernels"),
                       Patch(color=COLORS["reduce_scatter"], label="side-stream kernels"),
                       Patch(color=COLORS["all_gather"], label="copies / memsets")],
              loc="upper center", bbox_to_anchor=(0.5, -0.6 / len(streams) - 0.1), ncol=3,
              fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    from tools.plan import add_config_arguments, config_from_args, describe_settings
    p = argparse.ArgumentParser(prog="python -m tools.timeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(p)
    p.add_argument("--world-size", type=int, default=2, help="gloo CPU ranks")
    p.add_argument("--steps", type=int, default=2, help="profiled steps")
    p.add_argument("--warmup", type=int, default=2, help="steps before profiling")
    p.add_argument("--out", default=os.path.join("benchmarks", "out", "timeline"),
                   help="folder for the traces and PNGs")
    args = p.parse_args(argv)
    if args.world_size < 2 or args.hsdp != 1 or args.steps < 1 or args.warmup < 0:
        raise SystemExit("timeline: --world-size >= 2 (a collective to show), no --hsdp, "
                         "--steps >= 1, --warmup >= 0")
    cfg = config_from_args(args, [args.world_size], "gloo")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("timeline: needs matplotlib (pip install matplotlib, or the "
                         "package's [bench] extra)") from None
    from tools._measure import launch
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    traces = launch(cfg, args.world_size, fn=profile_rank, args=(args.steps, args.warmup, out))
    for rank, trace in enumerate(traces):
        spans = _spans(trace)
        title = (f"rank {rank} of {args.world_size} (gloo), {args.steps} steps after "
                 f"{args.warmup} warmup\n{describe_settings(cfg)}")
        png = plot(spans, title, os.path.join(out, f"timeline_rank{rank}.png"))
        ag, ag_hidden = overlap(spans, "all_gather")
        rs, rs_hidden = overlap(spans, "reduce_scatter")
        print(f"rank {rank}: {png}\n        {trace}\n        all-gathers {ag:.1f} ms, "
              f"{ag_hidden:.0%} under compute; reduce-scatters {rs:.1f} ms, "
              f"{rs_hidden:.0%} under compute")
    return 0


if __name__ == "__main__":
    sys.exit(main())
