"""``tools.plan --measure``: real gloo steps with the plan's settings, and what they held.

Each rank builds the model for real (the same seed on every rank), shards it
as the plan did, and runs ``STEPS`` training steps (forward, a mean of the
output, backward, optimizer step, ``zero_grad``). It reports, for the plan's
figures:

- the bytes of the shards, of the gradient shards after the last backward
  (unique storages of ``p.grad``) and of the optimizer state after the last
  step (unique storages of its tensors);
- the peak unsharded bytes a ``Tracker`` saw in forward and in backward;
- ``comm_stats()`` of the last step.
"""
from __future__ import annotations

import os
import tempfile
import time

STEPS = 3
BATCH, SEQ = 2, 16


class Tracker:
    """Samples, at every schedule event (``fsdp_compose.record_schedule``'s
    seam), the bytes of unsharded parameters and unsharded gradients, as
    [Note: planner schedule] in tools/_planner.py defines them; keeps the
    peak of their sum over forward events and over backward events."""

    def __init__(self, units: list):
        self.units = units
        self.groups = [g for u in units for g in u.groups]
        self.peak = {"forward": 0, "backward": 0}
        self.phase = "forward"
        self.events: list[tuple] = []
        self._prev = None

    def __enter__(self) -> "Tracker":
        from fsdp_compose._base import _common
        self._prev, _common._trace = _common._trace, self
        return self

    def __exit__(self, *exc) -> None:
        from fsdp_compose._base import _common
        _common._trace = self._prev

    def append(self, item: tuple) -> None:  # called by fsdp_compose._base._common.trace
        event, fqn, _ = item
        root = self.units[0]
        if event == "pre_forward" and fqn == root.fqn:
            self.phase = "forward"
        elif event == "pre_backward":
            self.phase = "backward"
        params, grads = self.param_bytes(), self.grad_bytes()
        self.events.append((event, fqn, self.phase, params, grads))
        self.peak[self.phase] = max(self.peak[self.phase], params + grads)

    def param_bytes(self) -> int:
        n = 0
        for g in self.groups:
            if g.aliased:
                continue
            n += g.flat.untyped_storage().nbytes()
            if g._pf_shard is not None:
                n += g._pf_shard.untyped_storage().nbytes()
        return n

    def grad_bytes(self) -> int:
        seen: dict[int, int] = {}
        for g in self.groups:
            if g.flat.grad is not None:
                s = g.flat.grad.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
        ctx = self.units[0].ctx
        for launch in (ctx.reductions.in_flight if ctx is not None else []):
            if launch.done or launch.pending is None:
                continue
            # the input only: on the side-stream (CUDA) path the Pending also
            # keeps the output shard and HSDP partial sums alive, which are
            # sharded gradients, not what the planner counts here
            for t in launch.pending.keep_alive[:1]:
                s = t.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())


def _storage_bytes(tensors) -> int:
    from fsdp_compose._group._row_dtensor import local_of
    seen = {}
    for t in tensors:
        s = local_of(t).untyped_storage()  # (a DTensor's storage is its local tensor's)
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _inputs(model, cfg, rank: int):
    """A batch for this rank: token ids for the demo and Hugging Face models,
    else ``model.example_input()``."""
    import torch
    g = torch.Generator().manual_seed(1000 + rank)
    config = getattr(model, "config", None)
    if cfg.model == "demo" or getattr(config, "vocab_size", None):
        vocab = cfg.vocab if cfg.model == "demo" else config.vocab_size
        return (torch.randint(0, vocab, (BATCH, SEQ), generator=g),)
    make = getattr(model, "example_input", None)
    if make is None:
        raise RuntimeError(f"--measure: no input for {cfg.model}: give the model an "
                           "example_input() method returning its forward's arguments")
    torch.manual_seed(1000 + rank)
    out = make()
    return out if isinstance(out, tuple) else (out,)


def _loss(out):
    import torch
    from torch.utils._pytree import tree_leaves
    if hasattr(out, "logits"):
        out = out.logits
    t = next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())
    return t.float().mean()


def setup(cfg, rank: int, world: int):
    """The model built for real (seed 0 on every rank) and sharded as the plan
    does; its units (root first), optimizer and this rank's batch."""
    import torch
    from fsdp_compose._base._job import job
    from fsdp_compose._base._registry import unit_of
    from tools.plan import build_model, make_mesh, make_optimizer, select_blocks, shard
    # as a plan does, from no rank loads (uneven layouts even out the loads of
    # the groups built before them: an earlier run in this job would move
    # this run's boundaries)
    job().loads.clear()
    torch.manual_seed(0)
    model = build_model(cfg)
    blocks = select_blocks(model, cfg.units)
    shard(model, blocks, cfg, make_mesh(world, cfg.hsdp))
    units = [unit_of(model)] + [unit_of(b) for b in blocks]
    return model, units, make_optimizer(model, cfg.optimizer), _inputs(model, cfg, rank)


def train_step(model, optim, inputs) -> None:
    _loss(model(*inputs)).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def measure_rank(rank: int, world: int, cfg) -> dict:
    """One rank of a measured run (a gloo process group is initialised)."""
    import torch
    from fsdp_compose import comm_stats, reset_comm_stats

    model, units, optim, inputs = setup(cfg, rank, world)
    out = {}
    with Tracker(units) as tracker:
        for step in range(STEPS):
            if step == STEPS - 1:
                reset_comm_stats()
            _loss(model(*inputs)).backward()
            if step == STEPS - 1:
                out["grad_bytes"] = _storage_bytes(p.grad for p in model.parameters()
                                                   if p.grad is not None)
            optim.step()
            optim.zero_grad(set_to_none=True)
    c = comm_stats()
    groups = [g for u in units for g in u.groups]
    state = [t for s in optim.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    out.update(
        param_bytes=_storage_bytes(g.shard for g in groups),
        optim_bytes=_storage_bytes(state),
        unsharded_forward_peak_bytes=tracker.peak["forward"],
        unsharded_backward_peak_bytes=tracker.peak["backward"],
        all_gather_bytes=c.all_gather_bytes, all_gather_calls=c.all_gather_calls,
        reduce_scatter_bytes=c.reduce_scatter_bytes, reduce_scatter_calls=c.reduce_scatter_calls,
        all_reduce_bytes=c.all_reduce_bytes, all_reduce_calls=c.all_reduce_calls,
        events=tracker.events[-200:])
    return out


# ------------------------------------------------------------------ launch
def _entry(rank: int, world: int, port: int, fn, args: tuple, path: str) -> None:
    import pickle
    import traceback

    import torch.distributed as dist

    from fsdp_compose._base._launch import init_gloo
    try:
        init_gloo(rank, world, port, threads=1)
        try:
            res = ("ok", fn(rank, world, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported by the parent
        res = ("err", traceback.format_exc())
    with open(path, "wb") as f:
        pickle.dump(res, f)


def launch(cfg, world: int, fn=measure_rank, args: tuple = (), timeout: float = 600) -> list:
    """Run ``fn(rank, world, cfg, *args)`` (default: ``measure_rank``) on
    ``world`` fresh gloo CPU processes; every rank's result, in rank order."""
    import multiprocessing as mp
    import pickle

    from fsdp_compose._base._launch import free_port
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="fsdp_compose_tools_") as tmp:
        paths = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world)]
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, (cfg, *args), paths[r]),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results = []
        for r, path in enumerate(paths):
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} of {world} did not finish "
                                   f"(exit code {procs[r].exitcode})")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise RuntimeError(f"rank {r} of {world} failed:\n{value}")
            results.append(value)
        return results
