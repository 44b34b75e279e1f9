"""``make demo``: train a small character-level Llama on the shipped text with
every block, then the root, passed to ``fsdp_compose.fully_shard``.

With ``--tp N`` it is 2-D: the ranks form a ``(dp, tp)`` mesh, each block is
first ``parallelize_module``-d over ``mesh["tp"]`` (``tp_plan()``: q/k/v and
gate/up column-wise, o/down row-wise), then ``fully_shard``-ed over
``mesh["dp"]``; the tied embedding/head and the final norm stay plain, in the
root unit. The ranks of one TP group read the same batch.

Under torchrun (``RANK``/``WORLD_SIZE`` set) it joins that job: NCCL on
``cuda:LOCAL_RANK`` when CUDA is there, gloo on CPU otherwise. Run plainly,
it spawns ``--world-size`` gloo CPU ranks itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import fsdp_compose
from fsdp_compose._base._launch import free_port, init_gloo
from fsdp_compose.demo.data import BatchSampler, CharTokenizer, load_text
from fsdp_compose.demo.model import ModelArgs, Transformer


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The demo's options (the CLI shows their defaults)."""
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--world-size", type=int, default=2,
                   help="CPU ranks to spawn when not under torchrun")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree N: the ranks form a (dp, tp) = (world/N, N) "
                   "mesh; blocks are tensor-parallel over tp, fully_shard-ed over dp")
    p.add_argument("--batch-size", type=int, default=16,
                   help="global batch in sequences, split evenly over the dp ranks")
    p.add_argument("--seq-len", type=int, default=128, help="characters per sequence")
    p.add_argument("--dim", type=int, default=128, help="model width, a multiple of 32")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="model init, data order and sampling")
    p.add_argument("--sample-chars", type=int, default=160,
                   help="characters to sample after training (0: no sample)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


class DemoArgumentError(ValueError):
    """Options that cannot work, found before any process starts."""


def check_args(args: argparse.Namespace, world_size: int) -> None:
    if min(args.steps, world_size, args.tp, args.batch_size, args.seq_len, args.layers) < 1:
        raise DemoArgumentError(
            "--steps, --world-size, --tp, --batch-size, --seq-len and --layers must be >= 1")
    if args.sample_chars < 0:
        raise DemoArgumentError("--sample-chars must be >= 0")
    if world_size % args.tp:
        raise DemoArgumentError(f"--tp {args.tp} must divide the world size {world_size}")
    dp = world_size // args.tp
    if args.batch_size % dp:
        raise DemoArgumentError(
            f"--batch-size {args.batch_size} must be a multiple of the data-parallel size {dp}"
            + (f" (world size {world_size} / --tp {args.tp})" if args.tp > 1 else ""))
    if args.dim < 32 or args.dim % 32:
        raise DemoArgumentError(f"--dim {args.dim} must be a multiple of 32 (heads of 32)")
    if (args.dim // 32) % args.tp:
        raise DemoArgumentError(
            f"--tp {args.tp} must divide the {args.dim // 32} heads of --dim {args.dim}")
    ffn = ModelArgs(vocab_size=1, dim=args.dim, n_heads=args.dim // 32).ffn_hidden_dim
    if ffn % args.tp:  # RowwiseParallel assumes even input shards
        raise DemoArgumentError(
            f"--tp {args.tp} must divide the MLP hidden size {ffn} of --dim {args.dim}")


def run(args: argparse.Namespace | None = None, **overrides) -> dict | None:
    """Run the demo; ``overrides`` replace options by their dest name
    (``run(steps=20, no_progress=True)``). Returns the summary dict where rank
    0 lives in this process (spawned runs and torchrun rank 0), else None."""
    defaults = add_arguments(argparse.ArgumentParser()).parse_args([])
    args = argparse.Namespace(**{**vars(defaults), **vars(args or defaults), **overrides})
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    check_args(args, int(os.environ["WORLD_SIZE"]) if under_torchrun else args.world_size)
    if under_torchrun:
        return _torchrun_main(args)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.spawn(_spawned_main, args=(args, free_port(), results), nprocs=args.world_size, join=True)
    return results.get()


def _spawned_main(rank: int, args: argparse.Namespace, port: int, results) -> None:
    # One intra-op thread per rank unless OMP_NUM_THREADS says otherwise (as torchrun does):
    # a tiny model gains little from more, and busy cores make spinning threads crawl.
    init_gloo(rank, args.world_size, port, threads=int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        summary = train(args, torch.device("cpu"))
        if rank == 0:
            results.put(summary)
    finally:
        dist.destroy_process_group()


def _torchrun_main(args: argparse.Namespace) -> dict | None:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        return train(args, device)
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> dict | None:
    """The training run on this rank. Rank 0 prints and returns the summary."""
    from tqdm import tqdm

    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = make_mesh(args.tp, device)
    # The data-parallel coordinate picks the batch slice; a TP group shares one.
    if mesh is not None:
        dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    else:
        dp_rank, dp_size = rank, world_size
    text = load_text()
    tok = CharTokenizer(text)
    sampler = BatchSampler(tok.encode(text), global_batch=args.batch_size, seq_len=args.seq_len,
                           rank=dp_rank, world_size=dp_size, seed=args.seed)
    model, opt = build(args, tok.vocab_size, device, mesh)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: _lr_factor(step, args.steps))

    fsdp_compose.reset_comm_stats()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses = []
    dist.barrier()
    t0 = time.perf_counter()
    bar = tqdm(range(args.steps), disable=rank != 0 or args.no_progress, desc="train",
               unit="step", file=sys.stderr)
    for step in bar:
        x, y = (t.to(device) for t in sampler.batch(step))  # (b, s), (b, s)
        logits = model(x)  # (b, s, v)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        fsdp_compose.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.detach())
        if step % 10 == 0 or step == args.steps - 1:
            bar.set_postfix(loss=f"{losses[-1].item():.3f}")
    bar.close()
    elapsed = time.perf_counter() - t0
    stats = fsdp_compose.comm_stats()  # training only: taken before the sampling below

    # One all-reduce for the whole history: the loss of the global batch at each step
    # (the ranks of a TP group hold the same loss, so the mean over all ranks is it).
    summed = torch.stack(losses).float()  # (steps,)
    dist.all_reduce(summed)
    history = (summed / world_size).tolist()
    k = min(10, len(history))
    sample = (generate(model, tok, "The ", args.sample_chars, device, seed=args.seed)
              if args.sample_chars > 0 else None)
    per_rank = gather_rank_stats(stats, device)
    if rank != 0:
        return None
    summary = {
        "steps": args.steps, "world_size": world_size, "backend": dist.get_backend(),
        "device": device.type, "layers": args.layers, "dim": args.dim,
        "dp": dp_size, "tp": args.tp, "n_params": count_params(model),
        "global_batch": args.batch_size, "seq_len": args.seq_len, "elapsed_s": elapsed,
        "loss_start": sum(history[:k]) / k, "loss_end": sum(history[-k:]) / k, "loss_window": k,
        "tokens_per_s": args.steps * args.batch_size * args.seq_len / elapsed,
        "memory_kind": "max CUDA allocated" if device.type == "cuda" else "peak RSS",
        "ranks": per_rank, "sample": sample,
    }
    print(format_summary(summary), flush=True)
    return summary


def make_mesh(tp: int, device: torch.device) -> DeviceMesh | None:
    """The ``(dp, tp)`` mesh over all ranks (rank = dp_rank * tp + tp_rank), or None
    at ``tp == 1`` (plain 1-D fully_shard over every rank)."""
    if tp == 1:
        return None
    world_size = dist.get_world_size()
    return init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))


def tp_plan() -> dict:
    """Tensor parallelism for one ``Block``: the projections into heads / the MLP
    hidden layer split by output features (each rank: whole heads, a slice of f),
    the projections back split by input features, their partial sums all-reduced.
    Norms stay plain (replicated) parameters; block inputs and outputs are plain,
    replicated (b, s, d) tensors."""
    col, row = ColwiseParallel, RowwiseParallel
    return {"attention.wq": col(), "attention.wk": col(), "attention.wv": col(),
            "attention.wo": row(),
            "feed_forward.w_gate": col(), "feed_forward.w_up": col(),
            "feed_forward.w_down": row()}


def shard_model(model: Transformer, mesh: DeviceMesh | None, fully_shard=None) -> None:
    """Each block tensor-parallel over ``mesh["tp"]`` (if ``mesh``), then each block
    and the root ``fully_shard``-ed (over ``mesh["dp"]``, or every rank). The root
    unit holds the tied embedding/head and the final norm, plain (not TP).
    ``fully_shard``: fsdp_compose's by default (the TP benchmark passes torch's)."""
    fully_shard = fully_shard or fsdp_compose.fully_shard
    if mesh is not None:
        for block in model.layers:
            parallelize_module(block, mesh["tp"], tp_plan())
    dp_mesh = mesh["dp"] if mesh is not None else None
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)  # the root: tied embedding/head and the final norm


