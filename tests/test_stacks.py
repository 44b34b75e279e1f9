"""The stacks, unchanged (issue 37): torchtitan's llama3 debug model through its
own ``Trainer``, and Lightning's ``ModelParallelStrategy``, run by the same
script on torch's FSDP2 and on fsdp_compose (``use_as_fsdp2()`` the only
difference), 2 gloo ranks on CPU, and torchtitan's 2-D plan (tensor parallel
inside the blocks, fully_shard over dp) on 4. The scripts are tests/_stacks.py; the CPU
shims they apply (to both implementations), each with why FSDP2 needs it here:

* torchtitan: the device type and module ("cuda" / ``torch.cuda`` on a
  machine without an accelerator; CPU and ``torch.cpu`` with the memory
  statistics its metrics read); the attention backend (FlexAttention has no
  backward on CPU in torch 2.13: SDPA); the SPMD backend ("partial_dtensor":
  torch 2.13's fully_shard refuses the dp_mesh_dims of torchtitan's default
  spmd_types backend); ``torch.distributed.set_timeout`` (missing on torch
  2.13: a no-op); the module importing ``triton`` (its MoE kernels, a stub
  module; torch's CPU build has no triton); FSDP2's
  ``set_force_sum_reduction_for_comms(True)`` after torchtitan's
  ``set_gradient_divide_factor(1.0)`` (gloo has no PREMUL_SUM); a generated
  tokenizer and generated documents (no download); 2 of the debug model's 6
  layers and short sequences (CPU time).
* Lightning: none (ModelParallelStrategy runs on CPU/gloo as it is; the test
  harness's processes carry torchrun's variables, so Lightning creates none).

What is asserted is the behaviour wanted: ours trains with FSDP2's losses
bitwise (both start from the same weights: torchtitan's seed checkpoint, and
the same seed in Lightning), its parameters are DTensors as FSDP2's are, and
it resumes bitwise from each stack's checkpoints, as FSDP2's runs do here.
"""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from . import _stacks
from ._stacks import (LIT_BATCHES, LIT_EPOCHS, LIT_SAVE_AT, TITAN_SAVE_AT, TITAN_STEPS,
                      _losses)

# Checked without importing them: the test processes are forked from pytest's
# (the stacks' packages are imported in tests/_stacks.py's driver process only).
HAVE = {stack: all(importlib.util.find_spec(n) is not None for n in names)
        for stack, names in _stacks.PACKAGES.items()}
if not any(HAVE.values()):
    pytest.skip("needs torchtitan or pytorch-lightning", allow_module_level=True)

# one fixture, every stack's runs: minutes on a 2-core machine
pytestmark = pytest.mark.slow

titan = pytest.mark.skipif(not HAVE["torchtitan"], reason="needs torchtitan==0.3.0 (and its "
                           "datasets, tokenizers, torchdata)")
titan2d = pytest.mark.skipif(not HAVE["torchtitan 2-D"], reason="needs torchtitan==0.3.0 (and "
                             "its datasets, tokenizers, torchdata)")
lightning = pytest.mark.skipif(not HAVE["Lightning"], reason="needs pytorch-lightning")
lightning1 = pytest.mark.skipif(not HAVE["Lightning 1 device"], reason="needs pytorch-lightning")


@pytest.fixture(scope="module")
def runs():
    return _stacks.launches([stack for stack, ok in HAVE.items() if ok])


def _reached(ranks: list, stage: str, order: list) -> None:
    """Fail with the run's own error unless every rank got past ``stage``: the
    first rank whose error is its own (not a peer gone), with its traceback."""
    failed = [(rank, r) for rank, r in enumerate(ranks)
              if "error" in r and order.index(r.get("stage", order[0])) <= order.index(stage)]
    if not failed:
        return
    rank, r = next(((k, r) for k, r in failed if not _stacks.induced(r["error"])), failed[0])
    others = "".join(f"\n  rank {k}: {x['error'].splitlines()[0]}" for k, x in failed if k != rank)
    pytest.fail(f"rank {rank} failed at {r['stage']}: {r['error']}{others}\n"
                f"{r.get('traceback', '')}")


def _dtensors_as_fsdp2s(ours: dict, f2: dict) -> None:
    """Every parameter a DTensor, sharded on dim 0 of the same mesh as FSDP2's
    (a Shard(0) placement or a subclass of Shard that carries our split), with
    the unsharded shape."""
    assert ours["dtensor"] == ours["count"] == f2["count"] > 0, (
        f"{ours['dtensor']} of {ours['count']} parameters are DTensors (FSDP2: "
        f"{f2['dtensor']} of {f2['count']})")
    assert ours["shard_dims"] == f2["shard_dims"] == [(0,)], ours["placements"]
    assert ours["meshes"] == f2["meshes"]
    assert ours["shapes"] == f2["shapes"]


TITAN_ORDER = ["launch", "seed", "import", "build", "train", "resume", "done"]


