"""Checkpoints of 2-D (dp, tp) models (issue 7).

The (dp=2, tp=2) model of ``test_tp`` (tests/_tp_net.py: Colwise/Rowwise
attention and MLP, plain norms in the same units) trains 2 steps and saves model + AdamW state
with DCP. The checkpoint then goes (a) offline into a plain module / plain
tensors (``dcp_to_torch_save``), compared with a single process trained the
same 2 steps; (b) into a 1-D model (dp=4), (c) into other layouts (dp=1,
tp=4), (dp=4, tp=1) and the same (dp=2, tp=2): each continues 2 steps and its
losses and parameters equal the uninterrupted single-process run. The full
state dict of the 2-D model (parameters and optimizer state) equals the
reference's, and a full state dict loads back into a 2-D model.
"""
from __future__ import annotations

import functools
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose import fully_shard, get_state_dict, set_state_dict

from ._dist import run_distributed
from ._tp_net import BATCH, IN, OUT, T, Net, parallelize

SAVED_AT, STEPS = 2, 4
LR, WD = 1e-2, 0.1


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, T, IN, generator=g), torch.randn(BATCH, T, OUT, generator=g)


def _optim(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)


def _step(model, opt, step, dp, dp_rank) -> float:
    """One step on this rank's slice; returns the global loss (mean over dp)."""
    x, y = _batch(step)
    per = BATCH // dp
    sl = slice(dp_rank * per, (dp_rank + 1) * per)
    loss = (model(x[sl]) - y[sl]).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    out = loss.detach().clone()
    if dist.is_initialized() and dp > 1:
        # equal slices: the mean of the means is the global loss (TP peers of a dp
        # rank hold the same loss, so the mean over the world is the same)
        dist.all_reduce(out)
        out /= dist.get_world_size()
    return out.item()


def _reference():
    torch.manual_seed(0)
    ref = Net()
    opt = _optim(ref)
    losses, at_save = [], None
    for step in range(STEPS):
        if step == SAVED_AT:
            at_save = ({n: p.detach().clone() for n, p in ref.named_parameters()},
                       {n: {k: v.clone() for k, v in opt.state[p].items()}
                        for n, p in ref.named_parameters()})
        losses.append(_step(ref, opt, step, 1, 0))
    final = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return losses, at_save, final


def _model(dp: int, tp: int | None, seed: int):
    """(dp, tp) fsdp_compose model; ``tp=None``: 1-D, no tensor parallelism."""
    torch.manual_seed(seed)
    model = Net()
    if tp is None:
        mesh = init_device_mesh("cpu", (dp,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, _optim(model), mesh.get_local_rank()
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize(model, mesh, False)
    return model, _optim(model), mesh["dp"].get_local_rank()


def _close(a, b, what, out, rtol=1e-4, atol=1e-5):
    if tuple(a.shape) != tuple(b.shape):
        out.append(f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
    elif not torch.allclose(a, b, rtol=rtol, atol=atol):
        out.append(f"{what}: max diff {(a - b).abs().max():.2e}")


def _full_params(model) -> dict:
    msd, _ = get_state_dict(model, [], full_state_dict=True)
    return msd


def _run(rank, world, root):
    problems = {}
    ref_losses, (ref_params, ref_state), ref_final = _reference()
    path = os.path.join(root, "ckpt")

    # the 2-D model: train, check its full state dict, save
    model, opt, dp_rank = _model(2, 2, 0)
    losses = [_step(model, opt, s, 2, dp_rank) for s in range(SAVED_AT)]
    p = problems.setdefault("2d_train", [])
    for s, (a, b) in enumerate(zip(losses, ref_losses)):
        if abs(a - b) > 1e-5 * max(1.0, abs(b)):
            p.append(f"step {s} loss {a} vs {b}")
    full_msd, full_osd = get_state_dict(model, opt, full_state_dict=True)
    p = problems.setdefault("2d_full_state_dict", [])
    for n, want in ref_params.items():
        _close(full_msd[n], want, n, p)
        for k, v in ref_state[n].items():
            if k == "step":
                if float(full_osd["state"][n][k]) != float(v):
                    p.append(f"{n}/step {full_osd['state'][n][k]} vs {v}")
            else:
                _close(full_osd["state"][n][k], v, f"{n}/{k}", p)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    dist.barrier()

    # (a) offline into a plain module and plain optimizer state
    p = problems.setdefault("plain", [])
    if rank == 0:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        dcp_to_torch_save(path, os.path.join(root, "full.pt"))
        sd = torch.load(os.path.join(root, "full.pt"), weights_only=False)
        # every saved tensor is tiled exactly once (replicated TP boxes saved once)
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        md = dcp.FileSystemReader(path).read_metadata()
        for key, m in md.state_dict_metadata.items():
            if isinstance(m, TensorStorageMetadata) and len(m.size) > 0:
                vol = sum(math.prod(c.sizes) for c in m.chunks)
                if vol != math.prod(m.size):
                    p.append(f"{key}: chunks hold {vol} elements, the tensor {math.prod(m.size)}")
        plain = Net()
        plain.load_state_dict(sd["model"])
        for n, t in plain.named_parameters():
            _close(t.detach(), ref_params[n], n, p)
            for k, v in ref_state[n].items():
                if k != "step":
                    _close(sd["optim"]["state"][n][k], v, f"{n}/{k}", p)
    dist.barrier()

    # (b), (c): load into other layouts, continue, compare with the uninterrupted run
    for name, dp, tp in (("1d_dp4", 4, None), ("dp1_tp4", 1, 4), ("dp4_tp1", 4, 1),
                         ("dp2_tp2", 2, 2)):
        # (an error raises out of the launch at once: waiting for the peers
        # here would turn it into their collective's timeout)
        p = problems.setdefault(name, [])
        m, o, r = _model(dp, tp, 1)
        msd, osd = get_state_dict(m, o)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(m, o, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        full = _full_params(m)
        for n, want in ref_params.items():
            _close(full[n], want, f"loaded {n}", p)
        for s in range(SAVED_AT, STEPS):
            got = _step(m, o, s, dp, r)
            if abs(got - ref_losses[s]) > 1e-5 * max(1.0, abs(ref_losses[s])):
                p.append(f"step {s} loss {got} vs {ref_losses[s]}")
        full = _full_params(m)
        for n, want in ref_final.items():
            _close(full[n], want, f"final {n}", p)
        dist.barrier()

    # a full state dict (plain tensors) loads into a 2-D model too
    p = problems.setdefault("2d_from_full", [])
    m, o, r = _model(2, 2, 1)
    set_state_dict(m, o, model_state_dict=full_msd, optim_state_dict=full_osd)
    for s in range(SAVED_AT, STEPS):
        got = _step(m, o, s, 2, r)
        if abs(got - ref_losses[s]) > 1e-5 * max(1.0, abs(ref_losses[s])):
            p.append(f"step {s} loss {got} vs {ref_losses[s]}")
    return problems


@functools.lru_cache(maxsize=None)
def _results(root):
    return run_distributed(_run, 4, root)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _results(str(tmp_path_factory.mktemp("tp_ckpt")))


CASES = ("2d_train", "2d_full_state_dict", "plain", "1d_dp4", "dp1_tp4", "dp4_tp1", "dp2_tp2",
         "2d_from_full")


@pytest.mark.parametrize("case", CASES)
def test_tp_checkpoint(results, case):
    for rank, per_rank in enumerate(results):
        assert per_rank[case] == [], f"rank {rank}: {per_rank[case][:4]}"
