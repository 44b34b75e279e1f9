"""``fsdp_compose.load_checkpoint``: a failed load changes nothing, on any rank.

One launch at 2 ranks saves the checkpoints: a good one (after two training
steps), one from a model with another shape, one with another dtype, and one
without optimizer state. The parent then damages copies of the good one (a
truncated file, flipped bytes inside a tensor's data, a missing file). Launches
at 1, 2 and 4 ranks train a differently-initialised model one step (so the live
state differs from every checkpoint), change its lr, and load each bad
checkpoint: every rank must raise an error that ``except Exception`` catches,
with every parameter, buffer, optimizer state tensor, ``step`` and param_group
hyperparameter bit-identical to before. Loading the good checkpoint (saved at
2 ranks, so loading at 1 and 4 reshards) must equal the plain recipe's load
bitwise and resume training identically.

``FSDP_TEST_PLAIN_LOAD=1`` runs the same cases through the README's plain
recipe (``get_state_dict`` + ``dcp.load`` + ``set_state_dict``): every failure
case then fails (state overwritten, or an uncatchable ``CheckpointException``,
or no error at all), which is how these tests were checked to be able to fail.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import fsdp_compose
from fsdp_compose import CheckpointLoadError, get_state_dict, load_checkpoint, set_state_dict

from ._dist import run_distributed
from .test_checkpoint import Net, make_optim, ours_fresh, shard_ours, train

TIMEOUT = 120
BAD = ["truncated", "flipped", "missing_file", "shape", "dtype", "no_optim"]


def _plain_load(model, opt, path):
    """The README's plain recipe (loads into views of the live shards)."""
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)


LOAD = _plain_load if os.environ.get("FSDP_TEST_PLAIN_LOAD") == "1" else load_checkpoint


def _snapshot(model, opt) -> dict:
    """Exact copies of everything a load may change on this rank."""
    out = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"buffer {n}": b.clone() for n, b in model.named_buffers()})
    for n, p in model.named_parameters():
        for k, v in opt.state.get(p, {}).items():
            out[f"state {n} {k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    for i, g in enumerate(opt.param_groups):
        for k, v in g.items():
            if k != "params":
                out[f"group {i} {k}"] = v
    return out


def _differences(a: dict, b: dict) -> list[str]:
    bad = sorted(a.keys() ^ b.keys())
    for k in a.keys() & b.keys():
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(x, y)):
                bad.append(k)
        elif x != y:
            bad.append(f"{k}: {x} != {y}")
    return bad


def _other_shape() -> Net:
    torch.manual_seed(0)
    model = Net()
    model.layers[1].lin1 = nn.Linear(model.layers[1].lin1.in_features, 19)
    model.layers[1].lin2 = nn.Linear(19, model.layers[1].lin2.out_features)
    return model


def _other_dtype() -> Net:
    torch.manual_seed(0)
    model = Net()
    model.layers[0].lin1.double()
    return model


# --------------------------------------------------------------- save (2 ranks)
def _save(rank, world, root):
    model, opt = ours_fresh(0)
    train(model, opt, range(2), rank, world)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "good"))
    for name, build in [("shape", _other_shape), ("dtype", _other_dtype)]:
        other = shard_ours(build())
        o_opt = make_optim(other)
        msd, osd = get_state_dict(other, o_opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, name))
    dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(root, "no_optim"))


