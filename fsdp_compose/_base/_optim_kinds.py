"""How an optimizer class uses its parameters: the table behind the optimizer
check ([Note: optimizers on sharded parameters] in _torch_hooks.py) and
behind which optimizers keep state for an empty piece (the state dicts in
_checkpoint.py follow training). A leaf: read by both."""
from __future__ import annotations

import torch

ELEMENTWISE = "elementwise"    # exact on any piece
WHOLE_TENSOR = "whole_tensor"  # exact where each piece is the whole tensor (or empty)
GLOBAL = "global"              # reduces over all parameters: exact only unsharded
KINDS = (ELEMENTWISE, WHOLE_TENSOR, GLOBAL)

# process-wide, keyed by class (fsdp_compose.declare_optimizer adds the user's)
KIND_BY_CLASS: dict[type, str] = {}
for _name in ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "RMSprop", "NAdam", "RAdam",
              "Adamax", "Rprop", "ASGD"):
    KIND_BY_CLASS[getattr(torch.optim, _name)] = ELEMENTWISE
for _name in ("Muon", "Adafactor"):
    if hasattr(torch.optim, _name):
        KIND_BY_CLASS[getattr(torch.optim, _name)] = WHOLE_TENSOR
KIND_BY_CLASS[torch.optim.LBFGS] = GLOBAL


def optimizer_kind(cls: type) -> str | None:
    """The declared kind of ``cls``: its own, or that of the nearest base it
    inherits ``step`` from; None if unknown."""
    for c in cls.__mro__:
        kind = KIND_BY_CLASS.get(c)
        if kind is not None:
            return kind
        if "step" in vars(c):  # its own step: a base's kind says nothing about it
            return None
    return None


def steps_empty_pieces(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step()`` sees the empty gradients of parameters this rank
    holds none of (element-wise optimizers), and so keeps (empty) state for
    them, as DDP's optimizer does; the others do not see them and keep none
    (see [Note: optimizers on sharded parameters] in _torch_hooks.py)."""
    return optimizer_kind(type(opt)) == ELEMENTWISE
