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

Every case runs in three modes: the default (verify, then load in place
through a 64 MiB buffer: one batch for this model), ``verified_small``
(``buffer_bytes=1``: every tensor is a batch of its own, so a failure found
only while loading would leave earlier tensors written) and ``staged=True``.
One more case, ``late_fault``, damages the checkpoint *after* verification
(the window the verified load does not protect): staged, nothing changes; in
place, every rank still raises, with ``partial=True`` once earlier batches
were written (``verified_small``), and a load of the good checkpoint then
restores everything. ``ranks_differ`` (in place only): one rank describes
another state dict than the others; every rank raises before reading on.

``FSDP_TEST_PLAIN_LOAD=1`` runs the same cases through the plain recipe
of docs/checkpointing.md (``get_state_dict`` + ``dcp.load`` + ``set_state_dict``): every failure
case then fails (state overwritten, or an uncatchable ``CheckpointException``,
or no error at all), which is how these tests were checked to be able to fail.
``FSDP_TEST_SKIP_VERIFY=1`` replaces the verification by nothing: the failure
cases of ``verified_small`` then fail (state written before the failing
tensor), which shows they test the verification.
"""
from __future__ import annotations

import contextlib
import functools
import io
import os
import shutil
import struct
import tempfile
import zipfile
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import fsdp_compose
from fsdp_compose import get_state_dict, load_checkpoint, set_state_dict
from torch.distributed.tensor import DTensor

from ._checkpoint_net import Net, make_optim, ours_fresh, shard_ours, train
from ._dist import run_distributed
from ._support import OnFirstUse, rows

TIMEOUT = 120
BAD = ["truncated", "flipped", "missing_file", "shape", "dtype", "no_optim"]


def _plain_load(model, opt, path):
    """The plain recipe of docs/checkpointing.md (loads into views of the live shards)."""
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)


MODES = {"verified": {}, "verified_small": {"buffer_bytes": 1}, "staged": {"staged": True}}


def _loader(mode: str):
    if os.environ.get("FSDP_TEST_PLAIN_LOAD") == "1":
        return _plain_load
    return functools.partial(load_checkpoint, **MODES[mode])


@contextlib.contextmanager
def _maybe_skip_verify():
    """``FSDP_TEST_SKIP_VERIFY=1``: the verified load without its verification."""
    if os.environ.get("FSDP_TEST_SKIP_VERIFY") != "1":
        yield
        return

    def no_verify(self, checkpoint_id, storage_reader):
        self.source = (checkpoint_id, fsdp_compose.checkpoint._load_checkpoint._reader(
            checkpoint_id, storage_reader))
    with mock.patch.object(fsdp_compose.checkpoint._load_checkpoint._InPlace, "verify", no_verify):
        yield


def _snapshot(model, opt) -> dict:
    """Exact copies of everything a load may change on this rank (of a sharded
    parameter and its state: this rank's rows, compared without a collective)."""
    out = {f"param {n}": rows(p).detach().clone() for n, p in model.named_parameters()}
    out.update({f"buffer {n}": b.clone() for n, b in model.named_buffers()})
    for n, p in model.named_parameters():
        for k, v in opt.state.get(p, {}).items():
            out[f"state {n} {k}"] = rows(v).clone() if isinstance(v, torch.Tensor) else v
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


def _late_item_key(path) -> str:
    """The checkpoint key loaded last: the last parameter's last optimizer state
    tensor (the verified load reads the model first, then the optimizer)."""
    md = dcp.FileSystemReader(path).read_metadata()
    keys = [k for k, m in md.state_dict_metadata.items()
            if k.startswith("optim.state.") and hasattr(m, "size") and len(m.size) > 0]
    return keys[-1]


def _flip_items(path, key: str) -> int:
    """Flip the first bytes of the tensor data (the zip record ``.../data/0``)
    of every stored chunk of ``key`` (all ranks' files); returns how many."""
    md = dcp.FileSystemReader(path).read_metadata()
    flipped = 0
    for idx, item in md.storage_data.items():
        if idx.fqn != key:
            continue
        with open(os.path.join(path, item.relative_path), "r+b") as fh:
            fh.seek(item.offset)
            raw = fh.read(item.length)
            with zipfile.ZipFile(io.BytesIO(raw)) as z:
                info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
            h = info.header_offset  # local header: 30 bytes, the name, the extra field
            n, m = struct.unpack("<HH", raw[h + 26:h + 30])
            at = item.offset + h + 30 + n + m
            fh.seek(at)
            data = fh.read(4)
            fh.seek(at)
            fh.write(bytes(x ^ 0xFF for x in data))
            flipped += 1
    return flipped


# ------------------------------------------------------------------ load cases
def _live(rank, world):
    """A model whose state differs from every checkpoint: other init, one step, other lr."""
    model, opt = ours_fresh(1)
    train(model, opt, [5], rank, world)
    for g in opt.param_groups:
        g["lr"] = 0.123
    return model, opt


def _attempt(load, model, opt, path) -> dict:
    before = _snapshot(model, opt)
    try:
        load(model, opt, path)
        raised = None
    except BaseException as e:  # noqa: BLE001 - what it raised is the point
        raised = e
    return {"raised": type(raised).__name__ if raised is not None else None,
            "catchable": isinstance(raised, Exception),
            "cause": type(raised.__cause__).__name__ if raised is not None and
            raised.__cause__ is not None else None,
            "message": str(raised)[:2000] if raised is not None else "",
            "partial": getattr(raised, "partial", None),
            "changed": _differences(before, _snapshot(model, opt))}


@contextlib.contextmanager
def _damaged_after_verification(rank, path):
    """Rank 0 damages ``path`` once every rank has verified it, before any
    rank reads it again (staged: before the staged read; there is no window)."""
    lc = fsdp_compose.checkpoint._load_checkpoint

    def damage():
        dist.barrier()
        if rank == 0:
            assert _flip_items(path, _late_item_key(path)) > 0
        dist.barrier()

    real_load, real_staged = lc._InPlace.load, lc._load_staged

    def load(self, *a, **k):
        damage()
        return real_load(self, *a, **k)

    def staged(*a, **k):
        damage()
        return real_staged(*a, **k)
    with mock.patch.object(lc._InPlace, "load", load), \
            mock.patch.object(lc, "_load_staged", staged):
        yield


@contextlib.contextmanager
def _batch_log(log: list):
    """Record, per batch the verified load reads, its tensors and their bytes here."""
    lc = fsdp_compose.checkpoint._load_checkpoint
    real = lc._InPlace._read

    def read(self, batch):
        staged = real(self, batch)
        log.append((len(batch), sum((t.to_local() if isinstance(t, DTensor) else t).nbytes
                                    for t in staged), len(self.leaves)))
        return staged
    with mock.patch.object(lc._InPlace, "_read", read):
        yield


def _load_run(rank, world, root, mode):
    load = _loader(mode)
    out = {}
    model, opt = _live(rank, world)
    with _maybe_skip_verify():
        for case in BAD:
            out[case] = _attempt(load, model, opt, os.path.join(root, case))
        if world > 1:
            # one rank's view of the checkpoint is damaged, the others' are fine
            out["one_rank"] = _attempt(load, model, opt, os.path.join(
                root, "truncated" if rank == world - 1 else "good"))
            # a failure after the read, on one rank only (the others' went well)
            real = fsdp_compose.checkpoint._load_checkpoint._optim_load_dict

            def fail_last_rank(*a, **k):
                if rank == world - 1:
                    raise ValueError("injected: this optimizer does not match")
                return real(*a, **k)
            with mock.patch.object(fsdp_compose.checkpoint._load_checkpoint, "_optim_load_dict",
                                   fail_last_rank):
                out["after_read"] = _attempt(load, model, opt, os.path.join(root, "good"))
            if mode != "staged":
                # the last rank describes another state dict (its batches, and the
                # all-to-alls in them, would not pair with the others')
                lc = fsdp_compose.checkpoint._load_checkpoint
                real_init = lc._InPlace.__init__

                def other_description(self, *a, **k):
                    real_init(self, *a, **k)
                    if rank == world - 1:
                        self.fingerprint += "-other"
                with mock.patch.object(lc._InPlace, "__init__", other_description):
                    out["ranks_differ"] = _attempt(load, model, opt,
                                                   os.path.join(root, "good"))
        # an optimizer with no state yet keeps none
        torch.manual_seed(3)
        fresh = shard_ours(Net())
        fresh_opt = make_optim(fresh)
        out["fresh_optimizer"] = _attempt(load, fresh, fresh_opt,
                                          os.path.join(root, "truncated"))
        out["fresh_optimizer"]["state_after"] = len(fresh_opt.state)
        if world > 1:
            # only the last rank cannot load (its fresh optimizer's parameters hold
            # gradients): it must not skip the others' collectives
            if rank == world - 1:
                for p in fresh.parameters():
                    p.grad = torch.zeros_like(p)
            out["one_rank_not_loadable"] = _attempt(load, fresh, fresh_opt,
                                                    os.path.join(root, "good"))
            out["one_rank_not_loadable"]["state_after"] = len(fresh_opt.state)
            fresh_opt.zero_grad(set_to_none=True)

    # the checkpoint is damaged after verification (the window the verified load leaves)
    late = os.path.join(root, f"late_{mode}_{world}")
    if rank == 0:
        shutil.copytree(os.path.join(root, "good"), late)
    dist.barrier()
    with _damaged_after_verification(rank, late):
        out["late_fault"] = _attempt(load, model, opt, late)

    # success: equals the plain recipe bitwise, and resumes identically
    good = os.path.join(root, "good")
    batches: list = []
    with _batch_log(batches):
        load(model, opt, good)
    out["batches"] = batches
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


WORLDS = [1, 2, 4]


@pytest.fixture(scope="module")
def loads():
    with tempfile.TemporaryDirectory(prefix="fsdp_safe_load_") as root:
        run_distributed(_save, 2, root, timeout=TIMEOUT)
        _damage(root)
        # (mode, world size) -> per-rank results: one launch per pair a test uses
        yield OnFirstUse(lambda key: run_distributed(_load_run, key[1], root, key[0],
                                                     timeout=TIMEOUT))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", BAD + ["one_rank", "after_read", "ranks_differ",
                                  "fresh_optimizer", "one_rank_not_loadable"])