def _damage(root) -> None:
    """Damaged copies of the good checkpoint (written by 2 ranks: two data files)."""
    good = os.path.join(root, "good")
    for name in ["truncated", "flipped", "missing_file"]:
        shutil.copytree(good, os.path.join(root, name))
    f = os.path.join(root, "truncated", "__1_0.distcp")
    os.truncate(f, os.path.getsize(f) * 3 // 5)
    # flip 8 bytes inside the data of the largest tensor item of rank 0's file
    md = dcp.FileSystemReader(good).read_metadata()
    item = max((s for s in md.storage_data.values() if s.relative_path == "__0_0.distcp"),
               key=lambda s: s.length)
    with open(os.path.join(root, "flipped", "__0_0.distcp"), "r+b") as fh:
        fh.seek(item.offset + item.length // 2)
        data = bytearray(fh.read(8))
        fh.seek(item.offset + item.length // 2)
        fh.write(bytes(x ^ 0xFF for x in data))
    os.remove(os.path.join(root, "missing_file", "__1_0.distcp"))


# ------------------------------------------------------------------ load cases
def _live(rank, world):
    """A model whose state differs from every checkpoint: other init, one step, other lr."""
    model, opt = ours_fresh(1)
    train(model, opt, [5], rank, world)
    for g in opt.param_groups:
        g["lr"] = 0.123
    return model, opt


def _attempt(model, opt, path) -> dict:
    before = _snapshot(model, opt)
    try:
        LOAD(model, opt, path)
        raised = None
    except BaseException as e:  # noqa: BLE001 - what it raised is the point
        raised = e
    return {"raised": type(raised).__name__ if raised is not None else None,
            "catchable": isinstance(raised, Exception),
            "cause": type(raised.__cause__).__name__ if raised is not None and
            raised.__cause__ is not None else None,
            "message": str(raised)[:2000] if raised is not None else "",
            "changed": _differences(before, _snapshot(model, opt))}


def _load_run(rank, world, root):
    out = {}
    model, opt = _live(rank, world)
    for case in BAD:
        out[case] = _attempt(model, opt, os.path.join(root, case))
    if world > 1:
        # one rank's view of the checkpoint is damaged, the others' are fine
        out["one_rank"] = _attempt(model, opt, os.path.join(
            root, "truncated" if rank == world - 1 else "good"))
        # a failure after the read, on one rank only (the others' went well)
        real = fsdp_compose._load_checkpoint._optim_load_dict

        def fail_last_rank(*a, **k):
            if rank == world - 1:
                raise ValueError("injected: this optimizer does not match")
            return real(*a, **k)
        with mock.patch.object(fsdp_compose._load_checkpoint, "_optim_load_dict",
                               fail_last_rank):
            out["after_read"] = _attempt(model, opt, os.path.join(root, "good"))
    # an optimizer with no state yet keeps none
    torch.manual_seed(3)
    fresh = shard_ours(Net())
    fresh_opt = make_optim(fresh)
    out["fresh_optimizer"] = _attempt(fresh, fresh_opt, os.path.join(root, "truncated"))
    out["fresh_optimizer"]["state_after"] = len(fresh_opt.state)

    # success: equals the plain recipe bitwise, and resumes identically
    good = os.path.join(root, "good")
    LOAD(model, opt, good)
    plain, plain_opt = _live(rank, world)
    _plain_load(plain, plain_opt, good)
    out["ok_vs_plain"] = _differences(_snapshot(plain, plain_opt), _snapshot(model, opt))
    out["lr_after"] = [g["lr"] for g in opt.param_groups]
    losses = train(model, opt, range(2, 4), rank, world)
    plain_losses = train(plain, plain_opt, range(2, 4), rank, world)
    out["resume"] = (losses == plain_losses,
                     _differences(_snapshot(plain, plain_opt), _snapshot(model, opt)))
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def loads():
    with tempfile.TemporaryDirectory(prefix="fsdp_safe_load_") as root:
        run_distributed(_save, 2, root, timeout=TIMEOUT)
        _damage(root)
        yield {w: run_distributed(_load_run, w, root, timeout=TIMEOUT) for w in (1, 2, 4)}


WORLDS = [1, 2, 4]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", BAD + ["one_rank", "after_read", "fresh_optimizer"])
def test_failed_load_changes_nothing_and_is_catchable(loads, world, case):
    if case not in loads[world][0]:
        pytest.skip("needs more than one rank")
    for rank, out in enumerate(loads[world]):
        got = out[case]
        assert got["raised"] == "CheckpointLoadError" and got["catchable"], (rank, got)
        assert got["changed"] == [], (rank, got["changed"])
        assert "nothing was loaded on any rank" in got["message"]
        if case == "fresh_optimizer":
            assert got["state_after"] == 0


def test_failure_messages_name_what_failed(loads):
    r0 = loads[2][0]
    assert "truncated" in r0["truncated"]["message"]
    assert "corrupted" in r0["flipped"]["message"] and "CRC" in r0["flipped"]["message"]
    assert "Size mismatch" in r0["shape"]["message"]
    assert "dtype mismatch" in r0["dtype"]["message"]
    assert "layers.0.lin1.weight" in r0["dtype"]["message"]
    assert "Missing key" in r0["no_optim"]["message"]
    assert r0["truncated"]["cause"] == "CheckpointException"
    # rank 0's own load went well: it learns rank 1's error, and has no cause of its own
    assert "injected" in r0["after_read"]["message"] and r0["after_read"]["cause"] is None
    assert loads[2][1]["after_read"]["cause"] == "ValueError"
    assert "rank 1: ValueError: injected" in r0["after_read"]["message"]


@pytest.mark.parametrize("world", WORLDS)
def test_successful_load_equals_plain_load_and_resumes(loads, world):
    for out in loads[world]:
        assert out["ok_vs_plain"] == []
        assert out["lr_after"] == [1e-2]          # the checkpoint's, not the live 0.123
        assert out["resume"] == (True, [])