def _titan(runs, impl: str, stage: str, key: str = "titan") -> list:
    ranks = runs[f"{key}_{impl}"]
    _reached(ranks, stage, TITAN_ORDER)
    return ranks


def _steps(rec: list) -> list:
    return [x for x in rec if x[0] != "load"]


@titan
def test_titan_fsdp2_reference(runs):
    """FSDP2's run: the reference the others are held to."""
    ranks = _titan(runs, "fsdp2", "resume")
    for r in ranks:
        assert r["params"]["dtensor"] == r["params"]["count"] > 0
        # the seed checkpoint (uninterrupted run) and step TITAN_SAVE_AT (resumed) loaded
        assert r["uninterrupted"][0] == ("load", True) and r["resumed"][0] == ("load", True)
        losses = _losses(r["uninterrupted"])
        assert [s for s, _ in losses] == list(range(1, TITAN_STEPS + 1))
        assert all(math.isfinite(v) for _, v in losses)
        assert _losses(r["resumed"]) == losses[TITAN_SAVE_AT:]
        assert r["divide_factor_units"] and r["divide_factor_units"][0] > 0
    # torchtitan logs the global loss: the same on both ranks
    assert _losses(ranks[0]["uninterrupted"]) == _losses(ranks[1]["uninterrupted"])


@titan
def test_titan_builds_and_inits_after_sharding(runs):
    """Built on meta, sharded by torchtitan's parallelize_llama, then its
    init_weights (the fused-QKV init copies a full tensor into each parameter)."""
    ours = _titan(runs, "ours", "build")
    assert ours[0]["params"]["class_from"] == "fsdp_compose._runtime._fsdp_module"


@titan
def test_titan_parameters_are_dtensors(runs):
    ours, f2 = _titan(runs, "ours", "build"), _titan(runs, "fsdp2", "build")
    for a, b in zip(ours, f2):
        _dtensors_as_fsdp2s(a["params"], b["params"])


@titan
def test_titan_trains_as_fsdp2(runs):
    """The same losses, bitwise, from the same seed checkpoint. torchtitan clips
    (at a max norm above these steps' norms: a scale of exactly 1.0); the norms
    are sums of squares over different shards, in another order: equal to
    float32 rounding."""
    ours, f2 = _titan(runs, "ours", "train"), _titan(runs, "fsdp2", "train")
    for a, b in zip(ours, f2):
        assert _losses(a["uninterrupted"]) == _losses(b["uninterrupted"])
        na = [x[2] for x in _steps(a["uninterrupted"])]
        nb = [x[2] for x in _steps(b["uninterrupted"])]
        assert na == pytest.approx(nb, rel=1e-5)
        assert a["divide_factor_units"] == b["divide_factor_units"]


@titan
def test_titan_checkpoint_resumes_bitwise(runs):
    """torchtitan's CheckpointManager at step TITAN_SAVE_AT; a fresh Trainer
    resumes and trains the last steps: the uninterrupted run's losses."""
    ours, f2 = _titan(runs, "ours", "resume"), _titan(runs, "fsdp2", "resume")
    for a, b in zip(ours, f2):
        assert a["resumed"][0] == ("load", True)
        assert _losses(a["resumed"]) == _losses(a["uninterrupted"])[TITAN_SAVE_AT:]
        assert _losses(a["resumed"]) == _losses(b["resumed"])


@titan2d
def test_titan_2d_parameters_are_dtensors_on_the_2d_mesh(runs):
    """torchtitan's (dp 2, tp 2) plan: TP inside each block, fully_shard over dp,
    then its init_weights. Every parameter is a DTensor on the 2-D mesh, as
    FSDP2's are, placed on the same tensor dims: ``(RowShard, Shard(1))`` for
    FSDP2's ``(Shard(0), Shard(1))``, ``(RowShard within TP blocks, Shard(0))``
    for its ``(_StridedShard(0), Shard(0))``, ``(RowShard, Replicate())`` for
    its ``(Shard(0), Replicate())``."""
    ours, f2 = _titan(runs, "ours", "build", "titan2d"), _titan(runs, "fsdp2", "build", "titan2d")
    for a, b in zip(ours, f2):
        pa, pb = a["params"], b["params"]
        assert pa["dtensor"] == pa["count"] == pb["dtensor"] == pb["count"] > 0, pa
        assert pa["meshes"] == pb["meshes"] == [(2, 4)], (pa["meshes"], pb["meshes"])
        assert pa["shard_dims"] == pb["shard_dims"], (pa["placements"], pb["placements"])
        assert pa["shapes"] == pb["shapes"]
        assert any("within 2 TP blocks" in pl for pl in pa["placements"]), pa["placements"]


