"""What fsdp_compose attaches to torch's global extension points, and why.

[Note: optimizers on sharded parameters]
While sharded, each parameter is this rank's piece of the original (whole
dim-0 rows; or whole / empty with the tensor layout or at shard world size 1).
An optimizer is exact on pieces only if it is *element-wise* (SGD, Adam, ...);
one needing whole tensors (Muon, Adafactor) is exact only where every piece
it steps is whole or empty, and a global one (LBFGS) never. Those would train
differently from DDP silently, so the first ``step()`` of such an optimizer
over pieces raises, from torch's global optimizer step pre-hook, before
anything is written. The verdict is a function of the layout, alike on every
rank, so every rank raises together. Kinds are by class (a subclass that does
not override ``step`` inherits its base's; unknown: whole-tensor;
``declare_optimizer`` overrides), checked once per optimizer and parameter list.
Where a rank holds none of a parameter, ``p.grad`` is an empty gradient
([Note: empty pieces] in _grad_path.py); for an optimizer that is not
element-wise it is set aside for the length of ``step()`` (the post-hook puts it back).

[Note: torch.nn.utils.clip_grad_norm_]
torch's ``clip_grad_norm_`` computes the norm of the gradients it is given:
on sharded parameters that is this rank's part, so each rank would clip by a
different, too small norm, silently. At the first ``fully_shard`` we make it
right: ``torch.nn.utils.clip_grad_norm_`` (and ``torch.nn.utils.clip_grad.
clip_grad_norm_``) become a dispatcher that hands any call whose parameters
include ours to ``fsdp_compose.clip_grad_norm_`` (the global norm across the
mesh; the same result DDP gets), and every other call to torch's function
unchanged. A reference taken before that (``from torch.nn.utils import
clip_grad_norm_`` before the first ``fully_shard``) still calls torch's own
function; that path is made loud (see ``_compat.guard_torch_clip_helper``).
``torch.nn.utils.get_total_norm`` (which torchtitan's clipping calls on the
gradients, before ``clip_grads_with_norm_``) is routed the same way when any
tensor it is given is the gradient of a sharded parameter; with the global
norm, ``clip_grads_with_norm_`` (a local scaling) is right as it is.

[Note: loss scaling]
``torch.amp.GradScaler.unscale_`` looks for inf/nan in the gradients this
rank holds. A RowParam's gradient is a DTensor: torch's check then
all-reduces ``found_inf`` over its mesh (as under FSDP2), and with it the
flags of plain gradients in the same call (a 0-d parameter's piece of the
same dtype and device). Gradients that are still plain row pieces
(tensor-parallel parameters inside units) are checked on this rank's rows
alone: an overflow in one rank's rows would make that rank alone skip
``optimizer.step()`` and back off its scale, silently (docs/design.md,
"Loss scaling"). So at the first ``fully_shard`` ``GradScaler.unscale_``
(which ``step`` calls too) gets a guard: for an enabled scaler whose
optimizer holds such a piece split over ranks, it raises on every rank (the
layout is the same on every rank) naming the parameter and
``ShardedGradScaler``, before anything is unscaled. ``ShardedGradScaler``
overrides ``unscale_``, so it never reaches the guard.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from .._base import _compat

from .._comm import _divergence

from . import _local_step
from .._base._common import rank as _rank, unit_error
from .._base._optim_kinds import (ELEMENTWISE, GLOBAL, KIND_BY_CLASS as _KIND_BY_CLASS,
                           KINDS as _KINDS, optimizer_kind, steps_empty_pieces)
from .._base._registry import ORIGINAL_ENTRY, REPLACED, SHARDED
from .._group._row_dtensor import RowParam


def declare_optimizer(cls: type, kind: str) -> None:
    """Tell fsdp_compose how optimizer class ``cls`` uses its parameters.

    ``"elementwise"``: each element's update depends only on that element's
    gradient and state (runs on any sharded piece); ``"whole_tensor"``: needs
    each parameter whole (runs with ``shard_granularity="tensor"`` or at shard
    world size 1); ``"global"``: reduces over all parameters (runs only where
    nothing is sharded). Optimizers fsdp_compose does not know are treated as
    ``"whole_tensor"``.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"fsdp_compose.declare_optimizer: {cls!r} is not a torch.optim.Optimizer "
                        "subclass.")
    if kind not in _KINDS:
        raise ValueError(f"fsdp_compose.declare_optimizer: kind must be one of {_KINDS}, "
                         f"got {kind!r}.")
    _KIND_BY_CLASS[cls] = kind
    _checked.clear()


