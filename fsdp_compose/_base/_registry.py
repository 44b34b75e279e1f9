"""What fully_shard attaches to modules and Parameters, and the lookups from them.

A leaf: it imports nothing of the package, so every module may read it at
module level (see docs/architecture.md, "Imports"). Written by fully_shard
(_fully_shard.py), by a cast or move after it (``FSDPModule._apply``,
_fsdp_module.py) and by ``materialize``; read by the checkpoint, the
optimizer check, clip and ``param_info``.

- a sharded module's unit: ``module.__dict__["_fsdp_unit"]`` (``unit_of``);
- every sharded Parameter we created -> (group, entry) (``SHARDED``);
- a module holding sharded Parameters: its state-dict slots,
  ``{param name: (unit, group, entry)}`` (``state_dict_slots``, written by
  the checkpoint's hook registration);
- every original Parameter we replaced -> the unit that owns it
  (``REPLACED``, to catch ties across units, and an optimizer built before
  fully_shard; also the meta-device sharded Parameters ``materialize``
  replaced), and -> a weak reference to its entry (``ORIGINAL_ENTRY``,
  to name it). A unit holds no original Parameter, so these maps hold no
  key of their own either.

Process-wide by nature: every entry is attached to (weakly keyed by) its
object and goes with it; per-job state is in _job.py.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from .._runtime._unit import Unit

_UNIT_ATTR = "_fsdp_unit"


_SLOTS_ATTR = "_fsdp_ckpt_slots"


def state_dict_slots(module: nn.Module, create: bool = False) -> dict | None:
    """``{param name: (unit, group, entry)}`` of the sharded Parameters
    ``module`` holds directly (None if none, unless ``create``)."""
    slots = module.__dict__.get(_SLOTS_ATTR)
    if slots is None and create:
        slots = module.__dict__[_SLOTS_ATTR] = {}
    return slots


def unit_of(module: nn.Module) -> "Unit | None":
    return module.__dict__.get(_UNIT_ATTR)


def set_unit(module: nn.Module, unit: "Unit") -> None:
    module.__dict__[_UNIT_ATTR] = unit


def units_below(module: nn.Module) -> list[tuple[str, "Unit"]]:
    """(FQN relative to ``module``, unit) of every unit in its subtree, in
    module order; a list unit is named by all its modules."""
    found: dict = {}
    for name, m in module.named_modules():
        u = unit_of(m)
        if u is None:
            continue
        if u in found:  # a list unit: name it by all its modules
            found[u] = f"{found[u]}, {name}"
        else:
            found[u] = name
    return [(fqn, u) for u, fqn in found.items()]


class ShardedParams:
    """Every sharded Parameter we created -> (group, entry).

    Weak both ways, without a weak reference to the Parameter: keyed by
    ``id(param)``, valued by weak references to the group and the entry, and
    a hit only while the entry still holds that very Parameter (an id reused
    by a new object is never a hit). A weak reference to the Parameter would
    make ``torch.utils.swap_tensors`` refuse it, and ``nn.Module._apply``
    swaps every DTensor parameter (ours are: _row_dtensor.py). ``get`` gives
    None once the model is gone; dead keys are dropped as the registry grows.
    """

    def __init__(self):
        self._refs: dict = {}
        self._pruned_at = 64

    def __setitem__(self, param: nn.Parameter, hit: tuple) -> None:
        g, e = hit
        self._refs[id(param)] = (weakref.ref(g), weakref.ref(e))
        if len(self._refs) > 2 * self._pruned_at:
            self._prune()

    def _prune(self) -> None:
        for k in [k for k, (_g, e) in self._refs.items() if e() is None]:
            del self._refs[k]
        self._pruned_at = max(64, len(self._refs))

    def get(self, param):
        refs = self._refs.get(id(param))
        if refs is None:
            return None
        g, e = refs[0](), refs[1]()
        if g is None or e is None or e.sharded is not param:
            return None
        return (g, e)

    def __contains__(self, param) -> bool:
        return self.get(param) is not None

    def __getitem__(self, param) -> tuple:
        hit = self.get(param)
        if hit is None:
            raise KeyError("not a Parameter sharded by fully_shard (or its model is gone)")
        return hit

    def pop(self, param) -> None:
        self._refs.pop(id(param), None)

    def grad_owners(self, tensors) -> dict:
        """``{id(t): parameter}`` for each of ``tensors`` that is the ``.grad``
        of a sharded Parameter (one pass over the registry)."""
        want = {id(t) for t in tensors}
        out = {}
        for _g, er in list(self._refs.values()):
            e = er()
            if e is None:
                continue
            p = e.sharded
            grad = p.grad
            if grad is not None and id(grad) in want:
                out[id(grad)] = p
        return out

    def add_groups(self, groups) -> None:
        """Register the sharded Parameters of ``groups`` (again, after they were re-made)."""
        for g in groups:
            for e in g.entries:
                self[e.sharded] = (g, e)


SHARDED = ShardedParams()
REPLACED: WeakIdKeyDictionary = WeakIdKeyDictionary()        # original -> its unit
ORIGINAL_ENTRY: WeakIdKeyDictionary = WeakIdKeyDictionary()  # original -> weakref(entry)
