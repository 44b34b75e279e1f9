"""The stacks users run FSDP2 with, driving fsdp_compose through
``use_as_fsdp2()``: accelerate's FSDP2 plugin (train, ``save_state`` /
``load_state``, ``get_state_dict``) against torch's FSDP2 on the same script,
2 gloo ranks (see tests/_ecosystem.py for how both are put on accelerate's
FSDP2 path on CPU)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from . import _ecosystem  # noqa: E402


@pytest.fixture(scope="module")
def runs():
    return _ecosystem.launches()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_both_take_accelerates_fsdp2_path(runs):
    for name, per_rank in runs.items():
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