# optimizer -> (the parameter-list signature it was checked with, holds sharded parameters,
#              the parameters whose empty gradient its step() must not see)
_checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()
# optimizer -> [(parameter, its empty gradient)] set aside while its step() runs
_set_aside: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list]" = weakref.WeakKeyDictionary()


def _signature(opt: torch.optim.Optimizer) -> tuple:
    return tuple(len(g["params"]) for g in opt.param_groups)


# ------------------------------------------------------------------------
# An optimizer built before fully_shard holds the original Parameters, which
# no module uses any more: it would step tensors without gradients and the
# model would silently never train. Refused at its first step, on every rank
# alike (each rank built its optimizer the same way), by the optimizer check
# below (torch.optim's global step pre-hook, cached per optimizer and
# parameter list).
def _replaced_name(p) -> str | None:
    """The FQN of ``p`` if fully_shard, materialize or an assign=True load on
    meta replaced it, else None."""
    if p in REPLACED:
        ref = ORIGINAL_ENTRY.get(p)
        e = ref() if ref is not None else None
        return e.fqn if e is not None else f"a parameter of unit '{REPLACED[p].fqn}'"
    hit = SHARDED.get(p)
    if hit is not None and hit[1].sharded is not p:  # a meta Parameter before materialize
        return hit[1].fqn
    return None


def check_no_replaced_params(optimizer) -> None:
    """Raise if ``optimizer`` holds Parameters that fully_shard, materialize or a
    ``load_state_dict(assign=True)`` on meta replaced."""
    stale = [name for g in optimizer.param_groups for p in g["params"]
             if (name := _replaced_name(p)) is not None]
    if stale:
        shown = ", ".join(repr(s) for s in stale[:8]) + (
            f" and {len(stale) - 8} more" if len(stale) > 8 else "")
        raise RuntimeError(
            f"fsdp_compose [rank {_rank()}]: {type(optimizer).__name__}.step(): the "
            f"optimizer holds {len(stale)} parameter(s) that fully_shard (or materialize, or "
            f"load_state_dict(assign=True) on the meta device) replaced: {shown}. No module "
            "uses them any more, so they get no gradient and the model would never train. "
            "Build the optimizer after fully_shard (and after materialize or an assign=True "
            "load), from model.parameters().")


def _step_pre_hook(opt: torch.optim.Optimizer, _args, _kwargs):
    _local_step.restore(opt)  # (a step that raised: its post-hook never ran)
    sig = _signature(opt)
    seen = _checked.get(opt)
    if seen is None or seen[0] != sig:
        _check_optimizer(opt)
        seen = _checked[opt] = (sig, _holds_sharded(opt), _empty_pieces_to_hide(opt),
                                optimizer_kind(type(opt)) is None and _is_container(opt))
        if seen[1]:  # its state dicts in FSDP2's form (and state loaded before this step)
            from ..checkpoint._checkpoint import attach_optimizer
            attach_optimizer(opt)
    if seen[1]:  # the steps every rank must take alike (see [Note: divergence])
        _divergence.count_optimizer_step()
    if seen[2]:
        _set_aside_empty_grads(opt, seen[2])
    if seen[1] and not seen[3] and _local_step.swap_in(opt):  # local tensors (_local_step.py)
        return _local_step.wrap_closure(opt, _args, _kwargs)
    return None


