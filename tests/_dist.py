"""Multi-process test harness: N CPU processes, one gloo process group.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes,
initialises a gloo process group in each, calls ``fn(rank, world_size,
*args)`` and returns the list of per-rank return values (which must be
picklable).  It never hangs and never loses an error:

* the first rank to fail (by wall-clock time of its exception) is re-raised
  in the parent as :class:`DistributedError`, with that rank's traceback text
  in the message (and a one-line summary of every other failed rank);
* once one rank has failed, the others get ``grace`` seconds to finish (they
  normally fail fast: gloo raises as soon as a peer's sockets close), then
  they are killed;
* if the processes are not all done after ``timeout`` seconds they are all
  killed and the call fails with the Python stacks of every rank that was
  still running (dumped by :mod:`faulthandler` a little before the deadline).

Processes are forked (cheap: torch is already imported in the parent) where
``fork`` exists; set ``FSDP_TEST_START_METHOD=spawn`` to use spawn instead (then
``fn`` and ``args`` must be picklable, i.e. ``fn`` a module-level function).

Each rank joins the group as a torchrun rank does (``fsdp_compose._base._launch``,
shared with the demo, tools and benchmarks): ``env://``, the store hosted by
rank 0 on a port that is free when the call starts; a port race (another
process binding it first) is retried once.

Each child runs with one intra-op thread (``torch.set_num_threads(1)``): these
tests launch several processes on small machines.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, NamedTuple, Optional

# fsdp_compose/_base/_launch.py, loaded by its path: importing fsdp_compose._base._launch
# would import the whole library first (the package's __init__), and the
# harness runs without the library (test_parity's mock mode).
from benchmarks._launch import launcher

__all__ = ["DistributedError", "Outcome", "run_distributed", "run_distributed_outcomes"]

free_port, init_gloo, rank_env = launcher.free_port, launcher.init_gloo, launcher.rank_env

#: gloo collective / rendezvous timeout inside the children.
PG_TIMEOUT = timedelta(seconds=60)


class DistributedError(AssertionError):
    """A rank failed, or the ranks did not finish in time.

    ``rank`` is the failing rank (``None`` on a timeout), ``tb`` its traceback
    text, ``exc_type`` the name of its exception class.
    """

    def __init__(self, msg: str, rank: Optional[int] = None, tb: str = "", exc_type: str = ""):
        super().__init__(msg)
        self.rank = rank
        self.tb = tb
        self.exc_type = exc_type


def _write_atomic(path: str, payload: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(payload, f)
    os.replace(tmp, path)


def _child(rank: int, world_size: int, port: int, workdir: str, dump_at: float,
           fn: Callable, args: tuple, linger: float = 0.0) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    os.environ.update(rank_env(rank, world_size, port))
    result_path = os.path.join(workdir, f"rank{rank}.pkl")
    stack_file = open(os.path.join(workdir, f"rank{rank}.stacks"), "w")
    # A little before the parent gives up, write every thread's stack, so a
    # hang is reported with where each rank was stuck.
    # (dump_at is wall-clock time: a spawned child starts seconds after the parent.)
    faulthandler.dump_traceback_later(max(0.1, dump_at - time.time()), repeat=False,
                                      file=stack_file, exit=False)
    import torch.distributed as dist

    payload: Any
    fail_ts = None
    try:
        init_gloo(rank, world_size, timeout=PG_TIMEOUT.total_seconds(), threads=1)
        try:
            out = fn(rank, world_size, *args)
        except BaseException:
            fail_ts = time.time()  # before teardown makes the peers fail too
            raise
        finally:
            # Separate from fn's errors: a failing fn must not be masked by a
            # teardown error (the finally re-raises fn's exception).
            if dist.is_initialized():
                dist.destroy_process_group()
        pickle.dumps(out)  # fail here, with a clear message, if unpicklable
        payload = ("ok", out)
    except BaseException as e:  # noqa: BLE001 - everything goes to the parent
        payload = ("err", fail_ts or time.time(), type(e).__name__, traceback.format_exc(),
                   str(e))
    faulthandler.cancel_dump_traceback_later()
    stack_file.close()
    try:
        _write_atomic(result_path, payload)
    except BaseException as e:  # noqa: BLE001
        _write_atomic(result_path, ("err", time.time(), type(e).__name__, traceback.format_exc()))
    sys.stdout.flush()
    sys.stderr.flush()
    if rank == 0 and linger:
        # Rank 0's process hosts the TCPStore (as torchrun's agent would, apart
        # from the workers): keep it up until every rank has ended, so that a
        # rank still reading the others' records is not cut off by rank 0's exit.
        until = time.time() + linger
        while time.time() < until and not all(
                os.path.exists(os.path.join(workdir, f"rank{r}.pkl")) for r in range(world_size)):
            time.sleep(0.05)


def _start_method() -> str:
    want = os.environ.get("FSDP_TEST_START_METHOD")
    if want:
        return want
    return "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def _read(path: str):
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGKILL)
            except OSError:
                pass
    for p in procs:
        p.join(5)


def _launch(fn, world_size, args, timeout, grace, start_method, ended=None, linger=0.0):
    ctx = mp.get_context(start_method)
    workdir = tempfile.mkdtemp(prefix="fsdp_dist_")
    try:
        port = free_port()
        dump_at = time.time() + max(0.5, timeout - min(5.0, timeout * 0.1))
        procs = [
            ctx.Process(target=_child, name=f"rank{r}",
                        args=(r, world_size, port, workdir, dump_at, fn, args, linger),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        t0, t0_wall = time.monotonic(), time.time()
        deadline = t0 + timeout
        results: List[Any] = [None] * world_size
        first_fail_at = None
        while True:
            for r, p in enumerate(procs):
                if results[r] is None and not p.is_alive():
                    p.join()
                    path = os.path.join(workdir, f"rank{r}.pkl")
                    res = _read(path)
                    if res is None:
                        res = ("err", time.time(), "ProcessDied",
                               f"rank {r} exited with code {p.exitcode} without a result "
                               f"(crash or signal)\n")
                    results[r] = res
                    if ended is not None:  # when its result was written (rank 0 may linger)
                        ended[r] = (os.path.getmtime(path) - t0_wall if os.path.exists(path)
                                    else time.monotonic() - t0)
            done = [res is not None for res in results]
            if all(done):
                break
            now = time.monotonic()
            if first_fail_at is None and any(res is not None and res[0] == "err"
                                             for res in results):
                first_fail_at = now
            if first_fail_at is not None and now - first_fail_at > grace:
                _kill(procs)
                for r in range(world_size):
                    if results[r] is None:
                        results[r] = ("killed", None, "Killed",
                                      f"rank {r} still running {grace:.0f}s after another rank "
                                      f"failed; killed\n")
                break
            if now > deadline:
                # give faulthandler's dump a moment if it has not fired yet
                _kill(procs)
                msgs = [f"ranks did not finish within {timeout:.0f}s; all killed."]
                for r in range(world_size):
                    if results[r] is not None:
                        kind = results[r][0]
                        msgs.append(f"--- rank {r}: finished ({kind})")
                        if kind == "err":
                            msgs.append(results[r][3])
                        continue
                    try:
                        with open(os.path.join(workdir, f"rank{r}.stacks")) as f:
                            stacks = f.read()
                    except OSError:
                        stacks = ""
                    msgs.append(f"--- rank {r}: still running; its stacks:\n"
                                f"{stacks or '(none dumped)'}")
                raise DistributedError("\n".join(msgs))
            time.sleep(0.02)
        for p in procs:
            p.join(5)
        return results
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


_INDUCED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
            "still running", "ProcessDied")


def _is_induced(tb: str) -> bool:
    last = tb.strip().splitlines()[-1] if tb.strip() else ""
    return any(s in last for s in _INDUCED)


_prewarmed = False


def _prewarm() -> None:
    """Import, once in the parent, what every child would otherwise import lazily.

    With ``fork`` the children inherit it; without this, each child of every
    launch pays seconds for ``torch._dynamo`` (which ``torch.optim`` pulls in
    on the first optimizer construction), all at once on a few cores.
    """
    global _prewarmed
    if _prewarmed:
        return
    _prewarmed = True
    import torch
    import torch.distributed  # noqa: F401
    import torch.distributed.distributed_c10d  # noqa: F401

    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
                    grace: float = 15.0, start_method: Optional[str] = None) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Returns the per-rank return values, in rank order.  Raises
    :class:`DistributedError` on the first failing rank (see module doc).
    """
    start_method = start_method or _start_method()
    if start_method == "fork":
        _prewarm()
    for attempt in range(2):
        results = _launch(fn, world_size, args, timeout, grace, start_method)
        errs = [(res[1], r, res[2], res[3]) for r, res in enumerate(results) if res[0] == "err"]
        if not errs and all(res[0] == "ok" for res in results):
            return [res[1] for res in results]
        if attempt == 0 and errs and all("EADDRINUSE" in e[3] or "address already in use" in e[3]
                                         for e in errs):
            continue  # lost the port race: retry once on a new port
        break
    # Root cause: the earliest error that is not just "a peer went away".
    errs.sort(key=lambda e: (_is_induced(e[3]), e[0]))
    ts, rank, etype, tb = errs[0] if errs else (None, None, "Killed", "")
    others = []
    for r, res in enumerate(results):
        if r == rank or res[0] == "ok":
            continue
        last = res[3].strip().splitlines()[-1] if res[3].strip() else res[2]
        others.append(f"  rank {r}: {last}")
    msg = f"rank {rank} failed with {etype} (first of the failing ranks):\n{tb}"
    if others:
        msg += "other ranks:\n" + "\n".join(others)
    raise DistributedError(msg, rank=rank, tb=tb, exc_type=etype)


