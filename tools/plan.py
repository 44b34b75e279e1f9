"""Plan a run before renting it: per-rank memory and traffic of a sharded model,
from the model alone.

    python -m tools.plan --model demo --dim 4096 --layers 32 --vocab 32000 --world-size 8 1024
    python -m tools.plan --model demo --world-size 2 4 --measure      # and check against real runs
    python -m tools.plan --model "benchmarks.models:stack('deep')" --world-size 2 --json

The model is built on the meta device and sharded by ``fully_shard`` (each
block, then the root) over torch's fake process group, as rank 0 of N: the
flat groups, layouts and units are the library's own, and a 4096-rank plan of
a 7B-shaped model takes seconds on one CPU. For each world size it prints:

- params / grads / optim: the bytes of the most-loaded rank's shards, its
  gradient shards after a backward, and its optimizer state after a step
  (ranks differ: pieces are whole rows, or whole tensors with
  ``--shard-granularity tensor``);
- unsharded peak, forward / backward: the most bytes of unsharded parameters
  alive at once in forward, and of unsharded parameters plus unsharded
  gradients (flat gradients, reduce-scatter inputs in flight) in backward,
  given the prefetch depth and the buckets (tools/_planner.py, [Note:
  planner schedule]);
- all-gather / reduce-scatter (and, with ``--hsdp``, all-reduce) bytes and
  calls per step, counted as ``fsdp_compose.comm_stats()`` counts them;
- vs total/N and padding: the most-loaded rank's parameter bytes against
  the parameter bytes / N, and the padding of every unsharded flat (bytes,
  percent of the parameters); then, where HSDP over a smaller shard group
  would move fewer bytes (a rank's share of a unit is a row or less, so the
  layouts pad), a warning that proposes the shard-group size
  (``_planner.hsdp_proposal``). ``--row-layout equal`` plans the equal-chunk
  row layout of before uneven pieces (docs/design.md, "Row-granular shards
  at scale").

``--measure`` (world sizes <= 4) also runs 3 real training steps on gloo with
the same settings and prints predicted against measured; it exits 1 if any
figure differs by more than 10%.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import fnmatch
import importlib
import json
import sys
import time
from dataclasses import dataclass

GIB = 2**30
TOLERANCE = 0.10  # --measure: the largest relative difference accepted


@dataclass(frozen=True)
class PlanConfig:
    """Everything a plan (and a measured run) depends on; picklable."""

    model: str = "demo"                 # "demo" or "pkg.module:function" / "...:function(args)"
    dim: int = 128                      # demo only
    layers: int = 4
    vocab: int = 128
    units: tuple[str, ...] = ()         # class names or FQN patterns; () = each block
    mp: str = "fp32"                    # "fp32" | "bf16" (param bf16, reduce fp32)
    offload: bool = False
    reshard_after_forward: bool | int | None = None
    hsdp: int = 1                       # replicas (1: plain FSDP)
    optimizer: str = "adamw"
    shard_granularity: str = "row"
    row_layout: str = "auto"            # "auto" | "equal" | "uneven": see _layout.FORCE_EVEN
    prefetch_depth: int = 1
    bucket_bytes: int = 1 << 20         # all-gather and reduce-scatter buckets
    schedule: str = "cuda"              # the backward schedule predicted: "cuda" | "gloo"
    # the collectives' backend: uneven pieces are padded to one equal-size
    # collective on every backend but gloo; None: gloo with the gloo schedule
    backend: str | None = None
    # the communication estimate's links: (name, latency s, bus bandwidth B/s)
    links: tuple = (("nvlink", 10e-6, 300e9), ("ib", 25e-6, 40e9))

    @property
    def pads(self) -> bool:
        return (self.backend or ("gloo" if self.schedule == "gloo" else "nccl")) != "gloo"


# ------------------------------------------------------------------- model
def _call_spec(spec: str):
    """``pkg.module:function`` or ``pkg.module:function(literal args)`` -> (fn, args, kwargs)."""
    mod_name, _, call = spec.partition(":")
    if not mod_name or not call:
        raise SystemExit(f"plan: --model must be 'demo' or 'pkg.module:function', got {spec!r}")
    node = ast.parse(call, mode="eval").body
    if isinstance(node, ast.Call):
        name = ast.unparse(node.func)
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    else:
        name, args, kwargs = call, [], {}
    fn = importlib.import_module(mod_name)
    for part in name.split("."):
        fn = getattr(fn, part)
    return fn, args, kwargs


def build_model(cfg: PlanConfig):
    """The model, on the current default device (``with torch.device("meta")``)."""
    import torch.nn as nn
    if cfg.model == "demo":
        from fsdp_compose.demo.model import ModelArgs, Transformer
        heads = max(1, cfg.dim // 32)
        return Transformer(ModelArgs(vocab_size=cfg.vocab, dim=cfg.dim, n_layers=cfg.layers,
                                     n_heads=heads, max_seq_len=64))
    fn, args, kwargs = _call_spec(cfg.model)
    model = fn(*args, **kwargs)
    if not isinstance(model, nn.Module):
        raise SystemExit(f"plan: {cfg.model} returned a {type(model).__name__}, not an nn.Module")
    return model


def select_blocks(model, patterns: tuple[str, ...]) -> list:
    """The modules to shard before the root: those whose class name or FQN
    matches one of ``patterns`` (outermost matches only), or by default the
    children of the ModuleList holding the most parameters."""
    import torch.nn as nn
    named = list(model.named_modules())
    if patterns:
        picked, prefixes = [], []
        for name, m in named:
            if not name or any(name.startswith(p + ".") for p in prefixes):
                continue
            if any(type(m).__name__ == p or fnmatch.fnmatchcase(name, p) for p in patterns):
                picked.append(m)
                prefixes.append(name)
        if not picked:
            raise SystemExit(f"plan: --units {' '.join(patterns)} matches no module")
        return picked
    lists = [m for _, m in named if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return []
    best = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(best)


def root_grads_last(model, blocks: list) -> bool:
    """The root's own gradients complete at the end of backward: it owns a
    parameter of a module registered before the first block (an input
    embedding). See [Note: planner schedule] in tools/_planner.py."""
    inside = {id(p) for b in blocks for p in b.parameters()}
    first = {id(b) for b in blocks}
    for _, m in model.named_modules():
        if id(m) in first:
            return False
        if any(p is not None and id(p) not in inside for p in m._parameters.values()):
            return True
    return False


def make_mesh(world: int, hsdp: int):
    from torch.distributed.device_mesh import init_device_mesh
    if hsdp > 1:
        if world % hsdp:
            raise SystemExit(f"plan: --hsdp {hsdp} must divide the world size {world}")
        return init_device_mesh("cpu", (hsdp, world // hsdp), mesh_dim_names=("rep", "shard"))
    return init_device_mesh("cpu", (world,))


ROW_LAYOUTS = {"auto": None, "equal": True, "uneven": False}


def shard(model, blocks: list, cfg: PlanConfig, mesh) -> None:
    """fully_shard each block then the root, with ``cfg``'s policies and root
    settings; ``cfg.row_layout`` other than "auto" forces every row layout to
    equal chunks or uneven pieces (what-if plans: the equal chunks of before
    uneven pieces existed, docs/design.md "Row-granular shards at scale")."""
    from fsdp_compose._plan import _layout
    _layout.FORCE_EVEN = ROW_LAYOUTS[cfg.row_layout]
    try:
        _shard(model, blocks, cfg, mesh)
    finally:
        _layout.FORCE_EVEN = None


def _shard(model, blocks: list, cfg: PlanConfig, mesh) -> None:
    import torch
    from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    kw = {"mesh": mesh, "shard_granularity": cfg.shard_granularity}
    if cfg.mp == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if cfg.offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    if cfg.reshard_after_forward is not None:
        kw["reshard_after_forward"] = cfg.reshard_after_forward
    for b in blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    model.set_prefetch_depth(cfg.prefetch_depth)
    model.set_all_gather_bucket_bytes(cfg.bucket_bytes)
    model.set_reduce_scatter_bucket_bytes(cfg.bucket_bytes)


def make_optimizer(model, name: str):
    """The optimizer the plan assumes (``--optimizer``), built after fully_shard."""
    import torch
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if name == "muon":
        matrices = [p for p in params if p.ndim == 2]
        return _Optims([torch.optim.Muon(matrices, lr=2e-2),
                        torch.optim.AdamW([p for p in params if p.ndim != 2], lr=1e-3)])
    raise ValueError(name)


class _Optims:
    """Several optimizers stepped as one (Muon on matrices, AdamW on the rest)."""

    def __init__(self, optims):
        self.optims = optims

    @property
    def state(self) -> dict:
        return {k: v for o in self.optims for k, v in o.state.items()}

    def step(self):
        for o in self.optims:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optims:
            o.zero_grad(set_to_none=set_to_none)


# -------------------------------------------------------------------- plan
@dataclass
class WorldPlan:
    row: dict          # the --json object
    ranks: object      # _planner.RankBytes: every rank's bytes
    step: object       # _planner.Step


def _fake_group(world: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise SystemExit("plan: a process group is already initialised; run the planner "
                         "in its own process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def plan_world(cfg: PlanConfig, world: int) -> WorldPlan:
    """The plan at ``world`` ranks (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from fsdp_compose._base._registry import unit_of
    from tools import _planner

    t0 = time.perf_counter()
    _fake_group(world)  # a job of its own: the groups and rank loads fully_shard keeps are its
    try:
        with torch.device("meta"):
            model = build_model(cfg)
        blocks = select_blocks(model, cfg.units)
        last = root_grads_last(model, blocks)
        shard(model, blocks, cfg, make_mesh(world, cfg.hsdp))
        units = _planner.describe(unit_of(model), [unit_of(b) for b in blocks],
                                  padded=cfg.pads)
    finally:
        dist.destroy_process_group()
    step = _planner.Step(units, schedule=cfg.schedule, prefetch_depth=cfg.prefetch_depth,
                         gather_bucket_bytes=cfg.bucket_bytes,
                         reduce_bucket_bytes=cfg.bucket_bytes, root_grads_last=last).run()
    ranks = _planner.rank_bytes(units, cfg.optimizer, step.grad_buffers,
                                host_copies=cfg.schedule == "cuda")
    n = len(ranks.params)
    top = max(range(n), key=lambda r: (ranks.total(r), -r))
    peaks = step.peaks()
    c = step.comm
    groups = [g for u in units for g in u.groups]
    param_total = sum(sum(s.numel for s in g.layout.slots) * g.itemsize for g in groups)
    padding = sum(g.layout.padding * g.itemsize for g in groups)
    row = {
        "world_size": world,
        "shard_world_size": world // cfg.hsdp,
        "replicas": cfg.hsdp,
        "params": sum(u.numel for u in units),
        "units": len(units),
        "flat_groups": sum(len(u.groups) for u in units),
        "most_loaded_rank": top,
        "param_bytes": ranks.params[top],
        "param_bytes_ideal": param_total / (world // cfg.hsdp),
        "padding_bytes": padding,
        "padding_percent": 100 * padding / max(param_total, 1),
        "uneven_groups": sum(not g.even for g in groups),
        "grad_bytes": ranks.grads[top],
        "optim_bytes": ranks.optim[top],
        "total_bytes": ranks.total(top),
        "optim_bytes_mean": sum(ranks.optim) / n,
        "state_on": "cpu" if cfg.offload else "device",
        "unsharded_forward_peak_bytes": peaks["forward"],
        "unsharded_backward_peak_bytes": peaks["backward"],
        "all_gather_bytes": c.all_gather_bytes,
        "all_gather_calls": c.all_gather_calls,
        "reduce_scatter_bytes": c.reduce_scatter_bytes,
        "reduce_scatter_calls": c.reduce_scatter_calls,
        "all_reduce_bytes": c.all_reduce_bytes,
        "all_reduce_calls": c.all_reduce_calls,
        "schedule": cfg.schedule,
        "settings": settings_dict(cfg),
        "plan_seconds": round(time.perf_counter() - t0, 3),
    }
    row["hsdp_proposal"] = _planner.hsdp_proposal(units, step, world) if cfg.hsdp == 1 else None
    row.update(_planner.nccl_view(units, step, cfg.pads, cfg.links))
    return WorldPlan(row, ranks, step)


def settings_dict(cfg: PlanConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["units"] = list(cfg.units)
    if cfg.model != "demo":
        for k in ("dim", "layers", "vocab"):
            d.pop(k)
    return d


# ------------------------------------------------------------------ output
def _gib(n: float) -> str:
    return f"{n / GIB:.3f}"


def _size(n: float) -> str:
    for unit, k in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


COLUMNS = [  # header, row -> text
    ("world", lambda r: str(r["world_size"])),
    ("params", lambda r: _size(r["param_bytes"])),
    ("vs total/N", lambda r: f"{100 * (r['param_bytes'] / r['param_bytes_ideal'] - 1):+.1f}%"),
    ("padding", lambda r: f"{_size(r['padding_bytes'])} ({r['padding_percent']:.2f}%)"),
    ("grads", lambda r: _size(r["grad_bytes"])),
    ("optim", lambda r: _size(r["optim_bytes"])),
    ("total (rank)", lambda r: f"{_size(r['total_bytes'])} (r{r['most_loaded_rank']})"),
    ("unsharded fwd", lambda r: _size(r["unsharded_forward_peak_bytes"])),
    ("unsharded bwd", lambda r: _size(r["unsharded_backward_peak_bytes"])),
    ("all-gather", lambda r: f"{_size(r['all_gather_bytes'])} / {r['all_gather_calls']}"),
    ("reduce-scatter",
     lambda r: f"{_size(r['reduce_scatter_bytes'])} / {r['reduce_scatter_calls']}"),
]
HSDP_COLUMN = ("all-reduce", lambda r: f"{_size(r['all_reduce_bytes'])} / {r['all_reduce_calls']}")


def _table(title: str, header: list[str], rows: list[list[str]], plain: bool) -> str:
    if not plain:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            plain = True
    if plain:
        w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        lines = [title, "  ".join(h.rjust(w[i]) for i, h in enumerate(header))]
        lines += ["  ".join(c.rjust(w[i]) for i, c in enumerate(r)) for r in rows]
        return "\n".join(lines)
    table = Table(title=title, title_justify="left")
    for h in header:
        table.add_column(h, justify="right")
    for r in rows:
        table.add_row(*r)
    console = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(table)
    return console.export_text().rstrip()


def describe_settings(cfg: PlanConfig) -> str:
    model = (f"demo Llama dim {cfg.dim}, {cfg.layers} layers, vocab {cfg.vocab}"
             if cfg.model == "demo" else cfg.model)
    forced = cfg.row_layout != "auto" and cfg.shard_granularity == "row"
    layout = cfg.shard_granularity + (f" ({cfg.row_layout} forced)" if forced else "")
    bits = [f"mp {cfg.mp}", f"optimizer {cfg.optimizer}", f"{layout} layout",
            f"prefetch {cfg.prefetch_depth}", f"buckets {_size(cfg.bucket_bytes)}",
            f"{cfg.schedule} backward schedule"]
    if cfg.offload:
        bits.append("CPU offload (params/grads/optim on the host)")
    if cfg.reshard_after_forward is not None:
        bits.append(f"reshard_after_forward={cfg.reshard_after_forward}")
    if cfg.hsdp > 1:
        bits.append(f"HSDP {cfg.hsdp} replicas")
    return f"{model}: " + ", ".join(bits)


def _ms(s: float) -> str:
    return f"{1e3 * s:,.1f} ms"


NCCL_COLUMNS = [  # what NCCL sees per step, ours and FSDP2's layout (_planner.nccl_view)
    ("world", lambda r: str(r["world_size"])),
    ("ours: calls", lambda r: str(r["collective_calls"])),
    ("NCCL ops", lambda r: f"{r['nccl_ops']:,}"),
    ("(list forms)", lambda r: f"{r['nccl_ops_list_forms']:,}"),
    ("bytes", lambda r: _size(r["collective_bytes"])),
    ("padding", lambda r: f"{r['collective_padding_percent']:.2f}%"),
    ("per rank", lambda r: f"{100 * (r['param_bytes'] / r['param_bytes_ideal'] - 1):+.1f}%"),
    ("NVLink", lambda r: _ms(r["est_seconds"]["nvlink"])),
    ("IB", lambda r: _ms(r["est_seconds"]["ib"])),
    ("FSDP2: calls", lambda r: str(r["fsdp2"]["calls"])),
    ("bytes ", lambda r: _size(r["fsdp2"]["bytes"])),
    ("padding ", lambda r: f"{r['fsdp2']['padding_percent']:.2f}%"),
    ("per rank ",
     lambda r: f"{100 * (r['fsdp2']['param_bytes'] / r['param_bytes_ideal'] - 1):+.1f}%"),
    ("NVLink ", lambda r: _ms(r["fsdp2"]["est_seconds"]["nvlink"])),
    ("IB ", lambda r: _ms(r["fsdp2"]["est_seconds"]["ib"])),
]


def format_plan(cfg: PlanConfig, rows: list[dict], plain: bool = False) -> str:
    cols = COLUMNS + ([HSDP_COLUMN] if cfg.hsdp > 1 else [])
    r0 = rows[0]
    title = (f"{describe_settings(cfg)}\n{r0['params'] / 1e6:,.2f}M parameters in "
             f"{r0['units']} units; bytes per rank (the most-loaded rank), per step for "
             "collectives (bytes / calls)")
    text = _table(title, [h for h, _ in cols], [[f(r) for _, f in cols] for r in rows], plain)
    a = {name: (alpha, beta) for name, alpha, beta in cfg.links}
    nccl = _table("What NCCL sees per step (all-gathers, reduce-scatters and all-reduces): "
                  "c10d calls, the NCCL operations they become (with the list forms that "
                  "uneven pieces used to take), bytes, collective padding, the most-loaded "
                  "rank vs total/N, and an alpha-beta estimate (NVLink: "
                  f"{a['nvlink'][0] * 1e6:g} us + bytes / {a['nvlink'][1] / 1e9:g} GB/s; IB: "
                  f"{a['ib'][0] * 1e6:g} us + bytes / {a['ib'][1] / 1e9:g} GB/s, ring); "
                  "FSDP2's layout on the same units and schedule beside it",
                  [h for h, _ in NCCL_COLUMNS], [[f(r) for _, f in NCCL_COLUMNS] for r in rows],
                  plain)
    notes = [hsdp_warning(r) for r in rows if r.get("hsdp_proposal")]
    return "\n".join([text, nccl, *notes])


def hsdp_warning(r: dict) -> str:
    """The planner's warning for a world size whose plain FSDP moves more bytes
    than HSDP over smaller shard groups would (see _planner.hsdp_proposal)."""
    p, n = r["hsdp_proposal"], r["world_size"]
    fsdp = p["fsdp_bytes"]
    return (f"warning: at {n} ranks the per-rank share is so small that the layout's padding "
            f"({_size(r['padding_bytes'])}, {r['padding_percent']:.1f}% of the parameters; "
            f"{r['collective_padding_percent']:.1f}% of the collectives' bytes, every piece "
            f"padded to its group's largest) outweighs it: HSDP over shard groups of "
            f"{p['shard']} ranks (--hsdp {n // p['shard']}) would move {_size(p['bytes'])} "
            "per step instead of "
            f"{_size(fsdp)} ({100 * (p['bytes'] / fsdp - 1):+.0f}%, all-gather + reduce-scatter "
            f"+ all-reduce bytes, used-flags left out)")


# ------------------------------------------------------------------ measure
FIGURES = ["param_bytes", "grad_bytes", "optim_bytes", "unsharded_forward_peak_bytes",
           "unsharded_backward_peak_bytes", "all_gather_bytes", "all_gather_calls",
           "reduce_scatter_bytes", "reduce_scatter_calls", "all_reduce_bytes",
           "all_reduce_calls"]
PER_RANK = ("param_bytes", "grad_bytes", "optim_bytes")


def predicted_for_rank(wp: WorldPlan, rank: int) -> dict:
    """The plan's figures for global ``rank`` (with HSDP, its place in its shard group)."""
    out = {k: wp.row[k] for k in FIGURES}
    rank %= len(wp.ranks.params)
    out.update(param_bytes=wp.ranks.params[rank], grad_bytes=wp.ranks.grads[rank],
               optim_bytes=wp.ranks.optim[rank],
               all_reduce_bytes=wp.step.all_reduce_bytes_of(rank))
    return out


def rel_diff(pred: float, meas: float) -> float:
    if pred == meas:
        return 0.0
    return abs(meas - pred) / max(abs(pred), 1)


def compare(wp: WorldPlan, measured: list[dict]) -> tuple[list[list[str]], float]:
    """Rows (figure, predicted, measured, diff) for the comparison table, and
    the largest relative difference over every rank and figure."""
    rows, worst = [], 0.0
    for k in FIGURES:
        preds = [predicted_for_rank(wp, r)[k] for r in range(len(measured))]
        meas = [m[k] for m in measured]
        diffs = [rel_diff(p, m) for p, m in zip(preds, meas)]
        worst = max(worst, *diffs)
        fmt = str if k.endswith("calls") else _size
        if k in PER_RANK and len(set(preds)) + len(set(meas)) > 2:
            p_txt = ", ".join(fmt(p) for p in preds)
            m_txt = ", ".join(fmt(m) for m in meas)
        else:
            p_txt, m_txt = fmt(max(preds)), fmt(max(meas))
        rows.append([k, p_txt, m_txt, f"{100 * max(diffs):.1f}%"])
    return rows, worst


# --------------------------------------------------------------------- CLI
def _raf(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("expected true, false or an int") from None


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """The model and training options (shared with ``tools.timeline``)."""
    p.add_argument("--model", default="demo",
                   help="'demo' (the demo Llama) or 'pkg.module:function' returning an "
                        "nn.Module ('pkg.module:function(1, k=2)' passes literal arguments)")
    p.add_argument("--dim", type=int, default=128, help="demo: model width (multiple of 32)")
    p.add_argument("--layers", type=int, default=4, help="demo: blocks")
    p.add_argument("--vocab", type=int, default=128, help="demo: vocabulary size")
    p.add_argument("--units", nargs="+", default=[],
                   help="module class names or FQN patterns to shard before the root "
                        "(default: each child of the largest ModuleList)")
    p.add_argument("--mp", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
    p.add_argument("--offload", action="store_true", help="CPUOffloadPolicy() on every unit")
    p.add_argument("--reshard-after-forward", type=_raf, default=None, metavar="{true,false,INT}",
                   help="passed to every fully_shard call (default: None, True but the root)")
    p.add_argument("--hsdp", type=int, default=1, metavar="R",
                   help="HSDP over (R replicas, world / R shards)")
    p.add_argument("--optimizer", choices=["adamw", "sgd", "muon"], default="adamw",
                   help="sgd: momentum 0.9; muon: Muon on 2-D weights, AdamW on the rest "
                        "(needs --shard-granularity tensor)")
    p.add_argument("--shard-granularity", choices=["row", "tensor"], default="row")
    p.add_argument("--row-layout", choices=list(ROW_LAYOUTS), default="auto",
                   help="row layouts: chosen per group (auto), or forced to equal chunks "
                        "(the layout before uneven pieces) or to uneven pieces")
    p.add_argument("--prefetch-depth", type=int, default=1)
    p.add_argument("--bucket-bytes", type=int, default=1 << 20,
                   help="all-gather and reduce-scatter bucket size (0: none)")
    p.add_argument("--alpha-us", type=float, nargs=2, metavar=("NVLINK", "IB"), default=None,
                   help="per-collective latency in microseconds for the estimate "
                        "(default 10 and 25)")
    p.add_argument("--beta-gbs", type=float, nargs=2, metavar=("NVLINK", "IB"), default=None,
                   help="bus bandwidth in GB/s for the estimate (default 300 and 40)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(p)
    p.add_argument("--world-size", type=int, nargs="+", default=[8],
                   help="world sizes to plan (e.g. 8 64 1024)")
    p.add_argument("--schedule", choices=["cuda", "gloo"], default=None,
                   help="backward schedule to predict (default: cuda; gloo with --measure)")
    p.add_argument("--json", action="store_true",
                   help="print a JSON list, one object per world size")
    p.add_argument("--plain", action="store_true", help="plain-text table even if rich is there")
    p.add_argument("--measure", action="store_true",
                   help="also run 3 real steps on gloo at each world size <= 4 and compare")
    return p


def config_from_args(args, worlds: list[int], schedule: str) -> PlanConfig:
    links = []
    for i, (name, alpha, beta) in enumerate(PlanConfig.links):
        if getattr(args, "alpha_us", None):
            alpha = args.alpha_us[i] * 1e-6
        if getattr(args, "beta_gbs", None):
            beta = args.beta_gbs[i] * 1e9
        links.append((name, alpha, beta))
    if args.optimizer == "muon" and args.shard_granularity != "tensor":
        raise SystemExit("plan: --optimizer muon needs --shard-granularity tensor (Muon needs "
                         "whole matrices; on row pieces its first step raises)")
    if min(worlds) < 1 or args.hsdp < 1 or args.prefetch_depth < 0 or args.bucket_bytes < 0:
        raise SystemExit("plan: --world-size and --hsdp must be >= 1, --prefetch-depth and "
                         "--bucket-bytes >= 0")
    return PlanConfig(model=args.model, dim=args.dim, layers=args.layers, vocab=args.vocab,
                      units=tuple(args.units), mp=args.mp, offload=args.offload,
                      reshard_after_forward=args.reshard_after_forward, hsdp=args.hsdp,
                      optimizer=args.optimizer, shard_granularity=args.shard_granularity,
                      row_layout=args.row_layout,
                      prefetch_depth=args.prefetch_depth, bucket_bytes=args.bucket_bytes,
                      schedule=schedule, links=tuple(links))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.measure and args.schedule == "cuda":
        raise SystemExit("plan: --measure runs gloo; it compares the gloo schedule")
    cfg = config_from_args(args, args.world_size,
                           args.schedule or ("gloo" if args.measure else "cuda"))
    plans = [plan_world(cfg, w) for w in args.world_size]
    if args.json and not args.measure:
        print(json.dumps([p.row for p in plans], indent=1))
        return 0
    print(format_plan(cfg, [p.row for p in plans], args.plain))
    if not args.measure:
        return 0
    from tools import _measure
    worst_all, out = 0.0, []
    for wp in plans:
        world = wp.row["world_size"]
        if world > 4:
            print(f"\n(--measure: world size {world} skipped; only sizes <= 4 run here)")
            continue
        measured = _measure.launch(cfg, world)
        rows, worst = compare(wp, measured)
        worst_all = max(worst_all, worst)
        ok = "OK" if worst <= TOLERANCE else f"DIFFERS by more than {TOLERANCE:.0%}"
        print()
        print(_table(f"world size {world}: predicted vs measured (3 gloo steps; per-rank "
                     f"figures listed by rank where ranks differ): {ok}",
                     ["figure", "predicted", "measured", "diff"], rows, args.plain))
        out.append({"world_size": world, "measured": measured,
                    "predicted": [predicted_for_rank(wp, r) for r in range(world)]})
    if args.json:
        print(json.dumps(out, indent=1))
    return 0 if worst_all <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
