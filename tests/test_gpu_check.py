"""``python -m benchmarks.gpu_check``: the GPU check's dry run passes on CPU and
writes every key, a part past its time limit is reported and does not stop
the others, and the per-stream timeline reads a CUDA trace."""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from benchmarks import gpu_check
from tools import timeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(out, *extra, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", str(out),
                           "--dry-run", *extra], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_dry_run_passes_with_every_key(tmp_path):
    """Every part runs end to end on CPU (small models, the CUDA-job doubles),
    the JSON has the issue's keys and the figures each part promises, and the
    checks pass: ws1 loss parity, the planner within 10% at every fake world
    size (exactly, in fact), no sanitizer report."""
    proc = _run(tmp_path, "--limit-scale", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "gpu_check.json") as f:
        report = json.load(f)
    assert list(report) == ["env", "ws1", "fake_pg", "sanitizer", "scale", "files"]
    statuses = {k: report[k]["part"]["status"]
                for k in ("env", "ws1", "fake_pg", "sanitizer", "scale")}
    statuses["trace"] = report["fake_pg"]["trace"]["part"]["status"]
    assert set(statuses.values()) == {"ok"}, statuses
    assert report["env"]["dry_run"] is True and report["env"]["torch"]

    ws1 = report["ws1"]["models"]
    assert set(ws1) == {"demo", "llama"}
    for row in ws1.values():
        assert len(row["fsdp_compose"]["losses"]) == gpu_check.DRY_WS1_STEPS
        assert row["loss_max_rel_diff"] <= gpu_check.BF16_RTOL
        assert row["step_time_ratio"] > 0
    assert all(c["ok"] for c in report["ws1"]["checks"])

    worlds = report["fake_pg"]["world_sizes"]
    assert set(worlds) == {"2", "8", "2+offload"}
    for world, row in worlds.items():
        for impl in ("fsdp_compose", "fsdp2"):
            r = row[impl]
            assert "error" not in r, r.get("error")
            for k in ("step_ms", "tokens_per_s", "max_memory_allocated_mib",
                      "max_memory_reserved_mib", "hook_cpu_ms_per_step", "host_syncs_per_step"):
                assert k in r, (world, impl, k)
            assert r["hook_cpu_ms_per_step"] > 0
        assert row["planner"]["within_10pct"], row["planner"]
        assert row["planner"]["worst_rel_diff"] == 0.0, row["planner"]["figures"]
        assert "no transfer" in row["note"]

    trace = report["fake_pg"]["trace"]
    assert trace["trace"] == "gpu_check_trace.json.gz"
    with gzip.open(tmp_path / trace["trace"], "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name", "").startswith("fsdp_compose::post_backward") for e in events)
    assert trace["png"] is None and trace["png_skipped"]  # no device events on CPU

    san = report["sanitizer"]
    assert san["enabled"] is False and san["reports"] == []
    assert san["runs"] == {"2x1": {"steps_done": 4}, "1x2": {"steps_done": 4},
                           "padded8": {"steps_done": 4}}

    # one equal-size collective per bucket at a simulated 1024 ranks (ours padded)
    scale = report["scale"]
    assert all(c["ok"] for c in scale["checks"]), scale["checks"]
    for impl in ("fsdp_compose", "fsdp2"):
        assert "error" not in scale["runs"][impl], scale["runs"][impl].get("error")
        assert scale["runs"][impl]["host_ms"] > 0
    assert scale["runs"]["fsdp_compose"]["padded_groups"] > 0
    assert scale["planner"]["nccl_ops"] < scale["planner"]["nccl_ops_list_forms"]
    assert scale["host_ratio_ours_over_fsdp2"] > 0

    files = sorted(os.listdir(tmp_path))
    assert files == sorted(report["files"]) and len(files) <= gpu_check.MAX_FILES
    assert set(files) == {"gpu_check.json", "gpu_check.md", "gpu_check.log",
                          "gpu_check_trace.json.gz"}
    md = (tmp_path / "gpu_check.md").read_text()
    assert "Checks: all passed" in md and "no transfer" in md


def test_a_part_past_its_limit_is_reported_and_the_rest_runs(tmp_path):
    """A part killed at its limit is written as timed out, with every key
    still in the JSON, and the exit status says a part did not finish."""
    proc = _run(tmp_path, "--parts", "env", "sanitizer", "--limit-scale", "0.001", timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:]
    with open(tmp_path / "gpu_check.json") as f:
        report = json.load(f)
    assert list(report) == ["env", "ws1", "fake_pg", "sanitizer", "scale", "files"]
    for key in ("env", "sanitizer"):
        assert report[key]["part"]["status"].startswith("timed out"), report[key]
    assert report["ws1"] == {}


@pytest.mark.fast
def test_stream_spans_reads_device_events(tmp_path):
    """``tools.timeline.stream_spans``: kernels and copies per CUDA stream,
    the busiest named compute, the side streams' overlap with it."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "train_step 0", "ts": 0, "dur": 100, "tid": 1},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 10, "dur": 50, "tid": 7,
         "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 70, "dur": 20, "tid": 7,
         "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "div", "ts": 50, "dur": 20, "tid": 13,
         "args": {"stream": 13}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 95, "dur": 10, "tid": 13,
         "args": {"stream": 13}},
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    spans = timeline.stream_spans(str(path))
    assert list(spans["streams"]) == ["compute (stream 7)", "stream 13"]
    assert spans["kinds"]["stream 13"] == {"kernel": 1, "gpu_memcpy": 1}
    assert spans["steps"] == [0]
    ((name, (ms, share)),) = timeline.stream_overlap(spans).items()
    # stream 13 busy 30 µs: 10 of them under compute (50..60), 0 of the copy
    assert name == "stream 13" and ms == pytest.approx(0.03) and share == pytest.approx(1 / 3)
    if importlib.util.find_spec("matplotlib") is not None:  # (optional: the bench extra)
        png = timeline.plot_streams(spans, "t", str(tmp_path / "s.png"))
        assert os.path.getsize(png) > 1000


@pytest.mark.fast
def test_sanitizer_reports_are_found_whole():
    """A report of torch's CUDA sanitizer raises ``CUDASanitizerErrors`` at the
    racing op; the part finds it also when it comes wrapped (raised in a
    backward hook) and keeps each error's text."""

    class CUDASanitizerErrors(Exception):  # the sanitizer's exception, by name
        def __init__(self, errors):
            self.errors = errors

    report = CUDASanitizerErrors(["race on tensor 0x1 between stream 7 and stream 13"])
    assert gpu_check._sanitizer_errors(report).errors == report.errors
    try:
        try:
            raise report
        except Exception as e:
            raise RuntimeError("in a backward hook") from e
    except RuntimeError as wrapped:
        assert gpu_check._sanitizer_errors(wrapped) is report
    assert gpu_check._sanitizer_errors(RuntimeError("CUDASanitizerErrors: detected 1 errors"))
    assert gpu_check._sanitizer_errors(RuntimeError("an ordinary error")) is None
