"""Gloo ranks on this machine: the rendezvous every launcher of this repository shares.

The demo (``fsdp_compose.demo.train``, run without torchrun), the test harness
(``tests/_dist.py``), ``tools.plan --measure`` (``tools/_measure.py``) and the
benchmarks (``benchmarks/_launch.py``) each start their ranks their own way
(fork, forkserver, spawn: what each needs differs), then every rank joins its
group the same way, as torchrun's ranks do:

* the parent picks a port that is free now (:func:`free_port`);
* a rank gets torchrun's variables for it (:func:`rank_env`: ``RANK``,
  ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and joins
  the gloo group through them (:func:`init_gloo`, ``env://``: rank 0 hosts
  the store).

Private: for this repository's own launchers, not part of the API. It lives
in the package because the demo, which the package ships, uses it. A leaf: it
imports nothing of the package, and only the standard library at module level
(torch inside :func:`init_gloo`), so that the benchmarks' orchestrating
process, which stays torch-free, can load this file by its path.
"""
from __future__ import annotations

import os
import socket

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port of ``HOST`` that is free now. Another process may still bind
    it before rank 0 does; the test harness retries a launch that lost it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((HOST, 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun sets for ``rank`` of a one-machine job of ``world`` ranks
    whose rendezvous is ``HOST:port``."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "MASTER_ADDR": HOST, "MASTER_PORT": str(port)}


def init_gloo(rank: int, world: int, port: int | None = None, *,
              timeout: float | None = None, threads: int | None = None) -> None:
    """Join the gloo group as ``rank`` of ``world`` (``env://``).

    ``port``: the rendezvous port; :func:`rank_env` is set in ``os.environ``
    first. None: the environment already holds it (a launcher set
    ``rank_env`` in the process). ``timeout``: seconds, for the rendezvous
    and every collective (None: torch's default). ``threads``:
    ``torch.set_num_threads`` first (None: left as it is).
    """
    if port is not None:
        os.environ.update(rank_env(rank, world, port))
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if threads is not None:
        torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=None if timeout is None else timedelta(seconds=timeout))
