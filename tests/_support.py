"""What the test files share: the small models, the comparison of sharded
parameters with an unsharded reference, and the launcher that runs many
scenarios of one world size in one multi-process launch.

* :class:`Block` / :class:`Net`: a residual MLP block and a stack of them
  between an input and an output layer; a file that needs other widths passes
  them (or subclasses ``Net`` with its own defaults). :class:`Chain` (with
  the rank-divergent scenarios :data:`SKIPS` / :data:`REGIONS`): blocks whose
  output some ranks do not use; :class:`Boom`: a backward that raises.
* :func:`compare_with_reference`: every sharded parameter (and gradient) of
  this rank against the same piece of an unsharded reference, by the
  documented layout rule (``_pieces``).
* :func:`schedule_text`: a recorded schedule (``record_schedule``) as text.
* :class:`StreamDouble` (from ``benchmarks._fake_cuda``) / :func:`recording`:
  a stream runtime for the stream manager that records instead of ordering
  (CUDA's side streams checked on CPU), and the record of every collective
  issued; :func:`check_stream_protocol`: what is wrong in such a record.
* :class:`Scenarios`: named scenarios, one launch per world size (cached). A
  scenario that raises on a rank stops that rank's launch at once (no
  barrier, no later collective: a peer waiting in a collective fails as soon
  as the failed rank's process exits), its result is that rank's traceback,
  and the scenarios after it run again in a new launch, so every test reports
  its own result. A launch runs the scenarios that this session's selected
  tests ask for (``wants``): ``-k`` one scenario, one scenario launched.
* :class:`OnFirstUse`: a module fixture's launches, one per key (a world
  size), each made when a test first looks it up.

A model that a few files share with its own constants, batches and sharding
is a module of its own: ``_checkpoint_net`` (test_checkpoint,
test_checkpoint_safe_load, test_drop_in), ``_tp_net`` (test_tp,
test_tp_checkpoint), ``_grad_nets`` (test_grad_semantics, test_user_api).
A test file imports from these and from here, never from another test file.

fsdp_compose is imported inside the functions that need it, so that a file
testing the harness (test_parity's mock mode) can use this module without it.
"""
from __future__ import annotations

import contextlib
import functools
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Union
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from benchmarks._fake_cuda import StreamDouble

from . import _selection
from ._dist import DistributedError, _read, run_distributed
from ._pieces import local_piece

__all__ = ["Block", "Net", "Chain", "SKIPS", "REGIONS", "Boom", "shard", "per_unit_collectives",
           "compare_with_reference", "compare_step", "raised", "schedule_text", "StreamDouble",
           "IssueRecorder", "recording", "check_stream_protocol", "Scenarios", "asked_by_params",
           "call_by_name", "OnFirstUse"]


# ==========================================================================
# Models
# ==========================================================================


class Block(nn.Module):
    """``x + lin2(relu(lin1(x)))``: ``lin1`` is ``d -> hidden`` (``2 * d + 1`` by
    default: an odd width, so that row pieces rarely split evenly), ``lin2``
    goes back. ``inner`` checkpoints the MLP *inside* the block's forward
    (``"reentrant"`` / ``"nonreentrant"``): activation checkpointing inside a
    unit."""

    def __init__(self, d: int = 6, hidden: int | None = None, inner: str | None = None):
        super().__init__()
        hidden = 2 * d + 1 if hidden is None else hidden
        self.lin1 = nn.Linear(d, hidden)
        self.lin2 = nn.Linear(hidden, d)
        self.inner = inner

    def _mlp(self, x):
        return self.lin2(torch.relu(self.lin1(x)))

    def forward(self, x):
        if self.inner is None:
            return x + self._mlp(x)
        return x + checkpoint(self._mlp, x, use_reentrant=self.inner == "reentrant")