def count_params(model: Transformer) -> int:
    """Global parameter count of a model sharded by ``shard_model`` (TP shards counted whole)."""
    infos = map(fsdp_compose.param_info, model.parameters())
    return sum((i.tp_shape or i.shape).numel() for i in infos)


def build(args: argparse.Namespace, vocab_size: int, device: torch.device,
          mesh: DeviceMesh | None = None):
    """The model, each block then the root sharded (blocks tensor-parallel first if
    ``mesh``), and its AdamW (built after sharding)."""
    torch.manual_seed(args.seed)  # the same init on every rank
    model = Transformer(ModelArgs(vocab_size=vocab_size, dim=args.dim, n_layers=args.layers,
                                  n_heads=args.dim // 32, max_seq_len=args.seq_len)).to(device)
    # Choose weight decay by name now: once sharded, every parameter is a 1-D view.
    no_decay = {n for n, p in model.named_parameters() if p.ndim < 2}
    shard_model(model, mesh)
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n not in no_decay], "weight_decay": 0.1},
              {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0}]
    return model, torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def _lr_factor(step: int, steps: int) -> float:
    """Linear warmup over the first 5% of steps, then cosine decay to 10% of the peak."""
    warmup = max(1, steps // 20)
    cosine = 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, step / steps)))
    return min((step + 1) / warmup, cosine)


