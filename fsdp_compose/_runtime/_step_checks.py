"""The root's side of the step checks of [Note: divergence] (_divergence.py):
the settings that shape a step's collectives besides the forward itself,
which ``StepChecks.before`` compares across ranks at every root forward and
backward start, and the check of a step this rank left half-done.

``SettingsFingerprint`` is a part of ``RootContext`` (its field
``fingerprint``), which passes it to ``StepChecks.before`` from
``root_pre_forward`` and ``on_backward_hook``; ``left_half_done`` is called
by ``root_pre_forward``.
"""
from __future__ import annotations

from .._comm import _collectives
from .._base._common import TrainingState


class SettingsFingerprint:
    """What shapes a phase's collectives besides the forward itself, of one
    root: the hash of its frozen settings (``RootSettings``), every unit's
    (``UnitSettings``) and which of its groups train, and a function
    explaining them in lines (see [Note: divergence]). Ints and bools only
    are hashed (alike in every process). Hashed again only when one of those
    values changed (a setter or a ``requires_grad_()`` replaced it)."""

    def __init__(self, root, units: list, checks):
        self.root, self.units, self.checks = root, units, checks
        self._key: tuple | None = None     # the values last hashed
        self._cached: tuple | None = None  # (hash, describe)

    def current(self) -> tuple:
        """(settings, describe), as ``StepChecks.before`` takes them."""
        key = (self.root.root_settings, [u.settings for u in self.units],
               [u.trains for u in self.units])
        if key != self._key:  # (compares by identity first: O(units), no hashing)
            settings, describe = self._make_settings()
            # (hashed once: a tuple's hash is not cached, and this one has a
            # tuple per unit)
            self._key, self._cached = key, (_Hashed(hash(settings)), describe)
        return self._cached  # type: ignore[return-value]

    def _make_settings(self) -> tuple:
        root, index = self.root.root_settings, self.checks.index
        settings = (root.prefetch_depth, root.bucket_bytes, root.gather_bucket_bytes,
                    root.is_last_backward, root.forward_order_dynamic, tuple(
                        (s.requires_gradient_sync, u.reshard_after_forward,
                         s.reshard_after_backward, s.unshard_in_backward, u.trains,
                         tuple(s.reduce.requires_all_reduce for g in u.groups
                               if g.replicate_pg is not None),
                         _positions(index, s.forward_prefetch),
                         _positions(index, s.backward_prefetch))
                        for u, s in ((u, u.settings) for u in self.units)))
        names = self.checks.names

        def describe() -> list[str]:
            depth, rs_bytes, ag_bytes, last, dynamic, per = settings
            return [_where(names, per, lambda s: not s[0], "set_requires_gradient_sync(False)"),
                    _where(names, per, lambda s: False in s[5], "set_requires_all_reduce(False)"),
                    _where(names, per, lambda s: not s[1], "reshard_after_forward False"),
                    _where(names, per, lambda s: not s[2], "set_reshard_after_backward(False)"),
                    _where(names, per, lambda s: not s[3], "set_unshard_in_backward(False)"),
                    _where(names, per, lambda s: False in s[4], "frozen parameter groups"),
                    _where(names, per, lambda s: s[6] != -1 or s[7] != -1,
                           "explicit prefetch (set_modules_to_*_prefetch)"),
                    f"root: prefetch depth {depth}, reduce-scatter bucket {rs_bytes} B, "
                    f"all-gather bucket {ag_bytes} B, is_last_backward {last}, "
                    f"forward_order_dynamic {dynamic}"]
        return settings, describe


def left_half_done(units: list, checks) -> None:
    """This rank left its last step half-done (an exception inside its
    forward or backward): go on only if every rank left it at the same
    collective, else raise (see [Note: divergence])."""
    busy = [f"'{u.fqn or '<root>'}' ({u.state.name})" for u in units
            if u.state is not TrainingState.IDLE]
    where = ", ".join(busy[:4]) + (f" and {len(busy) - 4} more" if len(busy) > 4 else "")
    where = f"units not finished: {where}" if busy else "its backward did not finish"
    checks.left(_collectives.issued(), where)


# ---------------------------------------------------------------------------
class _Hashed(int):
    """The settings' hash, standing for them in ``StepChecks.before``."""

    def __hash__(self) -> int:
        return int(self)


def _positions(index: dict, units: list | None):
    return -1 if units is None else tuple(index.get(v, -1) for v in units)


def _where(names: list[str], per: tuple, pick, what: str) -> str:
    hit = [n for n, s in zip(names, per) if pick(s)]
    shown = ", ".join(f"'{n}'" for n in hit[:6]) + (f" and {len(hit) - 6} more"
                                                     if len(hit) > 6 else "")
    return f"{what} on: {shown or 'no unit'}"
