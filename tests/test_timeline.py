"""``python -m tools.timeline``: a profiled run read back into per-unit compute and collectives."""
from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest

from tests._dist import run_distributed
from tools.plan import PlanConfig, plan_world
from tools.timeline import _spans, overlap, plot, profile_rank

CFG = PlanConfig(dim=128, layers=3, bucket_bytes=0, schedule="gloo")


@pytest.fixture(scope="module")
def spans(tmp_path_factory):
    """Rank 0's spans of a profiled 2-rank run of ``CFG`` (2 steps)."""
    out = str(tmp_path_factory.mktemp("timeline"))
    return _spans(run_distributed(profile_rank, 2, CFG, 2, 1, out, timeout=180)[0])


def test_timeline_attributes_every_collective_to_its_unit(spans):
    units = ["", "layers.0", "layers.1", "layers.2"]
    assert spans["order"] == units
    # 2 steps: each unit gathered in forward; the blocks again in backward
    # (the root keeps its parameters); each all-gather = 2 broadcasts
    gathers = {u: len(spans["all_gather"].get(u, [])) for u in units}
    assert gathers == {"": 2 * 2, "layers.0": 2 * 4, "layers.1": 2 * 4, "layers.2": 2 * 4}
    assert {u: len(spans["reduce_scatter"].get(u, [])) for u in units} == dict.fromkeys(units, 2)
    for u in units:
        assert sum(b - a for a, b in spans["compute"][u]) > 0, u
    assert len(spans["optimizer"]) == 2 and len(spans["steps"]) == 2
    ms, share = overlap(spans, "all_gather")
    assert ms > 0 and 0 <= share <= 1


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib (the optional bench extra) is not installed")
def test_timeline_plot(spans, tmp_path):
    """The PNG (matplotlib: the optional bench extra; skipped without it,
    before the profiled run, which the test above checks either way)."""
    png = plot(spans, "test", os.path.join(tmp_path, "t.png"))
    assert os.path.getsize(png) > 10_000


def test_timeline_shows_the_planned_collectives_with_buckets(tmp_path):
    """With buckets, every collective is still drawn once, on a unit: as many
    as the plan counts (an all-gather is one broadcast per rank)."""
    cfg = dataclasses.replace(CFG, bucket_bytes=1 << 20)
    row = plan_world(cfg, 2).row
    assert row["all_gather_calls"] < 2 * 4 - 1  # buckets merged some units
    spans = _spans(run_distributed(profile_rank, 2, cfg, 1, 1, str(tmp_path), timeout=180)[0])
    assert sum(map(len, spans["all_gather"].values())) == 2 * row["all_gather_calls"]
    assert sum(map(len, spans["reduce_scatter"].values())) == row["reduce_scatter_calls"]
    assert set(spans["all_gather"]) <= set(spans["order"])
