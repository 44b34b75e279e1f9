"""tools/step_trace.py: the counting rules on hand-made events, the tracer on a
package written here, and one traced step of ours in this process (no worker
process: the one-minute tier, where a call back up the layers shows first)."""
from __future__ import annotations

import importlib
import sys

import pytest
import torch.distributed as dist

from tools.step_trace import RULES, Event, Tracer, count, is_wrapper, table, trace_step

pytestmark = pytest.mark.fast


def call(file, function, outside=False):
    return Event("call", file, function, outside)


def ret(file):
    return Event("return", file)


# a.f -> b.g -> a.h (a back-call) -> c.k; b.g -> c.k. Under a.f -> b.g, a
# hook in c entered from outside -> a.h (a back-call unless hooks aside) ->
# b.g (likewise). A closure c.w entered from outside -> a.h (w's own call,
# not counted with wrappers aside). A decorated a.f -> c.w (a closure) -> b.g
# (a.f -> b.g with wrappers aside).
EVENTS = [
    call("a.py", "f:1", outside=True),
    call("b.py", "g:1"),
    call("a.py", "h:5"), call("c.py", "k:1"), ret("c.py"), ret("a.py"),
    call("c.py", "k:1"), ret("c.py"),
    call("c.py", "hook:9", outside=True),
    call("a.py", "h:5"), call("b.py", "g:1"), ret("b.py"), ret("a.py"),
    ret("c.py"),
    ret("b.py"), ret("a.py"),
    call("c.py", "wrap.<locals>.w:3", outside=True), call("a.py", "h:5"), ret("a.py"),
    ret("c.py"),
    call("a.py", "f:1", outside=True),
    call("c.py", "wrap.<locals>.w:3"), call("b.py", "g:1"), ret("b.py"), ret("c.py"),
    ret("a.py"),
]


def test_count_on_hand_made_events():
    counts, entries, calls = count(EVENTS)
    assert (calls, entries) == (13, 4)
    for c in counts.values():
        assert (c.functions, c.files) == (6, 3)
    al, hooks, wraps = (counts[r] for r in RULES)
    # all: the hook's caller is b.g (through torch); below it a and b are on
    # the stack, so hook -> a.h and a.h -> b.g are back-calls
    assert (al.cross_file_calls, al.back_calls) == (10, 3)
    assert sorted(al.back_edges) == [("a.py", "b.py", 1), ("b.py", "a.py", 1),
                                     ("c.py", "a.py", 1)]
    assert al.both_ways == [("a.py", "b.py"), ("a.py", "c.py"), ("b.py", "c.py")]
    # hooks aside: the hook is an entry (no b -> c call), its segment holds c only
    assert (hooks.cross_file_calls, hooks.back_calls) == (9, 1)
    assert hooks.back_edges == [("b.py", "a.py", 1)]
    assert hooks.both_ways == [("a.py", "b.py"), ("a.py", "c.py"), ("b.py", "c.py")]
    # wrappers aside: no call into c.w, none out of the one entered from
    # outside, and a.f -> b.g for the decorated one
    assert (wraps.cross_file_calls, wraps.back_calls) == (7, 1)
    assert wraps.both_ways == [("a.py", "b.py"), ("a.py", "c.py")]


def test_count_rejects_an_unbalanced_return():
    try:
        count([call("a.py", "f:1", True), ret("b.py")])
    except ValueError:
        return
    raise AssertionError("a return from another file than the top frame's was accepted")


def test_is_wrapper():
    assert is_wrapper("weak_hook.<locals>.hook:125")
    assert is_wrapper("_hook.<locals>.hook:96")
    assert not is_wrapper("Unit.gather_bytes.<locals>.<genexpr>:229")
    assert not is_wrapper("Unit.reshard:235")


def test_tracer_on_a_package(tmp_path, monkeypatch):
    pkg = tmp_path / "stp_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from stp_pkg import b\n"
        "def f():\n    return b.g(h)\n"
        "def h():\n    return sorted([2, 1], key=k)\n"
        "def k(x):\n    return x\n")
    (pkg / "b.py").write_text("def g(fn):\n    return fn()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    a = importlib.import_module("stp_pkg.a")
    tracer = Tracer(str(pkg))
    sys.setprofile(tracer)
    try:
        a.f()
    finally:
        sys.setprofile(None)
    calls = [(e.file, e.function.split(":")[0], e.outside) for e in tracer.events
             if e.kind == "call"]
    # k is called by sorted (C code): its caller frame is a.h, a package frame
    assert calls == [("a.py", "f", True), ("b.py", "g", False), ("a.py", "h", False),
                     ("a.py", "k", False), ("a.py", "k", False)]
    counts, entries, _ = count(tracer.events)
    assert entries == 1
    assert counts["all"].cross_file_calls == 2 and counts["all"].back_calls == 1
    assert counts["all"].both_ways == [("a.py", "b.py")]


def test_a_step_of_ours():
    """One traced step of ours, in this process: the events balance, each
    rule counts no more than the one before it, and control goes one way
    ([Note: one-way control] in fsdp_compose/_runtime/_state.py): no file calls back
    into a file already on the stack, and no two files call each other, under
    every rule."""
    assert not dist.is_initialized()
    counts, entries, calls = count(trace_step("ours"))
    assert counts["all"].files >= 10 and 0 < entries < calls
    prev = None
    for rule in RULES:
        c = counts[rule]
        assert c.back_calls <= c.cross_file_calls
        assert c.back_calls == 0 and c.both_ways == [], (rule, c.back_calls, c.both_ways)
        if prev is not None:
            assert c.cross_file_calls <= prev.cross_file_calls
            assert set(c.both_ways) <= set(prev.both_ways)
        prev = c
    text = table([{"impl": "ours", "entries": entries, "calls": calls,
                   "rules": {r: vars(c) for r, c in counts.items()}}])
    assert "hooks and wrappers aside" in text
