"""``benchmarks.before_after``'s plumbing, never its timings: the argument
defaults, the tables from a made-up result set, and that a rank imports
fsdp_compose from a ``git archive`` of a ref (the "before" side)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks import before_after as ba

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.fast
def test_arguments():
    a = ba.build_parser().parse_args([])
    assert (a.ref, a.part, a.quick, a.repeats, a.ckpt_shape) == (None, "all", False, None, None)
    assert a.shape == list(ba.SHAPES)
    a = ba.build_parser().parse_args(["--ref", "main", "--part", "optim", "--quick",
                                      "--shape", "overhead"])
    assert (a.ref, a.part, a.quick, a.shape) == ("main", "optim", True, ["overhead"])
    with pytest.raises(SystemExit):
        ba.build_parser().parse_args(["--part", "nope"])
    assert [ba.order(r) for r in range(4)] == [  # one of each per repeat, rotating
        ["before", "after", "fsdp2"], ["after", "fsdp2", "before"],
        ["fsdp2", "before", "after"], ["before", "after", "fsdp2"]]


def _peers_rec(step, opt, foreach, peak, losses):
    return {"step_ms": step, "step_cpu_ms": step, "optim_default_ms": opt,
            "optim_default_cpu_ms": opt, "optim_foreach_ms": foreach,
            "optim_foreach_cpu_ms": foreach, "peak_mib": peak, "losses": losses,
            "warmup": 3, "steps": 45, "optim_steps": 50}


def _ckpt_rec(take, take_mib):
    return {"take_s": take, "take_mib": take_mib, "save_s": 2.0, "save_mib": 300.0,
            "load_s": 3.0, "load_mib": 2.0, "size_mib": 1536.0}


@pytest.mark.fast
def test_report_from_a_fake_result_set():
    peers = {"before": [_peers_rec(60.0, 2.0, 1.0, 270, [1.0, 0.5]),
                        _peers_rec(62.0, 2.2, 1.0, 271, [1.0, 0.5])],
             "after": [_peers_rec(61.0, 2.0, 1.2, 270, [1.0, 0.5]),
                       _peers_rec(61.0, 2.2, 1.2, 272, [1.0, 0.5])],
             "fsdp2": [_peers_rec(400.0, 20.0, 3.0, 280, [1.0, 0.5000001])] * 2}
    ckpt = {"before": [_ckpt_rec(3.2, 769.0)], "after": [_ckpt_rec(0.1, 0.0)],
            "fsdp2": [_ckpt_rec(0.07, 0.0)]}
    results = {"meta": {"before": "abc (x)", "after": "working tree at def", "same_code": False,
                        "world": 2, "repeats": 2, "quick": False, "ckpt_shape": "memory",
                        "torch": "2.13.0"},
               "peers": {"overhead": peers}, "checkpoint": ckpt}
    text = ba.report(results)
    lines = {ln.strip().split("  ")[0]: ln for ln in text.splitlines()}
    step = lines["step ms"]
    assert "1.00 [0.98..1.02] ok" in step          # after/before, per-repeat range, limit
    assert " 0.15 " in step and step.rstrip().endswith("0.15")  # after/FSDP2, before/FSDP2
    assert "1.20 [1.20..1.20] OVER 1.03" in lines["optim.step() ms, foreach"]
    assert "bit-identical over 2 steps" in text
    take = lines["take peak +MiB"]
    assert take.split()[-3:] == ["0.00", "-", "-"]  # after/before; no ratio over +0 MiB
    assert "0.03" in lines["take s"]               # 0.1 / 3.2
    assert "OVER" in text.split("== after / before")[1]


def test_extract_imports_before_from_its_folder(tmp_path):
    """``extract`` puts HEAD's fsdp_compose/ in a folder; a process imports it
    from there (not from this checkout), and refuses a second copy."""
    dest = ba.extract("HEAD", str(tmp_path))
    assert os.path.isfile(os.path.join(dest, "fsdp_compose", "__init__.py"))
    code = ("import sys; from benchmarks._launch import import_fsdp_compose_from as f\n"
            f"print(f({dest!r}))\n"
            "sys.modules['fsdp_compose'].__file__ = '/elsewhere/fsdp_compose/__init__.py'\n"
            "try:\n"
            f"    f({dest!r})\n"
            "except RuntimeError as e:\n"
            "    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()[:2]
    assert first.startswith(os.path.realpath(dest) + os.sep)
    assert second.startswith("refused: fsdp_compose is already imported from /elsewhere")
