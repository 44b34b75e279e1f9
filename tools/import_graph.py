"""The import graph inside ``fsdp_compose``, and the sizes of its largest pieces.

    python -m tools.import_graph            # the graph; exits 1 on a cycle
    python -m tools.import_graph --sizes    # the largest file, class and function

Read with ``ast`` (nothing is imported). An edge ``a -> b`` is an import of
``b`` anywhere in ``a``:

- ``module``: at module level (runs when ``a`` is imported);
- ``function``: inside a function or method (runs when it is called: still
  a dependency, and still a cycle if ``b`` reaches ``a``);
- ``type``: under ``if TYPE_CHECKING:`` (never runs). Printed, but not
  counted for cycles: it names a type for the reader and a type checker.

The implicit import of a parent package (importing ``fsdp_compose._runtime._unit``
runs ``fsdp_compose/__init__.py`` first) is not an edge; an explicit
``import fsdp_compose`` or ``from fsdp_compose import x`` inside the
package is one, to ``fsdp_compose``.

The graph is printed in layers: layer 0 imports nothing of the package,
layer k only modules of lower layers. Cycles, if any, are printed instead
(each as a path that comes back to its start) and the exit status is 1;
tests/test_architecture.py keeps it at 0.

``--sizes``: lines of the largest file, the largest class and the largest
function or method (``def`` line to last line, docstring and comments
included; a nested function counts within its parent).
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGE = "fsdp_compose"
KINDS = ("module", "function", "type")


def package_root() -> Path:
    return Path(__file__).resolve().parent.parent / PACKAGE


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every ``.py`` file of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module):
    """(node, kind) for every import statement in ``tree``."""
    def walk(node, kind):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, kind
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, "type" if kind == "type" else "function")
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), "type")
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), kind)
            else:
                yield from walk(child, kind)
    yield from walk(tree, "module")


def _targets(name: str, is_pkg: bool, node, known: set[str]) -> list[str]:
    """The package modules one import statement in module ``name`` reaches."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == PACKAGE and a.name in known]
    if node.level:
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    if mod.split(".")[0] != PACKAGE:
        return []
    out = []
    for a in node.names:  # ``from pkg import submodule`` reaches the submodule
        sub = f"{mod}.{a.name}"
        out.append(sub if sub in known else mod)
    return [m for m in dict.fromkeys(out) if m in known]


