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


def test_job_is_a_leaf():
    """Per-job state (_job.py) is readable from anywhere."""
    edges = import_graph.graph()
    assert edges["fsdp_compose._job"] == {}, edges["fsdp_compose._job"]


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


# ------------------------------------------------------- direction of control
# [Note: who decides] in fsdp_compose/_unit.py: units report, the root decides,
# flat groups act. Checked on the source, by the names the package gives
# units (``unit``, ``u``, ``v``, ``root``) and root contexts (``ctx``).
UNIT_NAMES = {"unit", "u", "v", "root", "self._unit()"}
CTX_NAMES = {"ctx", "self.ctx", "unit.ctx", "u.ctx"}
ROOT_FILES = {"_state.py", "_forward_walk.py", "_backward_schedule.py", "_step_checks.py"}
# the user's per-unit settings, written by FSDPModule's setters
USER_SETTINGS = {("_fsdp_module.py", a) for a in (
    "unshard_in_backward", "forward_prefetch", "backward_prefetch", "requires_gradient_sync",
    "reshard_after_backward", "hook_handles")}


def _functions(tree):
    """(enclosing function name, node) for every node."""
    import ast
    out = []

    def walk(node, fn):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            out.append((name, child))
            walk(child, name)
    walk(tree, None)
    return out


def control_violations(pkg: Path) -> list[str]:
    """Writes of a unit's fields outside _unit.py (but the user settings), of
    a root context's outside the root's files; a unit all-gathered other than
    by ``RootContext.gather``; a unit's free decided outside
    ``RootContext.reshard`` (the user's own reshard/cast aside)."""
    import ast
    bad = []
    for f in sorted(pkg.glob("*.py")):
        for fn, node in _functions(ast.parse(f.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                for e in ast.walk(t):
                    if not (isinstance(e, ast.Attribute) and isinstance(e.ctx, ast.Store)):
                        continue
                    base = ast.unparse(e.value)
                    if base in UNIT_NAMES and f.name != "_unit.py" \
                            and (f.name, e.attr) not in USER_SETTINGS:
                        bad.append(f"{f.name}:{node.lineno} {fn}: writes {base}.{e.attr}")
                    if base in CTX_NAMES and f.name not in ROOT_FILES:
                        bad.append(f"{f.name}:{node.lineno} {fn}: writes {base}.{e.attr}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and (ast.unparse(node.func.value) in UNIT_NAMES
                         or (f.name == "_unit.py" and ast.unparse(node.func.value) == "self")):
                where = f"{f.name}:{node.lineno} {fn}"
                if node.func.attr == "unshard" and (f.name, fn) != ("_state.py", "gather"):
                    bad.append(f"{where}: calls {ast.unparse(node.func)}")
                if node.func.attr == "reshard" and f.name in ROOT_FILES | {"_unit.py"} \
                        and (f.name, fn) != ("_state.py", "reshard"):
                    bad.append(f"{where}: calls {ast.unparse(node.func)}")
    return bad


def test_units_report_the_root_decides():
    assert control_violations(ROOT / "fsdp_compose") == []


def test_unit_acts_do_not_call_the_root():
    """A unit's acts pass the root's decision to its groups: no call back."""
    import ast
    tree = ast.parse((ROOT / "fsdp_compose" / "_unit.py").read_text())
    unit = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Unit")
    acts = {"unshard", "wait_for_unshard", "reshard", "launch_reduce_scatters"}
    for fn in unit.body:
        if isinstance(fn, ast.FunctionDef) and fn.name in acts:
            names = {ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.Attribute)}
            assert not any("ctx" in n for n in names), (fn.name, sorted(names))


def test_control_check_can_fail(tmp_path):
    pkg = _package(tmp_path, {
        "_state": "def root_pre_forward(self):\n    for u in self.units:\n        u.uses = 0\n",
        "_unit": "class Unit:\n    def post_forward(self):\n        self.ctx.in_training_forward = 0\n"
                 "    def pre_forward(self):\n        self.unshard()\n"
                 "    def unshard(self):\n        pass\n",
        "_forward_walk": "def prefetch(self, v):\n    v.unshard()\n",
        "_backward_schedule": "def finish(self, unit):\n    unit.reshard()\n",
        "_fsdp_module": "def unshard(self):\n    unit.pinned = True\n"
                        "def set_x(self):\n    u.requires_gradient_sync = False\n",
    })
    assert control_violations(pkg) == [
        "_backward_schedule.py:2 finish: calls unit.reshard",
        "_forward_walk.py:2 prefetch: calls v.unshard",
        "_fsdp_module.py:2 unshard: writes unit.pinned",
        "_state.py:3 root_pre_forward: writes u.uses",
        "_unit.py:3 post_forward: writes self.ctx.in_training_forward",
        "_unit.py:5 pre_forward: calls self.unshard",
    ]
