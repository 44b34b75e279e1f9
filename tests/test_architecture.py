"""Imports inside fsdp_compose flow one way (tools/import_graph.py).

No cycle, counting imports inside functions: a module may only call down.
See docs/architecture.md for the layers.
"""
from __future__ import annotations

import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from tools import import_graph

# the one-minute tier (make test-fast): no torch; one child Python process (the
# import-graph check, about a second)
pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent


def test_no_import_cycle():
    res = subprocess.run([sys.executable, "-m", "tools.import_graph"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("layer 0:"), res.stdout


def test_registry_is_a_leaf():
    """What is attached to modules and Parameters is readable from anywhere."""
    edges = import_graph.graph()
    runtime = [m for m, k in edges["fsdp_compose._base._registry"].items() if k != "type"]
    assert runtime == [], runtime


def test_job_is_a_leaf():
    """Per-job state (_job.py) is readable from anywhere."""
    edges = import_graph.graph()
    assert edges["fsdp_compose._base._job"] == {}, edges["fsdp_compose._base._job"]


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    """A fake package: ``{"folder/name": text}`` (or a top-level ``name``)."""
    pkg = tmp_path / "fsdp_compose"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in files.items():
        path = pkg / f"{name}.py"
        if not path.parent.exists():
            path.parent.mkdir(parents=True)
            (path.parent / "__init__.py").write_text("")
        path.write_text(text)
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


# ------------------------------------------------------------------ layers
# The folders are the layers, lowest first: a module imports (at run time)
# only modules of its own folder or of a lower one, and ``api`` (value types,
# a leaf). Only the public top (``fsdp_compose``, ``api``, ``cli``, ``demo``)
# lives outside them. See docs/architecture.md.
LAYERS = ("_base", "_plan", "_comm", "_group", "checkpoint", "_optim", "_runtime")
TOP = {"fsdp_compose", "fsdp_compose.api", "fsdp_compose.cli"}


def _layer(mod: str) -> int | None:
    parts = mod.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 2 and parts[1] in LAYERS else None


def layer_violations(pkg: Path) -> list[str]:
    edges = import_graph.graph(pkg)
    bad = []
    for mod in sorted(edges):
        src = _layer(mod)
        if src is None:
            if mod not in TOP and not mod.startswith("fsdp_compose.demo") \
                    and mod.split(".")[-1] not in LAYERS:
                bad.append(f"{mod} is outside the layer folders")
            continue
        for target, kind in sorted(edges[mod].items()):
            if kind == "type":
                continue  # (names a type for the reader; never runs)
            dst = _layer(target)
            if dst is None and target != "fsdp_compose.api" \
                    and target.split(".")[-1] not in LAYERS:
                bad.append(f"{mod} imports {target} (above every layer)")
            elif dst is not None and dst > src:
                bad.append(f"{mod} imports {target} (layer {LAYERS[dst]} is above "
                           f"{LAYERS[src]})")
    return bad


def test_folders_are_layers():
    assert layer_violations(ROOT / "fsdp_compose") == []


def test_layer_check_can_fail(tmp_path):
    pkg = _package(tmp_path, {
        "_base/_common": "from .._group import _flat_group\n",
        "_group/_flat_group": "from .._base import _common\nfrom .. import api\n",
        "_runtime/_state": "from .._group._flat_group import x\n",
        "_plan/_layout": "def f():\n    from ..cli import main\n",
        "api": "", "cli": "", "_stray": "",
    })
    assert layer_violations(pkg) == [
        "fsdp_compose._base._common imports fsdp_compose._group._flat_group "
        "(layer _group is above _base)",
        "fsdp_compose._plan._layout imports fsdp_compose.cli (above every layer)",
        "fsdp_compose._stray is outside the layer folders",
    ]


# ------------------------------------------------------- direction of control
# [Note: who decides] in fsdp_compose/_runtime/_unit.py: units report, the schedule
# decides and issues. Kept as import rules, read with ast.
SCHEDULE = {"fsdp_compose._runtime._state", "fsdp_compose._runtime._backward_schedule"}
GROUP_OPS = "fsdp_compose._group._group_ops"
# the bucket operations below the group operations, and where they live
BUCKET_OPS = {"gather_bucket": "fsdp_compose._group._flat_group",
              "launch_bucket": "fsdp_compose._group._grad_path",
              "gather_together": "fsdp_compose._group._extension"}
UNIT = "fsdp_compose._runtime._unit"
UNIT_NEVER_IMPORTS = SCHEDULE | {GROUP_OPS, "fsdp_compose._group._extension"}


def _imported_names(pkg: Path) -> dict[str, set[tuple[str, str]]]:
    """Module -> {(module imported from, name)} for every ``from x import n``
    of the package, at any depth (TYPE_CHECKING ones too: they are not rules'
    exceptions)."""
    import ast
    out: dict[str, set] = {}
    for name, path in import_graph.modules(pkg).items():
        pkg_parts = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
        found = out.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = pkg_parts[:len(pkg_parts) - node.level + 1] if node.level else []
                src = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    found.add((src, alias.name))
    return out


def control_violations(pkg: Path) -> list[str]:
    """Only the schedule imports the group operations; only the group
    operations import the bucket operations; a unit imports neither the
    schedule nor any operation (it reports, and acts on its own groups)."""
    edges = import_graph.graph(pkg)
    names = _imported_names(pkg)
    bad = []
    for mod in sorted(edges):
        runtime = {m for m, k in edges[mod].items() if k != "type"}
        if GROUP_OPS in runtime and mod not in SCHEDULE:
            bad.append(f"{mod} imports {GROUP_OPS}")
        for src, name in sorted(names.get(mod, ())):
            if BUCKET_OPS.get(name) == src and mod != GROUP_OPS:
                bad.append(f"{mod} imports {name}")
        if mod == UNIT:
            for m in sorted(runtime & UNIT_NEVER_IMPORTS):
                bad.append(f"{mod} imports {m}")
    return bad


def test_units_report_the_schedule_decides():
    assert control_violations(ROOT / "fsdp_compose") == []


def test_control_check_can_fail(tmp_path):
    pkg = _package(tmp_path, {
        "_group/_flat_group": "def gather_bucket(groups, streams):\n    pass\n",
        "_group/_grad_path": "def launch_bucket(paths, streams):\n    pass\n",
        "_group/_extension": "def gather_together(groups, streams):\n    pass\n",
        "_group/_group_ops": "from ._flat_group import gather_bucket\n",
        "_runtime/_state": "from .._group import _group_ops\n",
        "_runtime/_backward_schedule": "from .._group._grad_path import launch_bucket\n",
        "_runtime/_unit": "def pre_forward(self):\n    from ._state import RootContext\n",
        "_runtime/_forward_walk": "from .._group._group_ops import gather_bucket\n",
    })
    assert control_violations(pkg) == [
        "fsdp_compose._runtime._backward_schedule imports launch_bucket",
        "fsdp_compose._runtime._forward_walk imports fsdp_compose._group._group_ops",
        "fsdp_compose._runtime._unit imports fsdp_compose._runtime._state",
    ]


# ------------------------------------------------------- private torch names
PRIVATE_TORCH = re.compile(r"\btorch(?:\.[A-Za-z]\w*)*\._[A-Za-z]\w*")
COMPAT = "_base/_compat.py"


def private_torch_uses(pkg: Path) -> list[str]:
    """Code (not comments or strings) naming a private torch module or
    attribute (``torch._C...``, ``torch.x._y``) outside ``_base/_compat.py``,
    where every private call lives with its reason (docs/design.md)."""
    found = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg).as_posix()
        if rel == COMPAT:
            continue
        lines: dict[int, list[str]] = {}
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type not in (tokenize.COMMENT, tokenize.STRING):
                lines.setdefault(tok.start[0], []).append(tok.string)
        for n, parts in sorted(lines.items()):
            code = re.sub(r"\s*\.\s*", ".", " ".join(parts))
            found += [f"{rel}:{n}: {m}" for m in PRIVATE_TORCH.findall(code)]
    return found


def test_private_torch_names_only_in_compat():
    assert private_torch_uses(ROOT / "fsdp_compose") == []


def test_private_torch_check_can_fail(tmp_path):
    pkg = _package(tmp_path, {
        "_base/_compat": "import torch\nX = torch._C._current_graph_task_id\n",
        "_group/_a": "import torch.distributed._functional_collectives as f\n"
                     "# torch._C in a comment\nY = 'torch._C'\n"
                     "with torch._C.DisableTorchFunctionSubclass():\n    pass\n",
    })
    assert private_torch_uses(pkg) == [
        "_group/_a.py:1: torch.distributed._functional_collectives",
        "_group/_a.py:4: torch._C",
    ]