class Net(nn.Module):
    """``inp`` (3 -> d), ``n`` :class:`Block` s in ``layers``, an optional
    ``LayerNorm`` (``norm``), ``out`` (d -> ``out``). Parameters are created in
    that order (what a seed gives does not depend on the options left off)."""

    def __init__(self, n: int = 2, d: int = 6, *, out: int = 1, hidden: int | None = None,
                 norm: bool = False, inner: str | None = None):
        super().__init__()
        self.inp = nn.Linear(3, d)
        self.layers = nn.ModuleList([Block(d, hidden, inner) for _ in range(n)])
        self.norm = nn.LayerNorm(d) if norm else None
        self.out = nn.Linear(d, out)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x if self.norm is None else self.norm(x))


# The schedule of one training step of ``shard(Net(n=2))`` with per-unit
# collectives at 2 ranks on the CPU backend (the gloo backward: a unit
# reshards once its gradients are computed, then the next is prefetched),
# the same in a multi-process gloo launch (tests/test_schedule.py) and in
# process on the fake group (tests/test_fake_group.py). After an intended
# change, print the new one (``schedule_text``) and paste it here.
ONE_STEP_CPU = """\
pre_forward IDLE
all_gather FORWARD
prefetch layers.0 forward
all_gather layers.0 IDLE
pre_forward layers.0 IDLE
prefetch layers.1 forward
all_gather layers.1 IDLE
post_forward layers.0 FORWARD
reshard layers.0 FORWARD
pre_forward layers.1 IDLE
post_forward layers.1 FORWARD
reshard layers.1 FORWARD
post_forward FORWARD
pre_backward IDLE
all_gather layers.1 IDLE
pre_backward layers.1 IDLE
reshard layers.1 grads computed
all_gather layers.0 IDLE
post_backward layers.1 PRE_BACKWARD
reduce_scatter layers.1 ready
pre_backward layers.0 IDLE
reshard layers.0 grads computed
post_backward layers.0 PRE_BACKWARD
reduce_scatter layers.0 ready
reshard grads computed
post_backward PRE_BACKWARD
reduce_scatter ready
final_callback"""


def shard(model: nn.Module, *, root: Optional[dict] = None, **kw) -> nn.Module:
    """``fully_shard`` every block of ``model.layers`` with ``kw``, then the
    root with ``root`` (default: ``kw`` too)."""
    from fsdp_compose import fully_shard

    for layer in model.layers:
        fully_shard(layer, **kw)
    return fully_shard(model, **(kw if root is None else root))


@contextlib.contextmanager
def two_lanes_forced():
    """Row layouts planned inside take two lanes wherever they are better at
    all ([Note: lanes] in fsdp_compose/_plan/_layout.py; at any world size, for
    any gain), as coarse rows do over thousands of ranks."""
    from fsdp_compose._plan import _layout
    saved = _layout.LANES_FROM, _layout.LANES_OVER, _layout.LANES_BETTER
    _layout.LANES_FROM, _layout.LANES_OVER, _layout.LANES_BETTER = 1, 10**9, 10**9
    try:
        yield
    finally:
        _layout.LANES_FROM, _layout.LANES_OVER, _layout.LANES_BETTER = saved


def per_unit_collectives(model):
    """Buckets off: one all-gather / reduce-scatter per unit (tests that assert
    per-unit counts or schedules; buckets are tested on their own)."""
    model.set_all_gather_bucket_bytes(0)
    model.set_reduce_scatter_bucket_bytes(0)
    return model


