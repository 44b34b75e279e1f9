"""Fresh gloo rank processes for the benchmarks, forked from a warm fork server.

No torch import here: the orchestrating process stays torch-free, so a rank's
``ru_maxrss`` is its own. Each benchmark module defines ``_worker_entry(cfg_path)``
(the rank's work: read the config, run, write ``result<rank>.json`` into
``cfg["tmpdir"]``) and calls :func:`run_ranks` with its module name and the
modules the fork server should import once.

The rendezvous (a free port, torchrun's variables for each rank, ``env://``)
is ``fsdp_compose/_base/_launch.py``'s, shared with the tests, tools and the demo;
this process loads that file by its path (:data:`launcher`), as importing
``fsdp_compose._base._launch`` would import torch and the library. The test
harness (``tests/_dist.py``) takes it from here, for the same reason.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import tempfile
import time


def _load_launch():
    pkg = importlib.util.find_spec("fsdp_compose")  # found, not imported
    path = os.path.join(pkg.submodule_search_locations[0], "_base", "_launch.py")
    spec = importlib.util.spec_from_file_location("_fsdp_compose_launch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: ``fsdp_compose/_base/_launch.py`` (free_port, rank_env, init_gloo)
launcher = _load_launch()


class LaunchError(RuntimeError):
    """A rank failed or the launch timed out; the message has a rank's output tail."""


def import_fsdp_compose_from(root: str) -> str:
    """In a rank: import ``fsdp_compose`` from ``root`` (a checkout's top folder,
    the one holding ``fsdp_compose/``), not from wherever ``sys.path`` would find
    it; its ``__file__``. For comparing two versions of the library in one run
    (``benchmarks.before_after``). Raises if this process already imported
    ``fsdp_compose`` from elsewhere (a fork server that preloaded it): two copies
    of the library cannot share one process."""
    root = os.path.realpath(root)
    loaded = sys.modules.get("fsdp_compose")
    if loaded is not None and not os.path.realpath(loaded.__file__).startswith(root + os.sep):
        raise RuntimeError(f"fsdp_compose is already imported from {loaded.__file__}, not from "
                           f"{root}: the process that forked this rank must not preload it")
    sys.path.insert(0, root)
    importlib.invalidate_caches()
    module = importlib.import_module("fsdp_compose")
    if not os.path.realpath(module.__file__).startswith(root + os.sep):
        raise RuntimeError(f"fsdp_compose came from {module.__file__}, not from {root}")
    return module.__file__


def write_result(cfg: dict, rank: int, res: dict) -> None:
    """A rank's result, where ``run_ranks`` collects it (written atomically)."""
    tmp = os.path.join(cfg["tmpdir"], f"result{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, os.path.join(cfg["tmpdir"], f"result{rank}.json"))


def gloo_rank(cfg_path: str, run, dump_before_timeout: bool = False) -> None:
    """A rank's whole ``_worker_entry``: read the config, join the gloo group
    (``cfg["threads"]`` torch threads, ``cfg["timeout"]``), write
    ``run(cfg, rank, world)``'s result. ``dump_before_timeout``: print every
    thread's stack 5 s before the timeout (a rank stuck in a collective)."""
    with open(cfg_path) as f:
        cfg = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if dump_before_timeout:
        import faulthandler
        faulthandler.dump_traceback_later(cfg["timeout"] - 5, exit=False)
    import torch.distributed as dist
    launcher.init_gloo(rank, world, timeout=cfg["timeout"], threads=cfg["threads"])
    try:
        res = run(cfg, rank, world)
    finally:
        dist.destroy_process_group()
    write_result(cfg, rank, res)


_CONTEXTS: dict = {}


def forkserver(preload: list[str]):
    """A forkserver context whose server has ``preload`` imported (one per list)."""
    key = tuple(preload)
    if key not in _CONTEXTS:
        import multiprocessing as mp
        os.environ.setdefault("OMP_NUM_THREADS", "1")   # before the server imports torch
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
        _CONTEXTS[key] = ctx
    return _CONTEXTS[key]


def rank_main(module: str, rank: int, world: int, port: int, cfg_path: str,
              log_path: str) -> None:
    """Entry of a forked rank: redirect output, set the rendezvous env, run."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(launcher.rank_env(rank, world, port))
    try:
        importlib.import_module(module)._worker_entry(cfg_path)
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()


def run_ranks(module: str, preload: list[str], cfg: dict, world: int, timeout: float,
              what: str) -> list[dict]:
    """Run ``module._worker_entry`` in ``world`` fresh ranks; every rank's result.

    Once a rank failed the others get 10 s; past ``timeout`` all are killed.
    Raises :class:`LaunchError` naming ``what``, with a failing rank's output.
    """
    ctx = forkserver(preload)
    with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
        cfg = dict(cfg, tmpdir=tmp)
        cfg_path = os.path.join(tmp, "cfg.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        port = launcher.free_port()
        logs = [os.path.join(tmp, f"out{r}.txt") for r in range(world)]
        procs = [ctx.Process(target=rank_main, args=(module, r, world, port, cfg_path, logs[r]),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline, failed_at, timed_out = time.monotonic() + timeout, None, False
        while True:
            codes = [p.exitcode for p in procs]
            if all(c is not None for c in codes):
                break
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
            timed_out = time.monotonic() > deadline
            if timed_out or (failed_at and time.monotonic() - failed_at > 10):
                for p in procs:
                    if p.exitcode is None:
                        p.kill()
                for p in procs:
                    p.join()
                break
            time.sleep(0.05)
        codes = [p.exitcode for p in procs]
        if any(c != 0 for c in codes):
            why = "timed out" if timed_out else "failed"
            bad = next((r for r, c in enumerate(codes) if c not in (0, -9, None)), 0)
            with open(logs[bad], errors="replace") as f:
                tail = f.read()[-4000:]
            raise LaunchError(f"{what} {why}: exit codes {codes}; rank {bad} output:\n{tail}")
        out = []
        for r in range(world):
            with open(os.path.join(tmp, f"result{r}.json")) as f:
                out.append(json.load(f))
        return out