def test_failed_load_changes_nothing_and_is_catchable(loads, mode, world, case):
    if case not in loads[mode, world][0]:
        pytest.skip("needs more than one rank" if world == 1 else "the verified load's check")
    for rank, out in enumerate(loads[mode, world]):
        got = out[case]
        assert got["raised"] == "CheckpointLoadError" and got["catchable"], (rank, got)
        assert got["changed"] == [], (rank, got["changed"])
        assert "nothing was loaded on any rank" in got["message"]
        assert got["partial"] is False
        if case in ("fresh_optimizer", "one_rank_not_loadable"):
            assert got["state_after"] == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_failure_messages_name_what_failed(loads, mode):
    r0 = loads[mode, 2][0]
    assert "truncated" in r0["truncated"]["message"]
    assert "corrupted" in r0["flipped"]["message"] and "CRC" in r0["flipped"]["message"]
    assert "Size mismatch" in r0["shape"]["message"]
    assert "dtype mismatch" in r0["dtype"]["message"]
    assert "layers.0.lin1.weight" in r0["dtype"]["message"]
    assert "Missing key" in r0["no_optim"]["message"]
    assert r0["truncated"]["cause"] == "CheckpointException"
    # rank 0's own load went well: it learns rank 1's error, and has no cause of its own
    assert "injected" in r0["after_read"]["message"] and r0["after_read"]["cause"] is None
    assert loads[mode, 2][1]["after_read"]["cause"] == "ValueError"
    assert "rank 1: ValueError: injected" in r0["after_read"]["message"]
    if mode != "staged":
        assert "rank 1: its model or optimizers are not rank 0's" in r0["ranks_differ"]["message"]
    if mode != "staged":  # found by the verification, before anything is written
        assert "while verifying the checkpoint" in r0["truncated"]["message"]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("world", WORLDS)
