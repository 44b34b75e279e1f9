"""``use_as_fsdp2()``: make code that looks up FSDP2's ``fully_shard`` use ours.

Training stacks import FSDP2's names from ``torch.distributed.fsdp``:
accelerate and the transformers Trainer inside their functions (at call time),
torchtitan at module import. Rebinding ``torch.distributed.fsdp.fully_shard``
(and the same name in ``torch.distributed.fsdp._fully_shard``, where torch
defines it) before the stack looks it up is enough for the rest: our
``fully_shard`` accepts torch's ``MixedPrecisionPolicy`` / ``OffloadPolicy``
/ ``CPUOffloadPolicy``, our units are ``torch.distributed.fsdp.FSDPModule``
instances with every public method of it, and state dicts come out in
FSDP2's form. Reversible: ``use_as_fsdp2(False)`` restores torch's.
"""
from __future__ import annotations

import functools

_SAVED: dict = {}  # torch's module -> its own fully_shard: process-wide, as modules are


def _fsdp2_fully_shard():
    """Our ``fully_shard`` as FSDP2's name calls it: the same, except that at
    shard world size 1 the sharded parameters are DTensors too, as FSDP2's
    are (``_param_entry.DTENSORS_AT_ONE``)."""
    from .._group._param_entry import DTENSORS_AT_ONE
    from ._fully_shard import fully_shard

    @functools.wraps(fully_shard)
    def fsdp2_fully_shard(module, **kw):
        token = DTENSORS_AT_ONE.set(True)
        try:
            return fully_shard(module, **kw)
        finally:
            DTENSORS_AT_ONE.reset(token)
    fsdp2_fully_shard.fsdp_compose = fully_shard  # type: ignore[attr-defined]
    return fsdp2_fully_shard


_DROP_IN: list = []  # the one wrapper, made on first use


def use_as_fsdp2(enable: bool = True) -> None:
    """With True, ``torch.distributed.fsdp.fully_shard`` is fsdp_compose's
    ``fully_shard`` for code that looks it up from then on (call it before
    importing a stack that imports the name at import time, e.g.
    torchtitan); with False, torch's own again. Called through FSDP2's
    name, sharded parameters are DTensors at shard world size 1 too, as
    FSDP2 shows them (ours called by its own name keeps plain full-shape
    parameters there: docs/design.md, "World size 1")."""
    from .._base._compat import fully_shard_homes

    homes = fully_shard_homes()
    if enable:
        if not _DROP_IN:
            _DROP_IN.append(_fsdp2_fully_shard())
        for home in homes:
            _SAVED.setdefault(home.__name__, home.fully_shard)
            home.fully_shard = _DROP_IN[0]  # type: ignore[attr-defined]
    else:
        for home in homes:
            if home.__name__ in _SAVED:
                home.fully_shard = _SAVED.pop(home.__name__)  # type: ignore[attr-defined]