def gather_rank_stats(stats, device: torch.device) -> list[dict]:
    """Every rank's peak memory and comm counters, on every rank: one int64 row per rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    fields = ["peak_mem_bytes", *(f.name for f in dataclasses.fields(stats))]
    rows = torch.zeros(world_size, len(fields), dtype=torch.int64, device=device)  # (w, f)
    rows[rank] = torch.tensor([_peak_memory(device), *dataclasses.astuple(stats)])  # (f,)
    dist.all_reduce(rows)  # a sum where each row has one writer: a gather any backend has
    return [{"rank": r, **dict(zip(fields, row))} for r, row in enumerate(rows.tolist())]


@torch.no_grad()
def generate(model, tok: CharTokenizer, prompt: str, n: int, device: torch.device, *, seed: int,
             temperature: float = 0.8) -> str:
    """Sample ``n`` characters. Every rank must call it (each forward all-gathers);
    the same seed on every rank keeps the ranks' samples identical."""
    g = torch.Generator(device=device).manual_seed(seed)
    ids = tok.encode(prompt).to(device)[None]  # (1, t)
    for _ in range(n):
        logits = model(ids[:, -model.args.max_seq_len:])[:, -1]  # (1, v)
        probs = F.softmax(logits / temperature, dim=-1)  # (1, v)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], dim=1)  # (1, t+1)
    return tok.decode(ids[0])


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def format_summary(s: dict) -> str:
    lines = [
        f"fsdp-compose demo: {s['layers']}-layer dim-{s['dim']} Llama, "
        f"{s['n_params'] / 1e6:.2f}M params, "
        f"{s['world_size']} ranks ({s['backend']}, {s['device']})"
        + (f", dp {s['dp']} x tp {s['tp']}" if s["tp"] > 1 else ""),
        f"loss        {s['loss_start']:.3f} -> {s['loss_end']:.3f}  "
        f"(mean of first/last {s['loss_window']} steps)",
        f"throughput  {s['tokens_per_s']:,.0f} tokens/s global  ({s['steps']} steps x "
        f"{s['global_batch']} x {s['seq_len']} tokens in {s['elapsed_s']:.1f} s)",
        f"rank  {s['memory_kind']:>18}  {'all-gathered':>24}  {'reduce-scattered':>24}",
    ]
    for r in s["ranks"]:
        ag = f"{_mib(r['all_gather_bytes'])} / {r['all_gather_calls']} calls"
        rs = f"{_mib(r['reduce_scatter_bytes'])} / {r['reduce_scatter_calls']} calls"
        lines.append(f"{r['rank']:>4}  {_mib(r['peak_mem_bytes']):>18}  {ag:>24}  {rs:>24}")
    if s["sample"] is not None:
        lines.append("sample      " + s["sample"].replace("\n", "\n            "))
    return "\n".join(lines)
