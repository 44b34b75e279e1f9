"""The stacks users run FSDP2 with, driving fsdp_compose through
``use_as_fsdp2()``: accelerate's FSDP2 plugin (train, ``save_state`` /
``load_state``, ``get_state_dict``) and the transformers Trainer (a checkpoint
in both state-dict types, ``resume_from_checkpoint``) against torch's FSDP2 on
the same script,
2 gloo ranks (see tests/_ecosystem.py for how both are put on accelerate's
FSDP2 path on CPU)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

# Checked without importing them: the test processes are forked from pytest's,
# and transformers imported here would make every later fork carry (and copy
# on write) its objects.
for _name in ("accelerate", "transformers"):
    if importlib.util.find_spec(_name) is None:
        pytest.skip(f"needs {_name} (the test extra)", allow_module_level=True)

# every test reads one fixture, the two stacks' runs: minutes on a 2-core machine
pytestmark = pytest.mark.slow

from . import _ecosystem  # noqa: E402


@pytest.fixture(scope="module")
def runs():
    return _ecosystem.launches()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_both_take_accelerates_fsdp2_path(runs):
    for name, per_rank in runs.items():
        if name.startswith("trainer_"):
            continue  # (test_trainer_trains_and_resumes_as_fsdp2)
        for r in per_rank:
            assert r["is_fsdp2"] and r["fsdp_module"], name
    assert runs["ours"][0]["class_from"] == "fsdp_compose._runtime._fsdp_module"
    assert runs["fsdp2"][0]["class_from"].startswith("torch.distributed.fsdp")


def test_training_equals_fsdp2_bitwise(runs):
    for ours, f2 in zip(runs["ours"], runs["fsdp2"]):
        assert ours["before"] == f2["before"]
        assert ours["uninterrupted"] == f2["uninterrupted"]


def test_state_dicts_hold_fsdp2s_objects(runs):
    for r in runs["ours"]:
        assert r["state_types"] == ["DTensor"]
        assert r["optim_types"] == ["DTensor", "Tensor"]  # exp_avg(_sq); step
        # the parameters themselves (DTensors over our rows), not converted copies
        assert r["state_classes"] == ["RowParam"]


def test_save_state_load_state_resume_bit_exact(runs):
    for r in runs["ours"]:
        assert r["resumed"] == r["uninterrupted"]
    r0 = runs["ours"][0]  # full tensors live on rank 0
    assert r0["full_at_save"] and _same(r0["full_loaded"], r0["full_at_save"])
    assert _same(r0["full_resumed"], r0["full_after"])
    assert runs["ours"][1]["full_at_save"] == {}


def test_get_state_dict_equals_fsdp2s(runs):
    assert _same(runs["ours"][0]["full_at_save"], runs["fsdp2"][0]["full_at_save"])
    assert _same(runs["ours"][0]["full_after"], runs["fsdp2"][0]["full_after"])


def test_checkpoints_interchange_with_fsdp2(runs):
    ours, f2 = runs["ours"][0], runs["fsdp2"][0]
    a, b = runs["ours_from_fsdp2"][0], runs["fsdp2_from_ours"][0]
    assert _same(a["full_loaded"], f2["full_at_save"]) and a["resumed"] == f2["uninterrupted"]
    assert _same(b["full_loaded"], ours["full_at_save"]) and b["resumed"] == ours["uninterrupted"]


MAX_NORM = 1.0  # the Trainer's max_grad_norm (its default)


@pytest.mark.parametrize("sd_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_trainer_trains_and_resumes_as_fsdp2(runs, sd_type):
    ours, f2 = runs[f"trainer_ours_{sd_type}"], runs[f"trainer_fsdp2_{sd_type}"]
    for r in ours + f2:
        assert r["fsdp2_path"]
    assert ours[0]["class_from"] == "fsdp_compose._runtime._fsdp_module"
    for a in ours:  # resumed against our own run: the same sums in the same order
        assert a["resumed"] == a["losses"][-2:]           # resumed at step 2: the same steps 3-4
    assert ours[0]["full"] and _same(ours[0]["full_resumed"], ours[0]["full"])

    # Against FSDP2. The Trainer clips at MAX_NORM: FSDP2's norm is a DTensor
    # reduction over its chunks, ours the same sum of squares over our rows, in
    # another order, so the two norms agree to the rounding of a float32 sum of
    # P ~ 1e5 squares (pairwise: ~log2(P)·2^-24 ~ 1e-6 relative; asserted at
    # 1e-5, measured ~1e-7). Where the clip is active (norm + 1e-6 > MAX_NORM,
    # torch's clip_coef) the gradients are scaled by factors that differ in the
    # last bits, and which way the parameters' last bits fall depends on the
    # CPU's vector kernels; where it is not, the factor is clamped to exactly 1.
    a_full, b_full = ours[0]["full"], f2[0]["full"]
    assert a_full.keys() == b_full.keys()
    dp = torch.cat([(a_full[k].double() - b_full[k].double()).flatten() for k in a_full])
    for a, b in zip(ours, f2):
        assert len(a["grad_norms"]) == len(a["losses"]) == 4
        assert a["grad_norms"] == pytest.approx(b["grad_norms"], rel=1e-5)
        clipped = [n + 1e-6 > MAX_NORM for n in b["grad_norms"]]
        # Step s's loss is computed before update s: bitwise up to and including
        # the first step after which a clipped update was applied.
        exact = next((s + 1 for s, c in enumerate(clipped) if c), len(clipped))
        assert a["losses"][:exact] == b["losses"][:exact]
        # Later losses: the parameters differ by the clip's rounding (dp, measured
        # at the end of the run, where the differences are largest); to first
        # order |dL| <= ||grad L||_2 · ||dp||_2 (Cauchy-Schwarz), with the norm
        # of the step's gradient as logged; a factor 2 covers the second-order
        # term and the loss's own rounding (2 ulps of a float32 loss ~5).
        for s in range(exact, len(clipped)):
            bound = 2 * b["grad_norms"][s] * float(dp.norm()) + 2 * 2**-23 * abs(b["losses"][s])
            assert abs(a["losses"][s] - b["losses"][s]) <= bound, (s, bound)
    # The parameters after the run: Adam turns a last-bit difference of the
    # clipped gradient into at most a relative difference of that size in the
    # update (lr·1e-7 here) except where a gradient is near Adam's eps, where
    # it is amplified (measured: at most 4e-6 in an embedding row; 1e-7
    # elsewhere; parameters ~0.1); a wrong gradient moves them by ~lr (1e-2).
    assert float(dp.abs().max()) <= 2e-5
