"""Imports inside fsdp_compose flow one way (tools/import_graph.py).

No cycle, counting imports inside functions: a module may only call down.
See docs/architecture.md for the layers.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tools import import_graph

ROOT = Path(__file__).resolve().parent.parent


def test_no_import_cycle():
    res = subprocess.run([sys.executable, "-m", "tools.import_graph"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("layer 0:"), res.stdout


def test_registry_is_a_leaf():
    """What is attached to modules and Parameters is readable from anywhere."""
    edges = import_graph.graph()
    runtime = [m for m, k in edges["fsdp_compose._registry"].items() if k != "type"]
    assert runtime == [], runtime


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "fsdp_compose"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in files.items():
        (pkg / f"{name}.py").write_text(text)
    return pkg


def test_finds_a_function_level_cycle(tmp_path):
    """The check can fail: a cycle closed by an import inside a function,
    not one closed only under TYPE_CHECKING."""
    pkg = _package(tmp_path, {
        "a": "from . import b\n",
        "b": "def f():\n    from .a import x\n",
        "c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import y\n",
        "d": "from .c import z\n",
    })
    edges = import_graph.graph(pkg)
    assert edges["fsdp_compose.b"] == {"fsdp_compose.a": "function"}
    assert edges["fsdp_compose.c"] == {"fsdp_compose.d": "type"}
    assert import_graph.cycles(edges) == [["fsdp_compose.a", "fsdp_compose.b", "fsdp_compose.a"]]


def test_sizes_reports_the_largest():
    pkg_sizes = import_graph.sizes()
    assert set(pkg_sizes) == {"file", "class", "function"}
    assert all(n > 0 and where for n, where in pkg_sizes.values())
