"""How control flows through a sharding library's own files in one training step.

    python -m tools.step_trace                  # ours and FSDP2, side by side
    python -m tools.step_trace --impl ours --json

The step: a model of 4 blocks (``x + fc2(relu(fc1(x)))``, width 8) and a
Linear head, each block then the root sharded by ``fully_shard`` (ours:
``fsdp_compose.fully_shard``; FSDP2: ``torch.distributed.fsdp.fully_shard``)
over torch's fake process group as rank 0 of 2, in this process, on CPU;
AdamW. Three steps run untraced (lazy init, the first step's learning), then
the fourth (forward, backward, ``optimizer.step()``, ``zero_grad()``) runs
under ``sys.setprofile``. Each implementation runs in a child process of its
own (one process group per process).

Only frames whose code file lies in the implementation's package directory
count (ours: ``fsdp_compose/``; FSDP2: ``torch/distributed/fsdp/_fully_shard/``):
the *package frames*. Each call of a package frame is an event
``(file, function, outside)`` (a generator's resumption is a call, its
``yield`` a return), ``outside`` when the frame's immediate Python caller is
not a package frame (torch's ``Module.__call__``, the autograd engine,
``autograd.Function.apply``, ``contextlib``, a ``torch._dynamo`` wrapper,
the optimizer, this tool); each return pops it. ``count`` replays the events
on a stack of package frames:

- functions: distinct ``(file, qualname, first line)`` called (code objects:
  a comprehension, which Python 3.11 runs in a frame of its own, is one);
- files: distinct files of those functions;
- cross-file calls: calls whose caller is in another file; the caller is the
  nearest package frame below the callee (frames outside the package are
  skipped); a call with no package frame below has no caller;
- back-calls: cross-file calls into a file already on the stack below the
  caller;
- both-ways pairs: unordered file pairs ``{A, B}`` with cross-file calls
  A -> B and B -> A.

Each figure but the first two is counted under three rules:

- ``all``: as above;
- ``hooks_aside`` (autograd hooks aside): a package frame entered from
  outside the package (an autograd or module hook, a queued callback, an
  optimizer hook, a function that torch code calls back) is an entry, not a
  call: it starts a new segment of the stack, no call into it is counted,
  and the back-calls made above it look only at the frames of its segment;
- ``wrappers_aside``: hooks aside, and closures (functions defined inside a
  function, comprehensions excepted: the hooks' wrappers such as
  ``weak_hook``'s, ``outside_functorch``'s, FSDP2's ``_dynamo_disable`` and
  ``_disable_functorch_if_active`` wrappers) are transparent: a call into
  one is not counted, a call out of one is made by the nearest package frame
  below it that is not a closure (within the segment; none: an entry), and
  back-calls do not look at them.

The autograd engine runs a CPU backward on the calling thread (the tool
checks: a hook on the loss records its thread, and the run fails if it is not
the calling one, since ``sys.setprofile`` sees one thread only).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import asdict, dataclass, field

IMPLS = ("ours", "fsdp2")
WIDTH = 8
BLOCKS = 4
UNTRACED_STEPS = 3


@dataclass(frozen=True)
class Event:
    """One call or return of a package frame (file relative to the package)."""

    kind: str                  # "call" | "return"
    file: str
    function: str = ""         # qualname:first line
    outside: bool = False      # call only: the immediate caller is not a package frame


@dataclass
class Counts:
    functions: int = 0
    files: int = 0
    cross_file_calls: int = 0
    back_calls: int = 0
    both_ways: list[tuple[str, str]] = field(default_factory=list)
    back_edges: list[tuple[str, str, int]] = field(default_factory=list)  # caller, callee, n


RULES = ("all", "hooks_aside", "wrappers_aside")
RULE_NAMES = {"all": "all", "hooks_aside": "hooks aside",
              "wrappers_aside": "hooks and wrappers aside"}
COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


def is_wrapper(function: str) -> bool:
    """A function defined inside a function (a closure: a hook or a
    decorator's wrapper), not a comprehension."""
    qualname = function.rsplit(":", 1)[0]
    return "<locals>" in qualname and qualname.rsplit(".", 1)[-1] not in COMPREHENSIONS


@dataclass(frozen=True)
class _Frame:
    file: str
    entry: bool     # entered from outside the package: starts a segment
    wrapper: bool


def _caller(stack: list[_Frame], ev: Event, rule: str) -> tuple[str | None, set[str]]:
    """The file of ``ev``'s caller under ``rule`` (None: not a call from the
    package) and the files a back-call looks for."""
    if rule == "all":
        return (stack[-1].file if stack else None), {f.file for f in stack}
    if ev.outside:
        return None, set()
    start = max((i for i, f in enumerate(stack) if f.entry), default=0)
    seg = stack[start:]
    if rule == "wrappers_aside":
        if is_wrapper(ev.function):
            return None, set()
        seg = [f for f in seg if not f.wrapper]
    return (seg[-1].file if seg else None), {f.file for f in seg}


def count(events) -> tuple[dict[str, Counts], int, int]:
    """Replay ``events`` (see the module docstring) and count them under each
    of ``RULES``. Returns ``({rule: Counts}, entries, calls)``: entries are
    the calls from outside the package, calls all package frame calls."""
    functions: set[tuple[str, str]] = set()
    stack: list[_Frame] = []
    edges = {r: Counter() for r in RULES}
    backs = {r: Counter() for r in RULES}
    entries = calls = 0
    for ev in events:
        if ev.kind == "return":
            if stack:
                if stack.pop().file != ev.file:
                    raise ValueError(f"a return from {ev.file} that is not the top frame's")
            continue
        if ev.kind != "call":
            raise ValueError(f"unknown event kind {ev.kind!r}")
        calls += 1
        functions.add((ev.file, ev.function))
        for rule in RULES:
            caller, below = _caller(stack, ev, rule)
            if caller is not None and caller != ev.file:
                edges[rule][caller, ev.file] += 1
                if ev.file in below:
                    backs[rule][caller, ev.file] += 1
        entry = ev.outside or not stack
        entries += entry
        stack.append(_Frame(ev.file, entry, is_wrapper(ev.function)))
    n_files = len({f for f, _ in functions})
    return {r: Counts(functions=len(functions), files=n_files,
                      cross_file_calls=sum(edges[r].values()),
                      back_calls=sum(backs[r].values()),
                      both_ways=sorted({tuple(sorted(k)) for k in edges[r]
                                        if k[::-1] in edges[r]}),
                      back_edges=[(a, b, n) for (a, b), n in backs[r].most_common()])
            for r in RULES}, entries, calls


# ---------------------------------------------------------------- the run

def package_dir(impl: str) -> str:
    if impl == "ours":
        import fsdp_compose
        return os.path.dirname(os.path.abspath(fsdp_compose.__file__))
    import torch.distributed.fsdp._fully_shard as fs
    return os.path.dirname(os.path.abspath(fs.__file__))


class Tracer:
    """A ``sys.setprofile`` function that keeps the package frames' events."""

    def __init__(self, root: str):
        self.root = root + os.sep
        self.events: list[Event] = []
        self._inside: dict[str, str | None] = {}  # code file -> file in package, or None

    def _rel(self, filename: str) -> str | None:
        rel = self._inside.get(filename, "")
        if rel == "":
            path = os.path.abspath(filename)
            rel = os.path.relpath(path, self.root) if path.startswith(self.root) else None
            self._inside[filename] = rel
        return rel

    def __call__(self, frame, event, arg):
        if event not in ("call", "return"):
            return
        rel = self._rel(frame.f_code.co_filename)
        if rel is None:
            return
        if event == "return":
            self.events.append(Event("return", rel))
            return
        code = frame.f_code
        back = frame.f_back
        outside = back is None or self._rel(back.f_code.co_filename) is None
        self.events.append(Event("call", rel, f"{code.co_qualname}:{code.co_firstlineno}",
                                 outside))


def build_model():
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.fc1 = nn.Linear(d, 2 * d)
            self.fc2 = nn.Linear(2 * d, d)

        def forward(self, x):
            return x + self.fc2(self.fc1(x).relu())

    return nn.Sequential(*[Block(WIDTH) for _ in range(BLOCKS)], nn.Linear(WIDTH, 4))


def trace_step(impl: str) -> list[Event]:
    """Run the step of the module docstring in this process (which must have
    no process group) and return the fourth step's events."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if impl == "ours":
        from fsdp_compose import fully_shard
    elif impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        raise ValueError(impl)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        model = build_model()
        for block in list(model)[:BLOCKS]:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(4, WIDTH)
        threads: set[int] = set()

        def step():
            loss = model(x).square().mean()
            loss.register_hook(lambda g: threads.add(threading.get_ident()))
            loss.backward()
            opt.step()
            opt.zero_grad()

        for _ in range(UNTRACED_STEPS):
            step()
        tracer = Tracer(package_dir(impl))
        threads.clear()
        sys.setprofile(tracer)
        try:
            step()
        finally:
            sys.setprofile(None)
        if threads != {threading.get_ident()}:
            raise SystemExit("step_trace: the backward ran on another thread; "
                             "sys.setprofile did not see it")
        return tracer.events
    finally:
        dist.destroy_process_group()


def run(impl: str) -> dict:
    """The counts of ``impl``'s traced step, as a JSON-ready dict."""
    import torch
    counts, entries, calls = count(trace_step(impl))
    return {"impl": impl, "torch": torch.__version__,
            "python": ".".join(map(str, sys.version_info[:3])),
            "entries": entries, "calls": calls,
            "rules": {r: asdict(c) for r, c in counts.items()}}


def run_child(impl: str) -> dict:
    """``run(impl)`` in a process of its own."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-m", "tools.step_trace", "--impl", impl, "--json",
                          "--here"], capture_output=True, text=True, timeout=300, cwd=root)
    if res.returncode != 0:
        raise SystemExit(f"step_trace --impl {impl} failed:\n{res.stdout}{res.stderr}")
    return json.loads(res.stdout)[0]


# ---------------------------------------------------------------- output

COLUMNS = (("functions", "functions"), ("files", "files"),
           ("cross-file calls", "cross_file_calls"), ("back-calls", "back_calls"),
           ("both-ways pairs", "both_ways"))


def _stem(path: str) -> str:
    return path.removesuffix(".py").replace(os.sep, ".")


def table(traces: list[dict], top: int = 5) -> str:
    """The counts (one row per implementation and rule), then per
    implementation the both-ways pairs under each rule and the top back-call
    edges under the first."""
    head = ["impl", "rule", *[name for name, _ in COLUMNS]]
    rows = []
    for t in traces:
        for rule, c in t["rules"].items():
            rows.append([t["impl"], RULE_NAMES[rule],
                         *[str(len(c[k]) if isinstance(c[k], list) else c[k])
                           for _, k in COLUMNS]])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    out = ["  ".join(v.ljust(w) if i < 2 else v.rjust(w)
                     for i, (v, w) in enumerate(zip(r, widths))).rstrip()
           for r in [head, *rows]]
    for t in traces:
        out.append("")
        for rule, c in t["rules"].items():
            pairs = ", ".join(f"{_stem(a)} <-> {_stem(b)}" for a, b in c["both_ways"])
            out.append(f"{t['impl']}, {RULE_NAMES[rule]}: both-ways pairs: {pairs or 'none'}")
        for rule in (RULES[0], RULES[-1]):
            edges = t["rules"][rule]["back_edges"][:top]
            out.append(f"{t['impl']}, {RULE_NAMES[rule]}: top back-call edges: " + (", ".join(
                f"{_stem(a)} -> {_stem(b)} {n}" for a, b, n in edges) or "none"))
        out.append(f"{t['impl']}: {t['calls']} package frame calls, {t['entries']} of them "
                   "from outside the package")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", choices=(*IMPLS, "both"), default="both")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--here", action="store_true",
                    help="run in this process (one implementation only)")
    args = ap.parse_args(argv)
    impls = IMPLS if args.impl == "both" else (args.impl,)
    if args.here:
        if len(impls) != 1:
            ap.error("--here traces one implementation")
        traces = [run(impls[0])]
    else:
        traces = [run_child(i) for i in impls]
    if args.json:
        print(json.dumps(traces, indent=1))
    else:
        t = traces[0]
        print(f"one training step, the {UNTRACED_STEPS + 1}th (torch {t['torch']}, "
              f"Python {t['python']}; {BLOCKS} blocks + a head, fake process group, "
              "world size 2)")
        print(table(traces))
    return 0


if __name__ == "__main__":
    sys.exit(main())