def test_fault_after_verification(loads, mode, world):
    """Damage between verification and the read. Staged: nothing changes. In
    place: still an error on every rank (the read is CRC-checked again); with
    one batch (the default buffer, this model) nothing was written yet; with a
    batch per tensor the earlier tensors were: ``partial``, the same on every
    rank, param_groups untouched. (A later load of the good checkpoint restores
    everything: test_successful_load_equals_plain_load_and_resumes.)"""
    outs = [out["late_fault"] for out in loads[mode, world]]
    for rank, got in enumerate(outs):
        assert got["raised"] == "CheckpointLoadError" and got["catchable"], (rank, got)
        if mode != "staged":
            assert "after the checkpoint had been verified" in got["message"], got["message"]
        if mode == "verified_small":
            assert got["partial"] is True, got
            assert "MIX" in got["message"] and "staged=True" in got["message"]
            assert not any(k.startswith("group ") for k in got["changed"]), got["changed"]
        else:
            assert got["partial"] is False and got["changed"] == [], (rank, got)
            assert "nothing was loaded on any rank" in got["message"]
    if mode == "verified_small":
        assert any(k.startswith("param ") for got in outs for k in got["changed"])
        assert any("corrupted" in got["message"] for got in outs)


@pytest.mark.parametrize("mode", ["verified", "verified_small"])
@pytest.mark.parametrize("world", WORLDS)
def test_in_place_load_reads_in_bounded_batches(loads, mode, world):
    for out in loads[mode, world]:
        batches = out["batches"]
        leaves = batches[0][2]
        assert sum(n for n, _, _ in batches) == leaves
        if mode == "verified_small":  # buffer_bytes=1: one tensor at a time
            assert len(batches) == leaves and all(n == 1 for n, _, _ in batches)
        else:
            limit = fsdp_compose.checkpoint._load_checkpoint.DEFAULT_BUFFER_BYTES
            assert max(b for _, b, _ in batches) <= limit


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("world", WORLDS)
def test_successful_load_equals_plain_load_and_resumes(loads, mode, world):
    for out in loads[mode, world]:
        assert out["ok_vs_plain"] == []
        assert out["lr_after"] == [1e-2]          # the checkpoint's, not the live 0.123
        assert out["resume"] == (True, [])


