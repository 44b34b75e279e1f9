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

_SAVED: dict = {}  # torch's module -> its own fully_shard: process-wide, as modules are


def use_as_fsdp2(enable: bool = True) -> None:
    """With True, ``torch.distributed.fsdp.fully_shard`` is fsdp_compose's
    ``fully_shard`` for code that looks it up from then on (call it before
    importing a stack that imports the name at import time, e.g.
    torchtitan); with False, torch's own again."""
    from .._base._compat import fully_shard_homes
    from ._fully_shard import fully_shard

    homes = fully_shard_homes()
    if enable:
        for home in homes:
            _SAVED.setdefault(home.__name__, home.fully_shard)
            home.fully_shard = fully_shard  # type: ignore[attr-defined]
    else:
        for home in homes:
            if home.__name__ in _SAVED:
                home.fully_shard = _SAVED.pop(home.__name__)  # type: ignore[attr-defined]
