"""One flat group: the parameters of one unit that share (dtype, requires_grad).

[Note: tensor vocabulary]
For a group on a mesh of ``W`` ranks, with ``S`` elements per rank:

- *local shard* ``shard`` (S): persistent. Rank r's slice ``[r·S, (r+1)·S)``
  of the padded flat buffer. The sharded ``nn.Parameter``s the optimizer holds
  are 1-D views of it. It is the all-gather *input*, as is: no copy-in.
- *unsharded flat* ``flat`` (W·S): a leaf tensor (``requires_grad`` when the
  group trains) whose storage is allocated on unshard and freed on reshard
  (``untyped_storage().resize_``), so the tensor and every view of it keep
  their identity across iterations. It is the all-gather *output*: no copy-out.
  At world size 1 it aliases the local shard and is never freed.
- *unsharded views*: the original parameters while unsharded, made by a
  single ``split`` of ``flat`` plus a ``view`` each. One split means one
  autograd node: backward writes ONE flat gradient (zeros for unused
  parameters and padding) into ``flat.grad`` through a single AccumulateGrad,
  whose post-accumulate hook is the group's post-backward.
  The split is re-made at every grad-enabled forward (``refresh_views``), not
  once: the autograd engine runs ready nodes in decreasing sequence number,
  so a split node created at ``fully_shard`` time would be starved until the
  whole backward is done (no reduce-scatter overlap, every unit unsharded at
  once). Made in pre-forward, it runs as soon as the unit's gradients are in.
- *flat gradient* ``flat.grad`` (W·S): the reduce-scatter *input*, as is.
- *gradient shard* (S): the reduce-scatter output, as is. ``p.grad`` of each
  sharded parameter is the matching 1-D view of it; only those views keep it
  alive, so ``zero_grad()`` frees it. At world size 1 it is the flat gradient.

Layout: each parameter starts at a multiple of ``ALIGN_BYTES`` (gap elements
between parameters are padding), and the total is padded to a multiple of
``W × alignment`` so that every rank's shard starts aligned.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ._common import ShardedState, unit_error
from ._streams import Pending, StreamManager

ALIGN_BYTES = 16


def _ceil_to(n: int, k: int) -> int:
    return (n + k - 1) // k * k


@dataclass
class ParamEntry:
    """One unique original parameter inside a flat group."""

    fqn: str                        # name relative to the outermost fully_shard'd module
    shape: torch.Size
    offset: int                     # start in the unsharded flat buffer
    slots: list                     # [(module, attr_name)] that hold this parameter
    local_range: tuple[int, int]    # slice of param.flatten() this rank holds
    shard_range: tuple[int, int]    # the same elements' place in the local shard
    sharded: nn.Parameter = None    # 1-D view of the local shard
    unsharded: torch.Tensor = None  # full-shape view of the unsharded flat buffer

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass
class _GradLaunch:
    """A reduce-scatter in flight, and how to fold its output into p.grad."""

    group: "FlatGroup"
    pending: Pending
    output: torch.Tensor
    mode: str  # "fresh" | "accumulate" | "mixed"
    done: bool = field(default=False)

    def finish(self) -> None:
        if not self.done:
            self.pending.wait()
            self.group._fold_grad(self.output, self.mode)
            self.done = True


class FlatGroup:
    def __init__(self, unit_fqn: str, params: list, *, device: torch.device,
                 world: int, rank: int, pg, rs_pg):
        # params: [(param, [(module, name), ...], rel_fqn)] in registration order
        first = params[0][0]
        self.dtype: torch.dtype = first.dtype
        self.requires_grad: bool = first.requires_grad
        self.world = world
        self.pg, self.rs_pg = pg, rs_pg  # all-gathers / reduce-scatters, see _state.py
        self.unit_fqn = unit_fqn
        self.device = torch.device("meta") if first.is_meta else device
        self.state = ShardedState.SHARDED
        self._views_installed = False  # the modules hold the full-shape views

        align = max(1, ALIGN_BYTES // first.element_size())
        entries, split_sizes, view_at = [], [], []
        offset = 0
        for p, slots, fqn in params:
            n = p.numel()
            view_at.append(len(split_sizes))
            split_sizes.append(n)
            end = _ceil_to(offset + n, align)
            if end > offset + n:
                split_sizes.append(end - offset - n)  # gap: padding
            entries.append(ParamEntry(fqn, p.shape, offset, slots, (0, 0), (0, 0)))
            offset = end
        self.padded_numel = _ceil_to(max(offset, 1), world * align)
        if self.padded_numel > offset:
            split_sizes.append(self.padded_numel - offset)  # tail padding
        self.shard_numel = S = self.padded_numel // world
        self.entries: list[ParamEntry] = entries

        # Local shard: copy in this rank's piece of every parameter.
        self.shard = torch.zeros(S, dtype=self.dtype, device=self.device)
        lo, hi = rank * S, (rank + 1) * S
        with torch.no_grad():
            for e, (p, _, _) in zip(entries, params):
                a, b = max(e.offset, lo), min(e.offset + e.numel, hi)
                if a < b:
                    e.local_range, e.shard_range = (a - e.offset, b - e.offset), (a - lo, b - lo)
                    if not p.is_meta:
                        src = p.detach().reshape(-1)[a - e.offset:b - e.offset]
                        self.shard[a - lo:b - lo].copy_(src)
                e.sharded = nn.Parameter(self.shard[slice(*e.shard_range)],
                                         requires_grad=self.requires_grad)
                e.sharded.__dict__.update(p.__dict__)  # user attributes survive

        # Unsharded flat buffer (the all-gather output), its views made once.
        if world == 1:
            self.flat = self.shard.data  # alias, own version counter; never freed
        else:
            self.flat = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
        self.flat.requires_grad_(self.requires_grad)
        # `.data` shares storage but not the version counter: writing the
        # all-gather into it does not invalidate tensors saved for backward.
        self.flat_data = self.flat.data
        self._split_sizes, self._view_at = split_sizes, view_at
        self.refresh_views()
        self._free_flat()

        self._grad_shard_ref = None   # weakref: see _adopt_grad_shard
        self._grad_view_refs = None
        self._pending: Pending | None = None

    # ------------------------------------------------------------------ views
    def refresh_views(self) -> None:
        """Re-make the full-shape views (and their one split node), see the Note."""
        chunks = torch.split(self.flat, self._split_sizes)
        for e, i in zip(self.entries, self._view_at):
            e.unsharded = chunks[i].view(e.shape)
        self._views_installed = False

    def install_sharded(self) -> None:
        for e in self.entries:
            for m, name in e.slots:
                m._parameters[name] = e.sharded
        self._views_installed = False

    def install_unsharded(self) -> None:
        if self._views_installed:
            return
        for e in self.entries:
            for m, name in e.slots:
                m._parameters[name] = e.unsharded
        self._views_installed = True

    # ---------------------------------------------------------- unshard/reshard
    def _frees_storage(self) -> bool:
        return self.world > 1 and self.device.type != "meta"

    def _free_flat(self) -> None:
        if self._frees_storage():
            self.flat.untyped_storage().resize_(0)

    def unshard(self, streams: StreamManager) -> None:
        """Issue the all-gather (no wait). Idempotent."""
        if self.state is not ShardedState.SHARDED:
            return
        if self.device.type == "meta":
            raise unit_error(self.unit_fqn,
                             f"parameters {[e.fqn for e in self.entries]} are on the meta device.",
                             "Initialise them on a real device before calling fully_shard.")
        if self.world == 1:
            self.state = ShardedState.UNSHARDED
            return
        self.flat.untyped_storage().resize_(self.padded_numel * self.flat.element_size())
        self._pending = streams.all_gather(self.flat_data, self.shard, self.pg)
        self.state = ShardedState.UNSHARDING

    def wait_for_unshard(self) -> None:
        if self.state is ShardedState.UNSHARDING:
            self._pending.wait()
            self._pending = None
            self.state = ShardedState.UNSHARDED
        if self.state is ShardedState.UNSHARDED:
            self.install_unsharded()

    def reshard(self) -> None:
        if self.state is ShardedState.SHARDED:
            return
        if self.state is ShardedState.UNSHARDING:  # never free memory a collective writes
            self._pending.wait()
            self._pending = None
        self.install_sharded()
        self._free_flat()
        self.state = ShardedState.SHARDED

    # --------------------------------------------------------------- gradients
    # The gradient shard is held only by the p.grad views (through their
    # ``_base``): ``zero_grad(set_to_none=True)`` frees it, as in plain PyTorch.
    # We keep weak references, to recognise our views and accumulate into them.
    def _adopt_grad_shard(self, buf: torch.Tensor) -> None:
        views = [buf[slice(*e.shard_range)] for e in self.entries]
        for e, v in zip(self.entries, views):
            e.sharded.grad = v
        self._grad_shard_ref = weakref.ref(buf)
        self._grad_view_refs = [weakref.ref(v) for v in views]

    def _grad_mode(self) -> str:
        """fresh: no p.grad is set; accumulate: every p.grad is our view; else mixed."""
        grads = [e.sharded.grad for e in self.entries]
        if all(g is None for g in grads):
            return "fresh"
        refs = self._grad_view_refs
        if refs is not None and all(g is r() for g, r in zip(grads, refs)):
            return "accumulate"
        return "mixed"

    def launch_reduce_scatter(self, streams: StreamManager) -> _GradLaunch:
        """Reduce-scatter ``flat.grad`` (zeros if this rank produced none)."""
        flat_grad = self.flat.grad
        self.flat.grad = None
        if flat_grad is None:
            flat_grad = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        mode = self._grad_mode()
        if self.world == 1:  # the flat gradient is the gradient shard
            return _GradLaunch(self, Pending(None, ()), flat_grad, mode)
        # fresh: the output becomes the gradient shard (no copy)
        out = torch.empty(self.shard_numel, dtype=self.dtype, device=self.device)
        return _GradLaunch(self, streams.reduce_scatter(out, flat_grad, self.rs_pg), out, mode)

    def _fold_grad(self, out: torch.Tensor, mode: str) -> None:
        with torch.no_grad():
            if mode == "fresh":
                self._adopt_grad_shard(out)
            elif mode == "accumulate":
                self._grad_shard_ref().add_(out)
            else:  # some p.grad were set to None or replaced by the user
                for e in self.entries:
                    piece = out[slice(*e.shard_range)]
                    g = e.sharded.grad
                    if g is None:
                        e.sharded.grad = piece.clone()
                    else:
                        g.add_(piece.view_as(g))

    def __repr__(self) -> str:
        return (f"FlatGroup({self.unit_fqn!r}, {self.dtype}, requires_grad={self.requires_grad}, "
                f"params={len(self.entries)}, numel={self.padded_numel}, shard={self.shard_numel}, "
                f"{self.state.name})")