# ------------------------------------------- an lr tensor shared by param groups
def _two_groups(model, lr):
    ps = list(model.parameters())
    return torch.optim.AdamW([{"params": ps[:3], "lr": lr}, {"params": ps[3:], "lr": lr}])


def _shared_lr_run(rank, world, path):
    torch.manual_seed(0)
    model = shard_ours(Net())
    opt = _two_groups(model, torch.tensor(0.01))
    train(model, opt, range(2), rank, world)
    opt.param_groups[1]["lr"] = torch.tensor(0.02)  # the groups differ in the checkpoint
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    out = {}
    for mode, kwargs in MODES.items():
        torch.manual_seed(1)
        live = shard_ours(Net())
        live_opt = _two_groups(live, torch.tensor(0.5))  # one tensor in both groups
        train(live, live_opt, [5], rank, world)
        load_checkpoint(live, live_opt, path, **kwargs)
        out[mode] = ([float(g["lr"]) for g in live_opt.param_groups],
                     _differences(_snapshot(model, opt), _snapshot(live, live_opt)))
    return out


def test_tensor_lr_shared_by_param_groups():
    """An lr tensor shared by the live param groups gets each group's own value
    (it is replaced, not written into: writing group 1's value into the shared
    tensor would give both groups 0.02)."""
    with tempfile.TemporaryDirectory(prefix="fsdp_safe_load_lr_") as root:
        outs = run_distributed(_shared_lr_run, 2, os.path.join(root, "ckpt"), timeout=TIMEOUT)
    for out in outs:
        for mode, (lrs, diff) in out.items():
            assert lrs == [pytest.approx(0.01), pytest.approx(0.02)], (mode, lrs)
            assert diff == [], (mode, diff)