def _step_post_hook(opt: torch.optim.Optimizer, _args, _kwargs) -> None:
    _local_step.restore(opt)
    _restore_empty_grads(opt)


def _holds_sharded(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` steps parameters sharded over more than one rank (a
    model of world size 1 has no ranks to diverge from)."""
    for g in opt.param_groups:
        for p in g["params"]:
            hit = SHARDED.get(p)
            if hit is not None and (hit[0].world > 1 or hit[0].replicas > 1):
                return True
    return False


def _empty_pieces_to_hide(opt: torch.optim.Optimizer) -> tuple:
    """The parameters whose empty gradient ``opt.step()`` must not see (see the
    Note); none for an element-wise optimizer, or for a container, whose
    inner optimizers decide at their own steps."""
    if steps_empty_pieces(opt) or (optimizer_kind(type(opt)) is None and _is_container(opt)):
        return ()
    return tuple(p for g in opt.param_groups for p in g["params"]
                 if (hit := SHARDED.get(p)) is not None and hit[1].held_elsewhere())


def _set_aside_empty_grads(opt: torch.optim.Optimizer, params: tuple) -> None:
    _restore_empty_grads(opt)  # (a step that raised: its step post-hook never ran)
    aside = []
    for p in params:
        if p.grad is not None:
            aside.append((p, p.grad))
            p.grad = None
    if aside:
        _set_aside[opt] = aside


def _restore_empty_grads(opt: torch.optim.Optimizer) -> None:
    for p, grad in _set_aside.pop(opt, ()):
        if p.grad is None:  # (unless the step's closure made a new one)
            p.grad = grad


def _inner_optimizers(opt: torch.optim.Optimizer) -> list:
    """Optimizers ``opt`` holds as attributes (directly, or in a list, tuple or
    dict): a container such as torchtitan's ``OptimizersContainer``, whose
    ``step`` steps each of them."""
    found = []
    for v in vars(opt).values():
        items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]
        found += [o for o in items if isinstance(o, torch.optim.Optimizer) and o is not opt]
    return found


def _is_container(opt: torch.optim.Optimizer) -> bool:
    """Every parameter of ``opt`` is stepped by an optimizer inside it, which is
    checked at its own step: the container itself computes nothing."""
    inner = _inner_optimizers(opt)
    if not inner:
        return False
    covered = {id(p) for o in inner for g in o.param_groups for p in g["params"]}
    return all(id(p) in covered for g in opt.param_groups for p in g["params"])


def _check_optimizer(opt: torch.optim.Optimizer) -> None:
    check_no_replaced_params(opt)  # built before fully_shard: never trains
    cls = type(opt)
    kind = optimizer_kind(cls)
    if kind == ELEMENTWISE:
        return
    if kind is None and _is_container(opt):
        return
    for group in opt.param_groups:
        for p in group["params"]:
            hit = SHARDED.get(p)
            if hit is None:
                continue
            g, e = hit
            if not split_across_ranks(g, e):
                continue
            name = cls.__name__
            if kind == GLOBAL:
                what = (f"{name} reduces over all parameters (dot products of the whole "
                        f"gradient), but parameter '{e.fqn}' is sharded: each rank would use "
                        "only its own piece and training would silently differ from DDP.")
                fix = (f"{name} cannot step sharded parameters. Use an element-wise optimizer "
                       "(SGD, Adam, AdamW, ...), or run this model unsharded (DDP).")
            else:
                if kind is None:
                    what = (f"fsdp_compose does not know whether {name} is element-wise, and "
                            f"parameter '{e.fqn}' is split across ranks (each rank holds a "
                            "block of its rows): an optimizer that needs whole tensors would "
                            "silently train differently from DDP.")
                    fix = (f"If each element's update of {name} depends only on that "
                           f"element's gradient and state, declare it: fsdp_compose."
                           f"declare_optimizer({name}, 'elementwise'). If it needs whole "
                           "tensors, shard this unit with fully_shard(..., "
                           "shard_granularity='tensor') (each parameter whole on one rank).")
                else:
                    what = (f"{name} needs whole tensors, but parameter '{e.fqn}' is split "
                            "across ranks (each rank holds a block of its rows): it would "
                            "silently train differently from DDP.")
                    fix = ("Shard this unit with fully_shard(..., shard_granularity='tensor') "
                           "(each parameter whole on one rank), or step these parameters with "
                           "an element-wise optimizer.")
            raise unit_error(g.unit_fqn, what, fix)


def split_across_ranks(g, e) -> bool:
    """Whether more than one rank holds a part of entry ``e`` of group ``g``.

    A function of the layout alone (the same answer on every rank), so that a
    check built on it raises on every rank or on none.
    """
    if g.world == 1:
        return False
    if e.tp is not None:  # a TP shard is never the whole parameter
        return True
    if e.numel == 0:
        return False
    i = next(i for i, x in enumerate(g.entries) if x is e)
    return len(g.layout.ranks_of(i)) > 1


# ---------------------------------------------------------------------------
# clip_grad_norm_: see the Note
# ---------------------------------------------------------------------------
def _any_sharded(params) -> bool:
    return any(p in SHARDED for p in params)


def _split_hit(p):
    """(group, entry) of ``p`` if its gradient is spread over ranks (a local
    norm or inf check sees part of it); else None."""
    hit = SHARDED.get(p)
    return hit if hit is not None and (hit[0].world > 1 or hit[1].tp is not None) else None


def _first_split(params):
    """The first of ``params``' ``_split_hit``s; None if none is split."""
    return next((hit for p in params if (hit := _split_hit(p)) is not None), None)


def _any_split(params) -> bool:
    """Some parameter's gradient is spread over ranks (the local norm is not the norm)."""
    return _first_split(params) is not None


def _first_unchecked_split(params):
    """(group, entry) of the first split parameter whose inf/nan check torch's
    ``GradScaler`` would keep rank-local; None if none. A RowParam's gradient
    is a DTensor: torch's check all-reduces ``found_inf`` over its mesh, and
    with it the flags of the plain gradients of the same dtype and device in
    that call (a 0-d parameter's piece, outside HSDP). A TP parameter whose
    meshes torch cannot join stays a plain piece, rank-local."""
    checked = {(p.dtype, p.device) for p in params if isinstance(p, RowParam)}
    for p in params:
        hit = _split_hit(p)
        if hit is None:
            continue
        g, e = hit
        if e.row is not None:
            continue
        if e.tp is None and g.replicas == 1 and (p.dtype, p.device) in checked:
            continue
        return hit
    return None


def _guard_grad_scaler(original):
    """See [Note: loss scaling]."""
    def unscale_(self, optimizer):
        hit = self.is_enabled() and _first_unchecked_split(
            [p for group in optimizer.param_groups for p in group["params"]])
        if hit:
            raise unit_error(
                hit[0].unit_fqn, f"{type(self).__name__} on sharded parameters ('{hit[1].fqn}' "
                "is split over ranks): its inf/nan check reads only the gradient rows this "
                "rank holds, so an overflow would make some ranks skip the optimizer step and "
                "others not.", "Use torch.distributed.fsdp.sharded_grad_scaler."
                "ShardedGradScaler (same arguments; it checks across ranks), as with FSDP.")
        return original(self, optimizer)

    unscale_.__doc__ = original.__doc__
    unscale_.__wrapped__ = original  # type: ignore[attr-defined]
    unscale_._fsdp_compose_dispatch = True  # type: ignore[attr-defined]
    return unscale_


def _make_clip_dispatcher(original):
    def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if _any_sharded(params):
            from .clip import clip_grad_norm_ as ours
            return ours(params, max_norm, norm_type, error_if_nonfinite, foreach)
        return original(params, max_norm, norm_type, error_if_nonfinite, foreach)

    clip_grad_norm_.__doc__ = original.__doc__
    clip_grad_norm_.__wrapped__ = original  # type: ignore[attr-defined]
    clip_grad_norm_._fsdp_compose_dispatch = True  # type: ignore[attr-defined]
    return clip_grad_norm_


def _make_total_norm_dispatcher(original):
    def get_total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                       foreach: bool | None = None):
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if SHARDED.grad_owners(ts):
            from .clip import get_total_norm as ours
            return ours(ts, norm_type, error_if_nonfinite, foreach)
        return original(ts, norm_type, error_if_nonfinite, foreach)

    get_total_norm.__doc__ = original.__doc__
    get_total_norm.__wrapped__ = original  # type: ignore[attr-defined]
    get_total_norm._fsdp_compose_dispatch = True  # type: ignore[attr-defined]
    return get_total_norm


def _stale_clip_error(parameters) -> None:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if _any_split(params):
        raise RuntimeError(
            "fsdp_compose: torch's clip_grad_norm_ was called on sharded parameters through a "
            "reference taken before the first fully_shard (e.g. `from torch.nn.utils import "
            "clip_grad_norm_` at the top of the script): it computes this rank's part of the "
            "norm only, and would clip each rank differently. Call fsdp_compose.clip_grad_norm_"
            " (or torch.nn.utils.clip_grad_norm_ looked up at call time, which fsdp_compose "
            "routes to it).")