def graph(root: Path | None = None) -> dict[str, dict[str, str]]:
    """module -> {imported module: kind}; of several imports of one module,
    the strongest kind (module, then function, then type) is kept."""
    mods = modules(root or package_root())
    known = set(mods)
    edges: dict[str, dict[str, str]] = {m: {} for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        for node, kind in _imports(tree):
            for target in _targets(name, is_pkg, node, known):
                if target == name:
                    continue
                old = edges[name].get(target)
                if old is None or KINDS.index(kind) < KINDS.index(old):
                    edges[name][target] = kind
    return edges


def cycles(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """One cycle through each strongly connected component that has one
    (module and function edges only), as a path from its first module
    (by name) back to it; the whole component is what ``print_graph`` shows."""
    runtime = {a: sorted(b for b, k in bs.items() if k != "type") for a, bs in edges.items()}
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def connect(v):  # Tarjan, iterative
        work = [(v, iter(runtime[v]))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(runtime[w])))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    comps.append(comp)

    for v in sorted(runtime):
        if v not in index:
            connect(v)
    found = []
    for comp in sorted(comps, key=min):
        members = set(comp)
        if len(comp) == 1 and comp[0] not in runtime[comp[0]]:
            continue
        start = min(comp)
        # shortest path back to start inside the component (BFS)
        prev, frontier = {start: None}, [start]
        path = None
        while frontier and path is None:
            nxt = []
            for a in frontier:
                for b in runtime[a]:
                    if b == start:
                        path = [a]
                        break
                    if b in members and b not in prev:
                        prev[b] = a
                        nxt.append(b)
                if path is not None:
                    break
            frontier = nxt
        while prev[path[-1]] is not None:
            path.append(prev[path[-1]])
        found.append(list(reversed(path)) + [start])
    return found


def _component(edges: dict[str, dict[str, str]], start: str) -> list[str]:
    """The modules on some cycle through ``start`` (module and function edges)."""
    def reach(frm, forward):
        seen, todo = {frm}, [frm]
        while todo:
            a = todo.pop()
            nbrs = ([b for b, k in edges[a].items() if k != "type"] if forward else
                    [m for m, bs in edges.items() if bs.get(a, "type") != "type"])
            for b in nbrs:
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen
    return sorted(reach(start, True) & reach(start, False))


def layers(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """Modules by layer (longest path to a module that imports nothing);
    only for an acyclic graph."""
    depth: dict[str, int] = {}

    def d(m):
        if m not in depth:
            deps = [b for b, k in edges[m].items() if k != "type"]
            depth[m] = 1 + max((d(b) for b in deps), default=-1)
        return depth[m]

    for m in edges:
        d(m)
    out: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for m in sorted(edges):
        out[depth[m]].append(m)
    return out


def _short(m: str) -> str:
    return m[len(PACKAGE) + 1:] if m.startswith(PACKAGE + ".") else m


def print_graph(edges: dict[str, dict[str, str]], out=sys.stdout) -> int:
    found = cycles(edges)
    if found:
        print(f"{len(found)} import cycle(s) in {PACKAGE} (module and function-level imports):",
              file=out)
        for c in found:
            kinds = [edges[a][b] for a, b in zip(c, c[1:])]
            print("  " + _short(c[0]) + "".join(
                f" {'-fn->' if k == 'function' else '->'} {_short(b)}"
                for k, b in zip(kinds, c[1:])), file=out)
            comp = _component(edges, c[0])
            if len(comp) > len(c) - 1:
                print(f"    (one of the cycles among: {', '.join(_short(m) for m in comp)})",
                      file=out)
    if not found:
        for i, layer in enumerate(layers(edges)):
            print(f"layer {i}:", file=out)
            for m in layer:
                deps = sorted(edges[m].items())
                shown = ", ".join(_short(b) + {"module": "", "function": " (fn)",
                                               "type": " (type)"}[k] for b, k in deps)
                print(f"  {_short(m):<16} <- {shown}" if deps else f"  {_short(m)}", file=out)
    else:
        print("edges (fn: function-level import, type: TYPE_CHECKING only):", file=out)
        for m in sorted(edges):
            deps = sorted(edges[m].items())
            if deps:
                shown = ", ".join(_short(b) + {"module": "", "function": " (fn)",
                                               "type": " (type)"}[k] for b, k in deps)
                print(f"  {_short(m):<16} <- {shown}", file=out)
    return 1 if found else 0


def sizes(root: Path | None = None) -> dict[str, tuple[int, str]]:
    """{"file" | "class" | "function": (lines, where)} of the largest of each."""
    best = {"file": (0, ""), "class": (0, ""), "function": (0, "")}
    root = root or package_root()
    for path in modules(root).values():
        text = path.read_text()
        rel = str(path.relative_to(root.parent))
        n = len(text.splitlines())
        if n > best["file"][0]:
            best["file"] = (n, rel)
        tree = ast.parse(text, str(path))

        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    lines = child.end_lineno - child.lineno + 1
                    if lines > best["class"][0]:
                        best["class"] = (lines, f"{rel}:{child.name}")
                    visit(child, f"{prefix}{child.name}.")
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = child.end_lineno - child.lineno + 1
                    if lines > best["function"][0]:
                        best["function"] = (lines, f"{rel}:{prefix}{child.name}")
                else:
                    visit(child, prefix)

        visit(tree, "")
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", action="store_true",
                    help="print the lines of the largest file, class and function instead")
    args = ap.parse_args(argv)
    if args.sizes:
        for what, (n, where) in sizes().items():
            print(f"largest {what:<8} {n:>4} lines  {where}")
        return 0
    return print_graph(graph())


if __name__ == "__main__":
    sys.exit(main())