@titan2d
def test_titan_2d_trains_and_resumes_as_fsdp2(runs):
    """The same losses as FSDP2's, bitwise, from the same seed checkpoint, and
    a resume from torchtitan's CheckpointManager that repeats them."""
    ours = _titan(runs, "ours", "resume", "titan2d")
    f2 = _titan(runs, "fsdp2", "resume", "titan2d")
    for a, b in zip(ours, f2):
        assert _losses(a["uninterrupted"]) == _losses(b["uninterrupted"])
        na = [x[2] for x in _steps(a["uninterrupted"])]
        nb = [x[2] for x in _steps(b["uninterrupted"])]
        assert na == pytest.approx(nb, rel=1e-5)
        assert a["resumed"][0] == ("load", True)
        assert _losses(a["resumed"]) == _losses(a["uninterrupted"])[TITAN_SAVE_AT:]
        assert _losses(a["resumed"]) == _losses(b["resumed"])


LIT_ORDER = ["launch", "fit", "resume", "done"]
FORMATS = list(_stacks.LIT_FORMATS)  # save_distributed_checkpoint=True / False


def _lit(runs, impl: str, fmt: str, stage: str, key: str = "lit") -> list:
    ranks = [r[fmt] for r in runs[f"{key}_{impl}"]]
    _reached(ranks, stage, LIT_ORDER)
    return ranks


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@lightning
@pytest.mark.parametrize("fmt", FORMATS)
def test_lit_fsdp2_reference(runs, fmt):
    for r in _lit(runs, "fsdp2", fmt, "resume"):
        assert r["params"]["dtensor"] == r["params"]["count"] > 0
        assert len(r["uninterrupted"]) == LIT_EPOCHS * LIT_BATCHES
        assert r["resumed"] == r["uninterrupted"][LIT_SAVE_AT * LIT_BATCHES:]
        assert _same(r["full_resumed"], r["full_after"])
    # FSDP2's two uninterrupted runs (one per format) agree
    for a, b in zip(_lit(runs, "fsdp2", "sharded", "fit"), _lit(runs, "fsdp2", "full", "fit")):
        assert a["uninterrupted"] == b["uninterrupted"] and _same(a["full_after"], b["full_after"])


@lightning
def test_lit_trains_as_fsdp2(runs):
    """configure_model's fully_shard, fit: FSDP2's losses and parameters, bitwise."""
    for fmt in FORMATS:
        for a, b in zip(_lit(runs, "ours", fmt, "fit"), _lit(runs, "fsdp2", fmt, "fit")):
            assert a["params"]["class_from"] == "fsdp_compose._runtime._fsdp_module"
            assert a["uninterrupted"] == b["uninterrupted"]
            assert _same(a["full_after"], b["full_after"])


@lightning
def test_lit_parameters_are_dtensors(runs):
    for a, b in zip(_lit(runs, "ours", "sharded", "fit"), _lit(runs, "fsdp2", "sharded", "fit")):
        _dtensors_as_fsdp2s(a["params"], b["params"])


@lightning
@pytest.mark.parametrize("fmt", FORMATS)
def test_lit_checkpoint_resumes_bitwise(runs, fmt):
    """``trainer.save_checkpoint`` at the end of epoch LIT_SAVE_AT; a fresh module
    (another seed) and Trainer ``fit(..., ckpt_path=)``: the uninterrupted run's
    last epoch, losses and parameters."""
    ours, f2 = _lit(runs, "ours", fmt, "resume"), _lit(runs, "fsdp2", fmt, "resume")
    for a, b in zip(ours, f2):
        assert a["resumed"] == a["uninterrupted"][LIT_SAVE_AT * LIT_BATCHES:]
        assert _same(a["full_resumed"], a["full_after"])
        assert a["resumed"] == b["resumed"]


@lightning1
@pytest.mark.parametrize("fmt", FORMATS)
def test_lit_one_device_trains_and_resumes_as_fsdp2(runs, fmt):
    """ModelParallelStrategy on one device (data_parallel_size=1): fully_shard
    at world size 1, called by FSDP2's name, gives DTensor parameters as
    FSDP2's does, so Lightning finds the model and resumes (it raised
    "Could not find a distributed model" while they were plain tensors);
    FSDP2's losses and parameters, bitwise."""
    ours = _lit(runs, "ours", fmt, "resume", "lit1")
    f2 = _lit(runs, "fsdp2", fmt, "resume", "lit1")
    for a, b in zip(ours, f2):
        assert a["params"]["dtensor"] == a["params"]["count"] == b["params"]["count"] > 0
        assert a["uninterrupted"] == b["uninterrupted"] and _same(a["full_after"], b["full_after"])
        per = _stacks.lit_per_epoch(a)
        assert a["resumed"] == a["uninterrupted"][LIT_SAVE_AT * per:] == b["resumed"]
        assert _same(a["full_resumed"], a["full_after"])


def test_table(runs):
    """``python -m tests._stacks``'s table: a row per step of each stack run."""
    text = _stacks.table(runs)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    want = (len(_stacks.TITAN_STEPS_TEXT) * (HAVE["torchtitan"] + HAVE["torchtitan 2-D"])
            + len(_stacks.LIT_STEPS_TEXT) * (HAVE["Lightning"] + HAVE["Lightning 1 device"]))
    assert len(rows) == 1 + want