# What install() changed, as the calls that undo it (None: not installed);
# ``install_torch_hooks(False)`` also keeps fully_shard from installing.
_undo: list | None = None
_auto = True


def install() -> None:
    """Called by every fully_shard: installs once per process (see
    ``install_torch_hooks``)."""
    if _undo is None and _auto:
        _install()


def _install() -> None:
    global _undo
    undo: list = []
    for register, hook in ((register_optimizer_step_pre_hook, _step_pre_hook),
                           (register_optimizer_step_post_hook, _step_post_hook)):
        undo.append(register(hook).remove)

    def patch(owners, name, make):
        original = getattr(owners[0], name)
        if getattr(original, "_fsdp_compose_dispatch", False):
            return  # (installed by another copy of the package: keep it)
        new = make(original)
        for owner in owners:
            setattr(owner, name, new)

        def restore():
            for o in owners:
                setattr(o, name, original)
        undo.append(restore)

    patch((nn.utils.clip_grad, nn.utils), "clip_grad_norm_", _make_clip_dispatcher)
    patch((nn.utils,), "get_total_norm", _make_total_norm_dispatcher)
    patch((torch.amp.GradScaler,), "unscale_", _guard_grad_scaler)
    undone = _compat.guard_torch_clip_helper(_stale_clip_error)
    if undone is not None:
        undo.append(undone)
    _undo = undo