class Boom(torch.autograd.Function):
    """Identity; its backward raises ``RuntimeError("boom")`` (a backward
    aborted where the model applies it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom")


class Chain(nn.Module):
    """inp, four residual blocks, out. ``skip``: blocks whose output this rank
    does not use (rank-divergent graphs); ``region``: blocks [a, b) run as one
    non-reentrant activation-checkpoint region."""

    def __init__(self, n: int = 4, d: int = 6):
        super().__init__()
        self.inp = nn.Linear(3, d)
        self.layers = nn.ModuleList([Block(d) for _ in range(n)])
        self.out = nn.Linear(d, 1)

    def forward(self, x, skip=(), region=None):
        h = self.inp(x)
        i = 0
        while i < len(self.layers):
            if region is not None and i == region[0]:
                blocks = self.layers[region[0]:region[1]]
                y = checkpoint(lambda t: functools.reduce(lambda a, m: m(a), blocks, t), h,
                               use_reentrant=False)
                i = region[1]
            else:
                y = self.layers[i](h)
                i += 1
            h = h + y.detach() * 0 if (i - 1) in skip else y
        return self.out(h)


# rank-divergent scenarios of Chain: rank -> blocks whose output it does not use,
# and the checkpoint region of those that have one
SKIPS = {
    "unused_middle": {1: {1}, 3: {1}},
    "unused_last": {1: {3}, 2: {1, 3}},
    "region_unused": {1: {2}, 3: {2}},
    "region_all": {},
}
REGIONS = {"region_unused": (1, 3), "region_all": (0, 4)}


# ==========================================================================
# Comparison with an unsharded reference
# ==========================================================================


def sharded_range(p: torch.Tensor) -> tuple:
    """``param_info(p).local_range``: which elements of the flattened full
    parameter this rank's piece holds."""
    from fsdp_compose import param_info

    return tuple(param_info(p).local_range)


def range_or_whole(p: torch.Tensor) -> tuple:
    """As :func:`sharded_range`; the whole tensor for a parameter that
    fully_shard left alone (an ignored parameter)."""
    from fsdp_compose import param_info

    try:
        return tuple(param_info(p).local_range)
    except ValueError:  # "not a parameter sharded by fully_shard"
        return (0, p.numel())


def rows(t):
    """This rank's rows of a sharded parameter, its gradient or its optimizer
    state (a RowParam DTensor: its local tensor); anything else unchanged."""
    from fsdp_compose._group._row_dtensor import local_of

    return local_of(t) if isinstance(t, torch.Tensor) else t


def _value_problem(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float):
    got = rows(got)
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, reference {want.dtype}"
    g, w = got.detach().double(), want.detach().double()
    if torch.allclose(g, w, rtol=rtol, atol=atol):
        return None
    d = (g - w).abs().reshape(-1)
    i = int(d.argmax())
    return (f"max abs diff {d[i].item():.3e} at local index {i} "
            f"(got {g.reshape(-1)[i].item():.8g}, "
            f"expected {w.reshape(-1)[i].item():.8g})")


def compare_with_reference(model: nn.Module, ref: nn.Module, tag: str = "", *,
                           grads: bool = True, params: bool = True, rtol: float = 1e-5,
                           atol: float = 1e-6, shard_world: int = 0,
                           local_range: Callable[[torch.Tensor], tuple] = sharded_range,
                           piece: Optional[Callable] = None) -> List[str]:
    """Each parameter of ``model`` (sharded; this rank's piece) against the same
    piece of the parameter of the same name in ``ref`` (unsharded); the problems
    found, as lines starting with ``tag``. Per parameter:

    * the names, in order, and ``requires_grad`` are the reference's;
    * ``grads``: ``p.grad`` is None exactly where the reference's is, also
      where this rank holds none of the parameter (there it is empty,
      docs/design.md, "Row-granular shards": empty pieces); else it is the
      reference gradient's piece;
    * ``params``: the parameter is the reference parameter's piece;
    * a piece has the reference piece's shape and dtype, and values within
      ``torch.allclose(rtol, atol)`` (computed in float64).

    The piece is ``local_piece(full, local_range(p), shard_world)``, or
    ``piece(full, p)`` when given (e.g. a tensor-parallel shard's rows).
    """
    out: List[str] = []
    ours = list(model.named_parameters())
    theirs = dict(ref.named_parameters())
    if [n for n, _ in ours] != list(theirs):
        return [f"{tag} parameter names differ: {[n for n, _ in ours]} vs {list(theirs)}"]
    for name, p in ours:
        r = theirs[name]
        a, b = local_range(p)

        def want_of(full):
            return piece(full, p) if piece is not None else local_piece(full, (a, b), shard_world)

        if p.requires_grad != r.requires_grad:
            out.append(f"{tag} {name}: requires_grad {p.requires_grad}, reference "
                       f"{r.requires_grad}")
        if grads and not (p.grad is None and r.grad is None):
            if (p.grad is None) != (r.grad is None):
                out.append(f"{tag} grad {name}[{a}:{b}]: {'None' if p.grad is None else 'set'}, "
                           f"reference {'None' if r.grad is None else 'set'}")
            else:
                msg = _value_problem(p.grad, want_of(r.grad), rtol, atol)
                if msg:
                    out.append(f"{tag} grad {name}[{a}:{b}]: {msg}")
        if params:
            msg = _value_problem(p, want_of(r), rtol, atol)
            if msg:
                out.append(f"{tag} param {name}[{a}:{b}]: {msg}")
    return out


