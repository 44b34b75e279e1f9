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
    assert runs["ours"][0]["class_from"] == "fsdp_compose._fsdp_module"
    assert runs["fsdp2"][0]["class_from"].startswith("torch.distributed.fsdp")


def test_training_equals_fsdp2_bitwise(runs):
    for ours, f2 in zip(runs["ours"], runs["fsdp2"]):
        assert ours["before"] == f2["before"]
        assert ours["uninterrupted"] == f2["uninterrupted"]


def test_state_dicts_hold_fsdp2s_objects(runs):
    for r in runs["ours"]:
        assert r["state_types"] == ["DTensor"]
        assert r["optim_types"] == ["DTensor", "Tensor"]  # exp_avg(_sq); step


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


@pytest.mark.parametrize("sd_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_trainer_trains_and_resumes_as_fsdp2(runs, sd_type):
    ours, f2 = runs[f"trainer_ours_{sd_type}"], runs[f"trainer_fsdp2_{sd_type}"]
    for r in ours + f2:
        assert r["fsdp2_path"]
    assert ours[0]["class_from"] == "fsdp_compose._fsdp_module"
    for a, b in zip(ours, f2):
        assert a["losses"] == b["losses"]                 # bitwise, as FSDP2's
        assert a["resumed"] == a["losses"][-2:]           # resumed at step 2: the same steps 3-4
    assert ours[0]["full"] and _same(ours[0]["full_resumed"], ours[0]["full"])
    # The Trainer clips (max_grad_norm 1.0): FSDP2's norm is a DTensor reduction,
    # ours the same sum in another order, so the norms agree to rounding, and so
    # do the parameters after the step they scale (measured: at most 4e-6 where
    # an embedding row's gradient is near zero and Adam's eps dominates, 1e-7
    # elsewhere; parameters ~0.1).
    for a, b in zip(ours, f2):
        assert len(a["grad_norms"]) == 4
        assert a["grad_norms"] == pytest.approx(b["grad_norms"], rel=1e-5)
    a, b = ours[0]["full"], f2[0]["full"]
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=2e-5) for k in a)