def install_torch_hooks(enable: bool = True) -> None:
    """What fsdp_compose attaches to torch, so that torch's own entry points
    stay right on sharded parameters (on by default: the first
    ``fully_shard`` installs it, once per process):

    - a global optimizer step pre-/post-hook: the check that an optimizer is
      exact on the pieces it steps ([Note: optimizers on sharded parameters]);
    - ``torch.nn.utils.clip_grad_norm_`` and ``torch.nn.utils.get_total_norm``
      route calls on sharded gradients to ours (the global norm; any other
      call goes to torch's unchanged), and torch's clip helper raises when
      reached through a reference taken before ([Note:
      torch.nn.utils.clip_grad_norm_]);
    - ``torch.amp.GradScaler.unscale_`` raises on sharded parameters, naming
      ``ShardedGradScaler`` ([Note: loss scaling]).

    ``install_torch_hooks(False)`` removes all of it (torch's functions as
    they were) and keeps later ``fully_shard`` calls from installing it;
    ``install_torch_hooks()`` installs it again. Without it those entry
    points are silently wrong on sharded parameters: call
    ``fsdp_compose.clip_grad_norm_`` and ``ShardedGradScaler`` yourself."""
    global _undo, _auto
    _auto = enable
    if enable:
        if _undo is None:
            _install()
        return
    for fn in reversed(_undo or []):
        fn()
    _undo = None