def compare_step(model: nn.Module, ref: nn.Module, opt, ref_opt, tag: str = "", *,
                 max_norm: Optional[float] = None, set_to_none: bool = True,
                 **compare_kw) -> List[str]:
    """One optimizer step of both, after both backwards, checked on both sides
    of it: the gradients (:func:`compare_with_reference`); with ``max_norm``,
    fsdp_compose's ``clip_grad_norm_`` against torch's on the reference (the
    returned norms within 1e-5); ``opt.step()`` and ``ref_opt.step()``; the
    parameters; then ``zero_grad(set_to_none)`` on both."""
    problems = compare_with_reference(model, ref, tag, params=False, **compare_kw)
    if max_norm is not None:
        from fsdp_compose import clip_grad_norm_

        norm = clip_grad_norm_(model.parameters(), max_norm)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        if not torch.allclose(norm, ref_norm, rtol=1e-5):
            problems.append(f"{tag} clip norm {norm.item()} vs {ref_norm.item()}")
    opt.step()
    ref_opt.step()
    problems += compare_with_reference(model, ref, tag, grads=False, **compare_kw)
    opt.zero_grad(set_to_none=set_to_none)
    ref_opt.zero_grad(set_to_none=set_to_none)
    return problems


def raised(fn: Callable[[], Any]) -> tuple:
    """``(exception class name, message)`` of what ``fn()`` raises, or
    ``("no error", "")``."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the caller compares the messages
        return type(e).__name__, str(e)
    return "no error", ""


# ==========================================================================
# Schedules
# ==========================================================================


def schedule_text(events) -> str:
    """The events of ``record_schedule``, one line each: the non-empty fields
    joined by spaces (``"all_gather layers.0 IDLE"``)."""
    return "\n".join(" ".join(x for x in e if x) for e in events)


# ==========================================================================
# Recording collectives (the stream runtime double, StreamDouble, is in
# benchmarks/_fake_cuda.py: the GPU check's dry run uses it too)
# ==========================================================================


class IssueRecorder:
    """For :func:`recording` without streams: the collectives of the default
    (gloo) path, on stream ``"cpu"`` in ``issues``."""

    def __init__(self):
        self.issues, self.log = [], []

    def current_stream(self):
        return None


@contextlib.contextmanager
def recording(rt, *, kinds: Sequence[str] = ("all_gather", "reduce_scatter", "all_reduce"),
              logged: Sequence[str] = ("all_gather", "reduce_scatter"), use_double: bool = True):
    """Record every call of the ``fsdp_compose._comm._collectives`` functions named
    in ``kinds`` into ``rt`` (a :class:`StreamDouble` or an
    :class:`IssueRecorder`): ``(kind, stream, async_op, numel)`` in
    ``rt.issues``; for those in ``logged`` issued on a stream, also
    ``("issue", stream, kind)`` in ``rt.log`` and, when a tensor it was given
    is freed, ``("release", i)`` (``i``: the issue's place in the log). With
    ``use_double`` every root's StreamManager runs on ``rt``."""
    from fsdp_compose._comm import _collectives, _streams

    with contextlib.ExitStack() as stack:
        if use_double:
            stack.enter_context(_streams.runtime_factory(lambda device: rt))
        for kind in kinds:
            real = getattr(_collectives, kind)

            def issue(*args, _real=real, _kind=kind, **kw):
                stream = rt.current_stream()
                name = stream.name if stream is not None else "cpu"
                rt.issues.append((_kind, name, kw.get("async_op", True), args[0].numel()))
                if _kind in logged and stream is not None:
                    n = len(rt.log)
                    rt.log.append(("issue", name, _kind))
                    for t in [a for a in args if isinstance(a, torch.Tensor)] + \
                            [v for v in kw.values() if isinstance(v, torch.Tensor)]:
                        weakref.finalize(t, rt.log.append, ("release", n))
                return _real(*args, **kw)

            stack.enter_context(mock.patch.object(_collectives, kind, issue))
        yield rt


def check_stream_protocol(log: list) -> list[str]:
    """What is wrong in a :func:`recording` log of the side-stream protocol
    (tests/test_streams.py states it; [Note: side streams] in
    fsdp_compose/_comm/_streams.py): every all-gather issued on stream ``ag``,
    every reduce-scatter (and its flags' all-reduce) on ``rs``, each after
    waiting an event just recorded on the compute stream, followed by an
    event on its stream that the compute stream waits for before any tensor
    it touches is released. ``[]``: nothing."""
    bad = []
    issues = [i for i, e in enumerate(log) if e[0] == "issue"]
    if not issues:
        return ["no collective was issued"]
    for i in issues:
        _, stream, kind = log[i]
        want = {"all_gather": "ag", "reduce_scatter": "rs", "all_reduce_async": "rs"}[kind]
        if stream != want:
            bad.append(f"{kind} issued on {stream}")
            continue
        # compute: record E1; side: wait E1; issue; side: record E2
        rec1, wait1 = log[i - 2], log[i - 1]
        if not (rec1[:2] == ("record", "compute") and wait1 == ("wait", want, rec1[2])):
            bad.append(f"{kind} at {i}: inputs not handed over: {log[i - 2:i]}")
        rec2 = next((e for e in log[i + 1:] if e[0] == "record"), None)
        if rec2 is None or rec2[1] != want:
            bad.append(f"{kind} at {i}: no completion event on {want}: {rec2}")
            continue
        # the compute stream waits that event, or a later one of the same stream
        # (an aborted step waits the post-reduce that follows the collective)
        later = {e[2] for e in log[i + 1:] if e[:2] == ("record", want)}
        waited = [j for j, e in enumerate(log) if e[:2] == ("wait", "compute") and e[2] in later]
        if not waited:
            bad.append(f"{kind} at {i}: the compute stream never waits for it")
            continue
        released = [j for j, e in enumerate(log) if e == ("release", i)]
        if any(j < waited[0] for j in released):
            bad.append(f"{kind} at {i}: a tensor it touches was released before the compute "
                       "stream waited for it")
    return bad


# ==========================================================================
# Many scenarios per launch
# ==========================================================================

# The last line of an error that only says a peer went away (the root cause is
# on another rank).
_INDUCED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _save(path: str, payload: Any) -> None:
    with open(path, "wb") as f:
        pickle.dump(payload, f)


def _fname(outdir: str, i: int, rank: int) -> str:
    return os.path.join(outdir, f"scenario{i}.rank{rank}")  # i: its place in the launch


def _scenario_worker(rank: int, ws: int, run_one: Callable, names: Sequence[str],
                     outdir: str) -> None:
    """Runs the scenarios in order on this rank; each one's result goes to a
    file. The first that raises stops this rank: no barrier, no later
    collective (they would turn one rank's failure into a timeout)."""
    for i, name in enumerate(names):
        try:
            out = run_one(name, rank, ws)
            # every rank is done with it: no rank starts the next scenario (or
            # takes the store down) while a peer still creates its groups
            dist.barrier()
        except BaseException:
            _save(_fname(outdir, i, rank), ("err", time.time(), traceback.format_exc()))
            raise
        _save(_fname(outdir, i, rank), ("ok", out))


def _failure(name: str, ws: int, got: list, launch_err) -> str:
    errs = [(r, g[1], g[2]) for r, g in enumerate(got) if g is not None and g[0] == "err"]
    if not errs:
        return f"scenario {name!r}, world size {ws}: launch failed:\n{launch_err}"
    errs.sort(key=lambda e: (any(s in e[2] for s in _INDUCED), e[1]))  # root cause first
    r, _, tb = errs[0]
    last = tb.strip().splitlines()[-1]
    msg = f"scenario {name!r}, world size {ws}: rank {r} raised:\n{tb}"
    others = [f"  rank {e[0]}: {e[2].strip().splitlines()[-1]}" for e in errs[1:]
              if e[2].strip().splitlines()[-1] != last]
    return msg + ("other ranks:\n" + "\n".join(others) if others else "")


def run_scenarios(ws: int, names: Sequence[str], run_one: Callable,
                  timeout: Union[float, Callable[[int], float]] = 120.0) -> Dict[str, tuple]:
    """Runs ``run_one(name, rank, ws)`` for every name, in as few launches of
    ``ws`` ranks as failures allow. Returns name -> ``("ok", [per-rank
    result])`` or ``("err", text)``. ``timeout``: seconds per launch, or a
    function of the number of scenarios in it."""
    results: Dict[str, tuple] = {}
    todo = list(names)
    while todo:
        outdir = tempfile.mkdtemp(prefix="fsdp_scenarios_")
        try:
            launch_err = None
            t = timeout(len(todo)) if callable(timeout) else timeout
            try:
                run_distributed(_scenario_worker, ws, run_one, todo, outdir, timeout=t)
            except DistributedError as e:
                launch_err = e
            for i, name in enumerate(todo):
                got = [_read(_fname(outdir, i, r)) for r in range(ws)]
                if all(g is not None and g[0] == "ok" for g in got):
                    results[name] = ("ok", [g[1] for g in got])
                    continue
                results[name] = ("err", _failure(name, ws, got, launch_err))
                todo = todo[i + 1:]
                break
            else:
                if launch_err is not None:
                    results[todo[-1]] = ("err", f"every scenario passed but the launch failed:\n"
                                                f"{launch_err}")
                todo = []
        finally:
            shutil.rmtree(outdir, ignore_errors=True)
    return results


_WS_PARAMS = ("world", "world_size", "ws")
_NAME_PARAMS = ("scenario", "name", "layout")


def asked_by_params(item) -> List[tuple]:
    """``Scenarios``' default ``wants``: a test parametrized by a world size
    (``world``, ``world_size`` or ``ws``) and a scenario (``scenario``,
    ``name`` or ``layout``) asks for that scenario at that world size; any
    other test, for none."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    ws = next((params[k] for k in _WS_PARAMS if k in params), None)
    name = next((params[k] for k in _NAME_PARAMS if k in params), None)
    return [] if ws is None or name is None else [(ws, name)]


def _module_of(item) -> Optional[str]:
    module = getattr(item, "module", None)
    return None if module is None else module.__name__


class Scenarios:
    """Named scenarios run per world size by :func:`run_scenarios`, each world
    size launched once (the first test that asks) and cached.

    The launch of a world size runs the scenarios of ``names`` that this
    session's selected tests of the module that made this object ask for
    (``_selection``; all of them when the whole module runs, as before):
    ``wants(item)`` says which, as ``(world size, name)`` pairs (default
    :func:`asked_by_params`). It must list every scenario the test asks for:
    a test asking for one it does not list fails, so that no full run pays a
    launch of its own for it."""

    def __init__(self, run_one: Callable, timeout: Union[float, Callable[[int], float]] = 120.0,
                 before_launch: Optional[Callable[[], None]] = None,
                 wants: Callable[[Any], Sequence[tuple]] = asked_by_params):
        self.run_one, self.timeout, self.before_launch = run_one, timeout, before_launch
        self.wants = wants
        self.module = sys._getframe(1).f_globals["__name__"]  # the test module that made it
        self._cache: Dict[int, Dict[str, tuple]] = {}

    def _asked(self, ws: int) -> Optional[set]:
        """What the session's selected tests of the module ask for at ``ws``;
        None outside a pytest session."""
        if not _selection.SELECTED:
            return None
        return {n for item in _selection.SELECTED if _module_of(item) == self.module
                for w, n in self.wants(item) if w == ws}

    def _check_declared(self, ws: int, name: str) -> None:
        current = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        item = _selection.BY_NODEID.get(current)
        if item is not None and _module_of(item) == self.module \
                and (ws, name) not in self.wants(item):
            raise AssertionError(
                f"test bug: {current} asks for scenario {name!r} at world size {ws}, which "
                f"its module's Scenarios(wants=...) does not list for it (so a launch of "
                f"the selected tests' scenarios leaves it out)")

    def outcome(self, ws: int, name: str, names: Sequence[str]) -> tuple:
        """``("ok", [per-rank result])`` or ``("err", text)`` of ``name``; the
        first call for ``ws`` runs, in one launch, those of ``names`` that the
        selected tests ask for. A name not among ``names`` runs alone."""
        self._check_declared(ws, name)
        if ws not in self._cache:
            asked = self._asked(ws)
            batch = [n for n in names if asked is None or n in asked]
            self._cache[ws] = self._launch(ws, batch) if batch else {}
        if name not in self._cache[ws]:  # not among the names launched together
            self._cache[ws].update(self._launch(ws, [name]))
        return self._cache[ws][name]

    def _launch(self, ws: int, names: Sequence[str]) -> Dict[str, tuple]:
        if self.before_launch is not None:
            self.before_launch()
        return run_scenarios(ws, names, self.run_one, self.timeout)

    def results(self, ws: int, name: str, names: Sequence[str]) -> list:
        """The per-rank results of ``name``; the test fails with the root-cause
        traceback if a rank raised."""
        import pytest

        status, val = self.outcome(ws, name, names)
        if status != "ok":
            pytest.fail(val, pytrace=False)
        return val

    def assert_no_problems(self, ws: int, name: str, names: Sequence[str],
                           ignore: Callable[[str], bool] = lambda p: False) -> None:
        """For a scenario that returns its problems (a list of lines): no rank
        found any (but those ``ignore`` says are for information)."""
        per_rank = self.results(ws, name, names)
        bad = {r: [p for p in problems if not ignore(p)] for r, problems in enumerate(per_rank)}
        lines = [f"rank {r}: {p}" for r, problems in bad.items() for p in problems[:12]]
        assert not lines, f"{name!r}, world size {ws}:\n" + "\n".join(lines)


def call_by_name(functions: Sequence[Callable], name: str, rank: int, ws: int):
    """``Scenarios(functools.partial(call_by_name, FUNCTIONS))``: the scenarios
    are functions ``fn(rank, world)``, named by their ``__name__``."""
    return {fn.__name__: fn for fn in functions}[name](rank, ws)


class OptimizerContainer(torch.optim.Optimizer):
    """torchtitan's OptimizersContainer pattern: an Optimizer over all the
    parameters whose step steps the optimizers it holds (those decide, at
    their own steps, what the optimizer check and the empty gradients do)."""

    def __init__(self, params, optimizers):
        self.optimizers = optimizers
        super().__init__(params, {})

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.optimizers:
            o.zero_grad(set_to_none)


class OnFirstUse(dict):
    """``{key: make(key)}``, each value made when it is first looked up: a
    module fixture with one launch per world size launches only those the
    selected tests look up (``-k`` one case: one launch)."""

    def __init__(self, make: Callable[[Any], Any]):
        super().__init__()
        self._make = make

    def __missing__(self, key):
        value = self[key] = self._make(key)
        return value