class Outcome(NamedTuple):
    """How one rank ended (``run_distributed_outcomes``)."""

    kind: str       # "ok", "err" (fn raised) or "died" (exited without a result)
    exc_type: str   # the exception's class name ("" if ok)
    message: str    # str(exception), or why the process died
    tb: str         # the traceback text
    seconds: float  # from the start of the launch to the rank's end
    value: Any = None  # fn's return value if ok


def run_distributed_outcomes(fn: Callable, world_size: int, *args: Any, timeout: float = 30.0,
                             start_method: Optional[str] = None) -> List[Outcome]:
    """Run ``fn`` like ``run_distributed``, but return how EVERY rank ended,
    failures included, instead of raising the first failure: for tests where
    every rank must fail (e.g. with the same error). No rank is killed because
    another failed; if the ranks are not all done after ``timeout`` seconds
    they are all killed and :class:`DistributedError` says where each one was.
    """
    start_method = start_method or _start_method()
    if start_method == "fork":
        _prewarm()
    ended = [0.0] * world_size
    # (rank 0 lingers: every rank is meant to end, and to read its peers' records)
    results = _launch(fn, world_size, args, timeout, timeout, start_method, ended,
                      linger=min(20.0, timeout))
    out = []
    for r, res in enumerate(results):
        if res[0] == "ok":
            out.append(Outcome("ok", "", "", "", ended[r], res[1]))
        elif res[2] == "ProcessDied":
            out.append(Outcome("died", "", res[3].strip(), "", ended[r]))
        else:
            msg = res[4] if len(res) > 4 else res[3].strip().splitlines()[-1]
            out.append(Outcome("err", res[2], msg, res[3], ended[r]))
    return out
