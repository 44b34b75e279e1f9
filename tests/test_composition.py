"""fully_shard composed with other PyTorch features, and with HF transformers models.

Every case compares, step by step, the sharded model (each rank: its slice of
the global batch) with a single-process reference (``copy.deepcopy`` before
sharding, the whole global batch): the rank-averaged loss at 1e-5 relative,
and every gradient and (after the optimizer step) every parameter against the
``param_info(p).local_range`` slice of the flattened reference.

Covered: activation checkpointing (``torch.utils.checkpoint`` reentrant and
not, ``checkpoint_wrapper``; inside a unit, around one unit, around a region
of two units) with all-gather counts and the recompute schedule;
``save_on_cpu`` and user ``saved_tensors_hooks``; ``ModTracker``;
``register_fsdp_forward_method`` (a ``generate`` method) and direct calls of
an inner unit; several forwards per backward (DPO-style, a unit called twice)
and several backwards per forward, also with AC; ``torch.autograd.grad``
w.r.t. an input; HF ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` (with their own
activation checkpointing, and a DPO-style two-forward step).

All-gather counts are asserted where they are a promise: activation
checkpointing costs no extra all-gather over the same configuration without
it, also when a reentrant checkpoint *inside* a unit gets its gradient in
several nested backwards (two forwards, or the unit called twice). Those
cases run with one collective per unit (``per_unit_collectives``); AC and
several forwards / backwards also run with the default buckets (parity, and
bucketed counts).

Process launches are the expensive part: every case of one world size runs in
ONE launch (cached per module), each case with fresh models; the cases that
the selected tests ask for (``_wants``: ``-k`` one test, its cases). A case that
raises stops its launch; the cases after it are re-run in a new launch, so
every test reports its own result. Parity problems do not raise inside the
ranks: they are returned and asserted here, with every rank's messages.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import math
from typing import Callable, Dict, List

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                         checkpoint_wrapper)
from torch.utils.checkpoint import checkpoint

from fsdp_compose import (FSDPModule, comm_stats, fully_shard, param_info, record_schedule,
                          register_fsdp_forward_method, reset_comm_stats)

from ._pieces import expected_shape
from . import _support
from ._support import Block, Scenarios, compare_with_reference, per_unit_collectives, shard
from ._support import schedule_text as _fmt

WORLD_SIZES = (2, 4)
GLOBAL_BATCH = 8  # divisible by every world size
STEPS = 3
RTOL = 1e-5
ATOL = 1e-5
HAS_HF = importlib.util.find_spec("transformers") is not None


# ==========================================================================
# Models
# ==========================================================================


def _pair(x, a, b):
    return b(a(x))


class Net(_support.Net):
    """``inp`` and ``out`` stay in the root unit; each block is a unit.
    ``inner`` checkpoints each block's MLP inside its forward (AC inside a
    unit); ``region`` checkpoints pairs of blocks (a region of two units)."""

    def __init__(self, n: int = 4, d: int = 6, inner: str | None = None,
                 region: str | None = None):
        super().__init__(n, d, inner=inner)
        self.region = region

    def forward(self, x):
        h = self.inp(x)
        if self.region is None:
            for layer in self.layers:
                h = layer(h)
        else:
            for i in range(0, len(self.layers), 2):
                h = checkpoint(_pair, h, self.layers[i], self.layers[i + 1],
                               use_reentrant=self.region == "reentrant")
        return self.out(h)


class TwiceNet(Net):
    """``layers.0`` runs twice in one forward."""

    def forward(self, x):
        h = self.layers[0](self.inp(x))
        h = self.layers[0](torch.tanh(h))
        for layer in self.layers[1:]:
            h = layer(h)
        return self.out(h)


class GenNet(nn.Module):
    """A model with a ``generate`` that uses the root's parameters directly."""

    def __init__(self, n: int = 2, d: int = 6, io: int = 4):
        super().__init__()
        self.inp = nn.Linear(io, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, io)

    def body(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return h

    def forward(self, x):
        return self.head(self.body(x))

    def generate(self, x, steps: int):
        outs = []
        for _ in range(steps):
            # head.weight / head.bias used without going through head.forward
            x = torch.tanh(self.body(x) @ self.head.weight.T + self.head.bias)
            outs.append(x)
        outs.append(self(x))  # a forward nested inside the registered method
        return torch.stack(outs)


# Activation-checkpointing variants of Net.
AC_MODES = (
    "none",
    "inside_fn_nonreentrant",       # checkpoint(self._mlp) inside Block.forward
    "inside_fn_reentrant",
    "inside_wrapper",               # fully_shard(checkpoint_wrapper(block))
    "around_wrapper_nonreentrant",  # checkpoint_wrapper(fully_shard(block))
    "around_wrapper_reentrant",
    "around2_nonreentrant",         # checkpoint(b1(b0(x))): a region of two units
    "around2_reentrant",
)


def build_ac(mode: str, raf: bool | None, n: int = 4, cls=Net, per_unit: bool = True):
    """(sharded model, unsharded reference) with the same parameters; one
    collective per unit (``per_unit``), or the default buckets."""
    torch.manual_seed(0)
    inner = mode[len("inside_fn_"):] if mode.startswith("inside_fn_") else None
    region = mode[len("around2_"):] if mode.startswith("around2_") else None
    model = cls(n=n, inner=inner, region=region)
    if mode == "inside_wrapper":
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    ref = copy.deepcopy(model)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=raf)
    if mode.startswith("around_wrapper_"):
        impl = (CheckpointImpl.REENTRANT if mode.endswith("_reentrant")
                else CheckpointImpl.NO_REENTRANT)
        for mm in (model, ref):
            for i, layer in enumerate(mm.layers):
                mm.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=impl)
    fully_shard(model)
    if per_unit:
        per_unit_collectives(model)
    return model, ref


def n_units(model: nn.Module) -> int:
    """fully_shard units below ``model`` (no list units in this file)."""
    return sum(isinstance(m, FSDPModule) for m in model.modules())


def expected_all_gathers(model: nn.Module, raf: bool | None) -> int:
    """All-gathers of one training step of ``model`` (the root, sharded with
    the default reshard_after_forward=None, i.e. False for the root; every
    other unit with ``raf``): every unit gathers once in forward; in backward,
    every unit that resharded after forward gathers again."""
    units = n_units(model)
    return units + (units - 1 if raf in (True, None) else 0)


# ==========================================================================
# Per-rank helpers: data, comparisons, a step-by-step parity driver
# ==========================================================================


def regression_data(step: int, din: int = 3, dout: int = 1):
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(GLOBAL_BATCH, din, generator=g),
            torch.randn(GLOBAL_BATCH, dout, generator=g))


def local(t: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
    return t.chunk(ws)[rank]


def mse(model, batch):
    x, y = batch
    return [F.mse_loss(model(x), y)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _diff(tag: str, ours: torch.Tensor, exp: torch.Tensor, rtol=RTOL, atol=ATOL) -> List[str]:
    if ours.shape != exp.shape or ours.dtype != exp.dtype:
        return [f"{tag}: got {tuple(ours.shape)} {ours.dtype}, expected "
                f"{tuple(exp.shape)} {exp.dtype}"]
    if torch.allclose(ours, exp, rtol=rtol, atol=atol):
        return []
    d = (ours.double() - exp.double()).abs()
    i = int(d.argmax())
    return [f"{tag}: max abs diff {d.max().item():.3e} at {i} (got "
            f"{ours.reshape(-1)[i].item():.8g}, expected {exp.reshape(-1)[i].item():.8g})"]


def all_sharded(model: nn.Module) -> List[str]:
    # this rank's rows, held as the sharded Parameter's local tensor (a RowParam
    # DTensor of the global shape where the parameter is split over ranks)
    bad = [n for n, p in model.named_parameters()
           if tuple(_support.rows(p).shape)
           != expected_shape(param_info(p).shape, param_info(p).local_range)
           or tuple(p.shape) not in {tuple(param_info(p).shape), tuple(_support.rows(p).shape)}]
    return [f"not sharded (row pieces) again: {bad}"] if bad else []


def compare_params(model, ref, tag: str, grads: bool, atol=ATOL) -> List[str]:
    """The gradients (``grads``) or else the parameters against the reference's pieces."""
    return compare_with_reference(model, ref, tag, grads=grads, params=not grads, rtol=RTOL,
                                  atol=atol)


def rank_mean(x: torch.Tensor, ws: int) -> float:
    t = x.detach().double().reshape(1).clone()
    dist.all_reduce(t)
    return t.item() / ws


class Parity:
    """Runs training steps on the sharded model and the reference, collecting
    problems (never raising) and the collective counts of each step."""

    def __init__(self, rank, ws, model, ref, *, opt=sgd, data=regression_data, loss=mse,
                 ctx: Callable = contextlib.nullcontext, tag: str = "", param_atol=ATOL):
        self.rank, self.ws, self.model, self.ref = rank, ws, model, ref
        self.opt = opt([p for p in model.parameters() if p.requires_grad])
        self.ref_opt = opt([p for p in ref.parameters() if p.requires_grad])
        self.data, self.loss, self.ctx, self.tag = data, loss, ctx, tag
        self.param_atol = param_atol
        self.problems: List[str] = []
        self.counts: List[tuple] = []  # (all_gather, reduce_scatter) per step
        self.losses: List[float] = []

    @staticmethod
    def _backward(losses):
        for i, loss in enumerate(losses):
            loss.backward(retain_graph=i < len(losses) - 1)

    def step(self, step: int, after_backward: Callable | None = None) -> None:
        batch = self.data(step)
        mine = tuple(local(t, self.rank, self.ws) for t in batch)
        tag = f"{self.tag} step {step}"
        reset_comm_stats()
        with self.ctx():
            losses = self.loss(self.model, mine)
            self._backward(losses)
        s = comm_stats()
        self.counts.append((s.all_gather_calls, s.reduce_scatter_calls))
        ref_losses = self.loss(self.ref, batch)
        self._backward(ref_losses)
        if after_backward is not None:  # gradients are set, the optimizer has not run
            after_backward()
        for i, (lo, rl) in enumerate(zip(losses, ref_losses)):
            got = rank_mean(lo, self.ws)
            if not math.isclose(got, rl.item(), rel_tol=RTOL, abs_tol=1e-7):
                self.problems.append(f"{tag} loss[{i}]: got {got!r}, reference {rl.item()!r}")
        self.losses.append(ref_losses[0].item())
        self.problems += compare_params(self.model, self.ref, tag, grads=True)
        self.opt.step()
        self.ref_opt.step()
        self.problems += compare_params(self.model, self.ref, tag, grads=False,
                                        atol=self.param_atol)
        self.opt.zero_grad()
        self.ref_opt.zero_grad()

    def run(self, steps: int = STEPS) -> "Parity":
        for i in range(steps):
            self.step(i)
        return self

    def result(self, **extra) -> dict:
        return dict(problems=self.problems, counts=self.counts, **extra)


# ==========================================================================
# Cases: name -> fn(rank, ws) -> picklable dict with at least "problems"
# ==========================================================================

CASES: Dict[str, Callable] = {}
WS_OF: Dict[str, tuple] = {}


def case(name: str, fn: Callable, world_sizes=WORLD_SIZES, **kw) -> None:
    CASES[name] = functools.partial(fn, **kw) if kw else fn
    WS_OF[name] = world_sizes


# 1. Activation checkpointing ------------------------------------------------
def _ac(rank, ws, mode, raf, per_unit=True):
    model, ref = build_ac(mode, raf, per_unit=per_unit)
    p = Parity(rank, ws, model, ref, tag=f"{mode} raf={raf}").run()
    return p.result(expected_all_gathers=expected_all_gathers(model, raf), units=n_units(model))


for _mode in AC_MODES:
    for _raf in (True, False):
        case(f"ac/{_mode}/raf={_raf}", _ac, mode=_mode, raf=_raf)
        case(f"ac_bucketed/{_mode}/raf={_raf}", _ac, mode=_mode, raf=_raf, per_unit=False)


# 2. The recompute schedule (world size 2) -----------------------------------
def _schedule(rank, ws):
    out = {"problems": []}
    for mode in ("none", "inside_fn_nonreentrant", "inside_wrapper", "around2_nonreentrant",
                 "around2_reentrant", "around_wrapper_nonreentrant"):
        model, _ = build_ac(mode, True, n=2)
        x = torch.randn(2, 3)
        model(x).sum().backward()  # first step: lazy init, order recording
        with record_schedule() as ev:
            model(x).sum().backward()
        out[mode] = list(ev)
    return out


case("schedule", _schedule, world_sizes=(2,))


# 3. save_on_cpu and user saved-tensor hooks ---------------------------------
def _clone_hooks():
    packed = []

    def pack(t):
        packed.append(1)
        return t.clone()

    def unpack(t):
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack), packed


def _saved(rank, ws, kind, mode, raf):
    model, ref = build_ac(mode, raf)
    counter: list = []
    if kind == "save_on_cpu":
        ctx = functools.partial(torch.autograd.graph.save_on_cpu, pin_memory=False)
    else:
        def ctx():
            hooks, packed = _clone_hooks()
            counter.append(packed)
            return hooks
    p = Parity(rank, ws, model, ref, ctx=ctx, tag=f"{kind} {mode}").run()
    return p.result(packed=[len(c) for c in counter],
                    expected_all_gathers=expected_all_gathers(model, raf))


for _kind in ("save_on_cpu", "pack_clone"):
    case(f"saved/{_kind}/none/raf=True", _saved, kind=_kind, mode="none", raf=True)
    case(f"saved/{_kind}/none/raf=False", _saved, kind=_kind, mode="none", raf=False)
    case(f"saved/{_kind}/around2_nonreentrant/raf=True", _saved, kind=_kind,
         mode="around2_nonreentrant", raf=True)


# 4. ModTracker ---------------------------------------------------------------
def _track(model, fn):
    from torch.distributed._tools.mod_tracker import ModTracker

    names = {id(m): n or "<root>" for n, m in model.named_modules()}
    ev = []

    def name(m):
        return names.get(id(m), type(m).__name__) if m is not None else None

    tracker = ModTracker()
    tracker.register_user_hooks(
        lambda m, i: ev.append(("pre_fw", name(m))),
        lambda m, i, o: ev.append(("post_fw", name(m))),
        lambda m, g: ev.append(("pre_bw", name(m))),
        lambda m, g: ev.append(("post_bw", name(m))),
    )
    with tracker:
        fn()
    return ev


def _modtracker(rank, ws, mode, raf):
    model, ref = build_ac(mode, raf, n=2, per_unit=False)  # (no counts asserted)
    p = Parity(rank, ws, model, ref, tag=f"modtracker {mode}")
    orders = []
    for step in range(2):
        batch = regression_data(step)
        mine = tuple(local(t, rank, ws) for t in batch)
        ours = _track(model, lambda: mse(model, mine)[0].backward())
        theirs = _track(ref, lambda: mse(ref, batch)[0].backward())
        if ours != theirs:
            p.problems.append(f"step {step}: ModTracker order differs:\nsharded   {ours}\n"
                              f"reference {theirs}")
        orders.append(ours)
        p.problems += compare_params(model, ref, f"modtracker step {step}", grads=True)
        for o in (p.opt, p.ref_opt):
            o.step()
            o.zero_grad()
    return p.result(orders=orders)


for _mode, _raf in (("none", True), ("none", False), ("around2_nonreentrant", True)):
    case(f"modtracker/{_mode}/raf={_raf}", _modtracker, mode=_mode, raf=_raf)


# 5. register_fsdp_forward_method and direct calls of an inner unit ----------
def _gen_data(step):
    return regression_data(step, din=4, dout=4)


def _generate(rank, ws):
    torch.manual_seed(0)
    model = GenNet()
    ref = copy.deepcopy(model)
    per_unit_collectives(shard(model))
    register_fsdp_forward_method(model, "generate")
    p = Parity(rank, ws, model, ref, data=_gen_data, tag="generate")
    counts = {}
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(7))

    def gen(tag):
        reset_comm_stats()
        with torch.no_grad():
            ours = model.generate(x, 3)
        counts[tag] = comm_stats().all_gather_calls
        with torch.no_grad():
            exp = ref.generate(x, 3)
        p.problems.extend(_diff(f"generate {tag}", ours, exp))
        p.problems.extend(f"after generate {tag}: {m}" for m in all_sharded(model))

    gen("before training")  # the first call: lazy init through the method
    p.step(0)
    gen("after step 0")     # must see the updated parameters
    h = torch.randn(5, 6, generator=torch.Generator().manual_seed(8))
    model.eval()
    ref.eval()
    reset_comm_stats()
    with torch.no_grad():
        ours = model.layers[1](h)
    counts["direct layers.1"] = comm_stats().all_gather_calls
    with torch.no_grad():
        exp = ref.layers[1](h)
    model.train()
    ref.train()
    p.problems += _diff("direct call of layers.1 (eval, no_grad)", ours, exp)
    p.problems += [f"after the direct call: {m}" for m in all_sharded(model)]
    p.step(1)
    gen("after step 1")
    p.step(2)
    return p.result(gen_counts=counts)


case("generate", _generate)


def _direct_call_first(rank, ws):
    """An inner unit called (eval, no_grad) before the root ever ran."""
    torch.manual_seed(0)
    model = GenNet()
    ref = copy.deepcopy(model)
    shard(model)
    p = Parity(rank, ws, model, ref, data=_gen_data, tag="direct call first")
    h = torch.randn(5, 6, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        p.problems += _diff("layers.0 before any root forward", model.layers[0](h),
                            ref.layers[0](h))
    p.problems += all_sharded(model)
    return p.run().result()


case("direct_call_first", _direct_call_first)


# 6. Several forwards per backward, and several backwards per forward --------
def dpo(model, batch):
    x, _ = batch
    chosen = model(x).squeeze(-1)
    rejected = model(x.flip(-1) * 0.5).squeeze(-1)  # a second root forward, same graph
    return [-F.logsigmoid(chosen - rejected).mean()]


def two_losses(model, batch):
    x, y = batch
    out = model(x)
    return [F.mse_loss(out, y), out.abs().mean()]  # backward twice, retain_graph


def _multi(rank, ws, kind, mode, raf, per_unit=True):
    cls = TwiceNet if kind == "unit_twice" else Net
    model, ref = build_ac(mode, raf, cls=cls, per_unit=per_unit)
    loss = {"dpo": dpo, "unit_twice": mse, "two_backwards": two_losses}[kind]
    p = Parity(rank, ws, model, ref, loss=loss, opt=adamw if raf else sgd,
               tag=f"{kind} {mode} raf={raf}").run()
    return p.result()


# A reentrant checkpoint INSIDE a unit gets one nested backward per use; the
# unit must stay gathered until the last one (it was resharded after the first).
MULTI_CASES = [(kind, "none", raf) for kind in ("dpo", "unit_twice", "two_backwards")
               for raf in (True, False)] + [
    ("dpo", "inside_fn_nonreentrant", True),
    ("dpo", "inside_wrapper", False),
    ("dpo", "around2_nonreentrant", True),
    ("dpo", "around2_reentrant", True),
    ("unit_twice", "inside_fn_nonreentrant", False),
    ("unit_twice", "around_wrapper_reentrant", True),
    ("two_backwards", "around2_nonreentrant", True),
    ("two_backwards", "around2_reentrant", False),
    ("two_backwards", "inside_fn_reentrant", True),
]
MULTI_CASES += [("dpo", "inside_fn_reentrant", True), ("unit_twice", "inside_fn_reentrant", False)]
for _kind, _mode, _raf in MULTI_CASES:
    case(f"multi/{_kind}/{_mode}/raf={_raf}", _multi, kind=_kind, mode=_mode, raf=_raf)
    if _mode == "none":
        case(f"multi_bucketed/{_kind}/{_mode}/raf={_raf}", _multi, kind=_kind, mode=_mode,
             raf=_raf, per_unit=False)


# 7. HF transformers models ----------------------------------------------------
HF_VOCAB = 64


def build_hf(kind: str):
    import transformers

    transformers.logging.set_verbosity_error()
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=HF_VOCAB, n_positions=32, n_embd=32, n_layer=3,
                                      n_head=4, attn_pdrop=0.0, embd_pdrop=0.0,
                                      resid_pdrop=0.0, use_cache=False)
        model = transformers.GPT2LMHeadModel(cfg)
        return model, model.transformer.h
    cfg = transformers.LlamaConfig(vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=True, use_cache=False)
    model = transformers.LlamaForCausalLM(cfg)
    return model, model.model.layers


def hf_data(step):
    g = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, HF_VOCAB, (GLOBAL_BATCH, 16), generator=g)
    return (ids,)


def hf_adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-6)


def hf_loss(model, batch):
    (ids,) = batch
    return [model(input_ids=ids, labels=ids).loss]


def hf_dpo_loss(model, batch):
    """DPO-style: two forwards (chosen / rejected), one backward; per-sequence
    log-likelihoods, so the loss is a mean over samples like the others."""
    (ids,) = batch

    def logp(t):
        logits = model(input_ids=t).logits[:, :-1]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t[:, 1:].reshape(-1),
                              reduction="none")
        return -nll.view(t.shape[0], -1).mean(-1)

    return [-F.logsigmoid(logp(ids) - logp(ids.flip(-1))).mean()]


def _hf(rank, ws, kind, ac, dpo=False):
    torch.manual_seed(0)
    model, layers = build_hf(kind)
    problems = []
    if model.lm_head.weight is not model.get_input_embeddings().weight:
        problems.append("test bug: embeddings are not tied")
    if ac is not None:
        # HF's own activation checkpointing (named gradient_checkpointing_enable
        # before transformers 5.x deprecated it)
        kwargs = {"use_reentrant": True} if ac == "reentrant" else None
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    ref = copy.deepcopy(model)
    for layer in layers:
        fully_shard(layer)
    per_unit_collectives(fully_shard(model))
    if model.lm_head.weight is not model.get_input_embeddings().weight:
        problems.append("fully_shard untied lm_head.weight from the input embedding")
    # AdamW's first steps are ~lr * sign(grad): float noise in near-zero
    # gradients moves parameters by up to lr * noise / eps. eps=1e-6 bounds
    # that; parameters are compared at 1e-4 (1% of lr), gradients at 1e-5.
    p = Parity(rank, ws, model, ref, opt=hf_adamw, data=hf_data,
               loss=hf_dpo_loss if dpo else hf_loss,
               tag=f"{kind} ac={ac}", param_atol=1e-4)
    p.problems += problems
    p.run()
    return p.result(expected_all_gathers=expected_all_gathers(model, None),
                    units=n_units(model), n_layers=len(layers))


HF_CASES = [("gpt2", None), ("gpt2", "default"), ("llama", None), ("llama", "default"),
            ("llama", "reentrant")]
for _kind, _ac in HF_CASES:
    case(f"hf/{_kind}/ac={_ac}", _hf, kind=_kind, ac=_ac)
HF_DPO_CASES = [None, "default", "reentrant"]  # HF checkpoints each layer INSIDE the unit
for _ac in HF_DPO_CASES:
    case(f"hf_dpo/llama/ac={_ac}", _hf, kind="llama", ac=_ac, dpo=True)


# 8. torch.autograd.grad w.r.t. an input ----------------------------------------
def _input_grad(rank, ws, raf):
    model, ref = build_ac("none", raf)
    p = Parity(rank, ws, model, ref, tag=f"input grad raf={raf}")
    counts = {}

    def probe(tag):
        before = {n: None if q.grad is None else q.grad.clone()
                  for n, q in model.named_parameters()}
        x, _ = regression_data(50)
        xl = local(x, rank, ws).clone().requires_grad_(True)
        xr = xl.detach().clone().requires_grad_(True)
        reset_comm_stats()
        (gx,) = torch.autograd.grad(model(xl).pow(2).mean(), xl)
        s = comm_stats()
        counts[tag] = (s.all_gather_calls, s.reduce_scatter_calls)
        (gr,) = torch.autograd.grad(ref(xr).pow(2).mean(), xr)
        p.problems.extend(_diff(f"autograd.grad {tag}", gx, gr))
        touched = [n for n, q in model.named_parameters()
                   if (q.grad is None) != (before[n] is None)
                   or (q.grad is not None and not torch.equal(q.grad, before[n]))]
        if touched:
            p.problems.append(f"autograd.grad {tag} changed p.grad of {touched}")
        p.problems.extend(f"after autograd.grad {tag}: {m}" for m in all_sharded(model))

    probe("before training")      # p.grad None; lazy init through autograd.grad
    p.step(0)
    probe("after step 0")         # p.grad None again (zero_grad)
    # between backward and optimizer.step: p.grad set and must stay as it is
    p.step(1, after_backward=lambda: probe("with p.grad set"))
    p.step(2)
    return p.result(grad_counts=counts, expected_all_gathers=expected_all_gathers(model, raf))


for _raf in (True, False):
    case(f"input_grad/raf={_raf}", _input_grad, raf=_raf)


# ==========================================================================
# Launching: every case of one world size in one launch
# ==========================================================================


def _run_one(name, rank, ws):
    return CASES[name](rank, ws)


def _import_hf() -> None:
    if HAS_HF:
        importlib.import_module("transformers")  # once here, inherited by forked ranks


def _wants(item) -> List[tuple]:
    """The cases a test below asks for, as (world size, name): a launch runs
    the cases of the selected tests (every case when the whole file runs)."""
    if item.cls is not None and item.cls.__name__ == "TestRecomputeSchedule":
        return [(2, "schedule")]
    p = item.callspec.params
    fn = item.originalname
    if fn == "test_activation_checkpointing":  # and its baseline without AC
        names = [p["name"], f"ac/none/raf={p['name'].endswith('raf=True')}"]
    elif "name" in p:
        names = [p["name"]]
    else:
        names = [{"test_register_fsdp_forward_method": "generate",
                  "test_inner_unit_called_before_root": "direct_call_first",
                  "test_multiple_forwards_and_backwards": "multi/{kind}/{mode}/raf={raf}",
                  "test_hf_models": "hf/{kind}/ac={ac}",
                  "test_hf_llama_dpo_two_forwards": "hf_dpo/llama/ac={ac}",
                  "test_autograd_grad_wrt_input": "input_grad/raf={raf}"}[fn].format(**p)]
    return [(p["ws"], n) for n in names]


_LAUNCHES = Scenarios(_run_one, timeout=lambda n: 90 + 10 * n, before_launch=_import_hf,
                      wants=_wants)


def results(ws: int, name: str) -> list:
    """Per-rank results of one case (its launch runs once per world size)."""
    names = [n for n in CASES if ws in WS_OF[n] and (HAS_HF or not n.startswith("hf/"))]
    return _LAUNCHES.results(ws, name, names)


def assert_no_problems(per_rank: list) -> None:
    lines = [f"rank {r}: {msg}" for r, res in enumerate(per_rank) for msg in res["problems"][:10]]
    assert not lines, "\n".join(lines)


def _cases(prefix: str) -> List[str]:
    return [n for n in CASES if n.startswith(prefix)]


# ==========================================================================
# Tests
# ==========================================================================

ws_param = pytest.mark.parametrize("ws", WORLD_SIZES)

# A reentrant checkpoint around units is a checkpoint region of the slot rule
# (docs/design.md "Collective order"): their reduce-scatters wait for the
# region's recomputation, so each unit reduces once per backward (it used to
# be zero-filled first and reduced again from the nested backward: one extra
# reduce-scatter per backward at 2+ ranks).


@ws_param
@pytest.mark.parametrize("name", _cases("ac/"))
def test_activation_checkpointing(ws, name):
    per_rank = results(ws, name)
    assert_no_problems(per_rank)
    raf = name.endswith("raf=True")
    base = results(ws, f"ac/none/raf={raf}")
    for r, res in enumerate(per_rank):
        units = res["units"]
        assert units == 5, res  # 4 blocks + root
        # forward: every unit; backward (reshard_after_forward=True): every non-root unit again
        assert [c[0] for c in res["counts"]] == [res["expected_all_gathers"]] * STEPS, res["counts"]
        assert [c[1] for c in res["counts"]] == [units] * STEPS, res["counts"]
        # AC costs no extra all-gather vs the same configuration without AC
        assert [c[0] for c in res["counts"]] == [c[0] for c in base[r]["counts"]]


# Reentrant checkpoints AROUND units run those units' forwards without grad;
# the units still join the backward's gather and reduce orders at the place of
# their forward (see [Note: collective order] in _backward_plan.py), so in backward
# they are gathered and reduce-scattered in buckets like the others.
def _bucketed_ac_params():
    return [pytest.param(n, id=n) for n in _cases("ac_bucketed/")]


@ws_param
@pytest.mark.parametrize("name", _cases("ac_bucketed/"))
def test_activation_checkpointing_bucketed(ws, name):
    """AC with the default buckets: the same numbers as the reference."""
    assert_no_problems(results(ws, name))


@ws_param
@pytest.mark.parametrize("name", _bucketed_ac_params())
def test_activation_checkpointing_costs_no_extra_bucket(ws, name):
    # Default 1 MiB buckets, 5 units of about 3 KiB: the first step's forward
    # gathers per unit (no recorded order yet), then a forward gathers all 5
    # as one bucket; a backward gathers the blocks it needs (all 4 if they
    # resharded after forward) as one bucket and reduce-scatters one bucket.
    # AC (recomputing inside backward) must not add a collective.
    raf = name.endswith("raf=True")
    want = [(5 + 1, 1)] + [(1 + 1, 1)] * (STEPS - 1) if raf else [(5, 1)] + [(1, 1)] * (STEPS - 1)
    for res in results(ws, name):
        assert res["counts"] == want, res["counts"]


@ws_param
@pytest.mark.parametrize("name", _cases("saved/"))
def test_saved_tensor_hooks(ws, name):
    per_rank = results(ws, name)
    assert_no_problems(per_rank)
    for res in per_rank:
        assert [c[0] for c in res["counts"]] == [res["expected_all_gathers"]] * STEPS
        if "pack_clone" in name:
            assert all(n > 0 for n in res["packed"]), res["packed"]  # the hooks did run


@ws_param
@pytest.mark.parametrize("name", _cases("modtracker/"))
def test_mod_tracker_order(ws, name):
    per_rank = results(ws, name)
    assert_no_problems(per_rank)
    for res in per_rank:
        for order in res["orders"]:
            kinds = {e[0] for e in order}
            assert kinds == {"pre_fw", "post_fw", "pre_bw", "post_bw"}, order
            # every block's forward and backward were seen
            for unit in ("layers.0", "layers.1"):
                assert ("pre_bw", unit) in order and ("post_bw", unit) in order, order


@ws_param
def test_register_fsdp_forward_method(ws):
    per_rank = results(ws, "generate")
    assert_no_problems(per_rank)
    # generate(x, 3): the root once; each of the 2 blocks per body() call (3 + 1)
    for res in per_rank:
        assert res["gen_counts"] == {"before training": 1 + 2 * 4, "after step 0": 1 + 2 * 4,
                                     "after step 1": 1 + 2 * 4, "direct layers.1": 1}
        assert [c[0] for c in res["counts"]] == [3 + 2] * STEPS  # 2 blocks + root; 2 regathered


@ws_param
def test_inner_unit_called_before_root(ws):
    assert_no_problems(results(ws, "direct_call_first"))


def _multi_params():
    return [pytest.param(*c, id="/".join(map(str, c))) for c in MULTI_CASES]


@ws_param
@pytest.mark.parametrize("kind,mode,raf", _multi_params())
def test_multiple_forwards_and_backwards(ws, kind, mode, raf):
    per_rank = results(ws, f"multi/{kind}/{mode}/raf={raf}")
    assert_no_problems(per_rank)
    units, blocks = 5, 4  # root (keeps its parameters: raf None) + 4 blocks
    regather = blocks if raf else 0  # blocks resharded after each forward
    expected = {
        # two root forwards: the second regathers what the first resharded;
        # ONE backward: blocks regathered once; ONE reduce-scatter per unit
        "dpo": (units + regather + regather, units),
        # layers.0's second call regathers it if it was resharded
        "unit_twice": (units + int(raf) + regather, units),
        # each backward of the retained graph re-gathers what is resharded
        # (everything, after the first backward) and re-reduces every unit
        "two_backwards": (units + regather + units, 2 * units),
    }[kind]
    for res in per_rank:
        assert res["counts"] == [expected] * STEPS, res["counts"]


@ws_param
@pytest.mark.parametrize("name", _cases("multi_bucketed/"))
def test_multiple_forwards_and_backwards_bucketed(ws, name):
    per_rank = results(ws, name)
    assert_no_problems(per_rank)
    # default buckets, the whole model in one: one reduce-scatter per backward
    backwards = 2 if "/two_backwards/" in name else 1
    for res in per_rank:
        assert [c[1] for c in res["counts"]] == [backwards] * STEPS, res["counts"]


@ws_param
@pytest.mark.parametrize("kind,ac", HF_CASES)
def test_hf_models(ws, kind, ac):
    pytest.importorskip("transformers")
    per_rank = results(ws, f"hf/{kind}/ac={ac}")
    assert_no_problems(per_rank)
    for res in per_rank:
        assert res["units"] == res["n_layers"] + 1
        # forward: every layer + root; backward: every layer again
        assert res["expected_all_gathers"] == 2 * res["n_layers"] + 1
        assert [c[0] for c in res["counts"]] == [res["expected_all_gathers"]] * STEPS
        assert [c[1] for c in res["counts"]] == [res["units"]] * STEPS


@ws_param
@pytest.mark.parametrize("ac", HF_DPO_CASES)
def test_hf_llama_dpo_two_forwards(ws, ac):
    pytest.importorskip("transformers")
    per_rank = results(ws, f"hf_dpo/llama/ac={ac}")
    assert_no_problems(per_rank)
    for res in per_rank:
        n = res["n_layers"]
        # two forwards: layers gather twice, the root once; backward: layers again
        assert [c[0] for c in res["counts"]] == [3 * n + 1] * STEPS, res["counts"]
        assert [c[1] for c in res["counts"]] == [res["units"]] * STEPS, res["counts"]


@ws_param
@pytest.mark.parametrize("raf", [True, False])
def test_autograd_grad_wrt_input(ws, raf):
    per_rank = results(ws, f"input_grad/raf={raf}")
    assert_no_problems(per_rank)
    for res in per_rank:
        for tag, (ag, rs) in res["grad_counts"].items():
            assert rs == 0, (tag, res["grad_counts"])  # no gradient reduced
            assert ag == res["expected_all_gathers"], (tag, res["grad_counts"])
        assert [c[0] for c in res["counts"]] == [res["expected_all_gathers"]] * STEPS


# --------------------------------------------------------------------- schedule
def _check_recompute(events) -> List[str]:
    """From a unit's recompute (and the all-gathers that recompute itself
    issued, if the unit was sharded) until its gradients are computed (its
    early reshard on gloo, else its post_backward): no reshard of that unit
    and no further all-gather of it (it stays unsharded)."""
    problems = []
    for i, (ev, unit, _) in enumerate(events):
        if ev != "pre_forward_recompute":
            continue
        end = next((j for j in range(i, len(events))
                    if events[j][:2] == ("post_backward", unit)
                    or events[j] == ("reshard", unit, "grads computed")), None)
        if end is None:
            problems.append(f"{unit}: no post_backward after its recompute")
            continue
        start = i + 1
        while start < end and events[start][0] == "all_gather":
            start += 1  # issued by this recompute's pre-forward
        for ev2, unit2, _ in events[start:end]:
            if unit2 == unit and ev2 in ("reshard", "all_gather"):
                problems.append(f"{unit}: {ev2} between its recompute and its post_backward")
    return problems


class TestRecomputeSchedule(expecttest.TestCase):
    def setUp(self):
        (self.r0, self.r1) = results(2, "schedule")

    def test_same_on_every_rank(self):
        for k, v in self.r0.items():
            if k != "problems":
                self.assertEqual(v, self.r1[k], k)

    def test_ac_inside_a_unit_is_invisible(self):
        # the unit's hooks are outside the checkpoint: the same schedule as without AC
        self.assertEqual(_fmt(self.r0["inside_fn_nonreentrant"]), _fmt(self.r0["none"]))
        self.assertEqual(_fmt(self.r0["inside_wrapper"]), _fmt(self.r0["none"]))

    def test_no_reshard_between_recompute_and_post_backward(self):
        for mode in ("around2_nonreentrant", "around2_reentrant", "around_wrapper_nonreentrant"):
            ev = self.r0[mode]
            self.assertIn("pre_forward_recompute", [e[0] for e in ev], mode)
            self.assertEqual(_check_recompute(ev), [], mode)
            # AC costs no extra all-gather: 3 forward + 2 backward, as without AC
            n = sum(e[0] == "all_gather" for e in ev)
            self.assertEqual(n, sum(e[0] == "all_gather" for e in self.r0["none"]), mode)
            self.assertEqual(n, 5, mode)
            # in backward, a unit is gathered once at most: by its pre-backward or by
            # the recompute that needs it first, whichever comes first, never both
            start = next(i for i, e in enumerate(ev) if e[0] == "pre_backward")
            gathered = [e[1] for e in ev[start:] if e[0] == "all_gather"]
            self.assertEqual(len(gathered), len(set(gathered)), (mode, gathered))

    def test_around_two_units_nonreentrant(self):
        self.assertExpectedInline(_fmt(self.r0["around2_nonreentrant"]), """\
pre_forward IDLE
all_gather FORWARD
prefetch layers.0 forward
all_gather layers.0 IDLE
pre_forward layers.0 IDLE
prefetch layers.1 forward
all_gather layers.1 IDLE
post_forward layers.0 FORWARD
reshard layers.0 FORWARD
pre_forward layers.1 IDLE
post_forward layers.1 FORWARD
reshard layers.1 FORWARD
post_forward FORWARD
pre_backward IDLE
all_gather layers.1 IDLE
pre_backward layers.1 IDLE
pre_forward_recompute layers.0 IDLE
all_gather layers.0 IDLE
pre_forward_recompute layers.1 PRE_BACKWARD
reshard layers.1 grads computed
post_backward layers.1 PRE_BACKWARD
reduce_scatter layers.1 ready
pre_backward layers.0 IDLE
reshard layers.0 grads computed
post_backward layers.0 PRE_BACKWARD
reduce_scatter layers.0 ready
reshard grads computed
post_backward PRE_BACKWARD
reduce_scatter ready
final_callback""")

    def test_around_two_units_reentrant(self):
        self.assertExpectedInline(_fmt(self.r0["around2_reentrant"]), """\
pre_forward IDLE
all_gather FORWARD
prefetch layers.0 forward
all_gather layers.0 IDLE
pre_forward layers.0 IDLE
prefetch layers.1 forward
all_gather layers.1 IDLE
post_forward layers.0 FORWARD
reshard layers.0 FORWARD
pre_forward layers.1 IDLE
post_forward layers.1 FORWARD
reshard layers.1 FORWARD
post_forward FORWARD
pre_backward IDLE
all_gather layers.1 IDLE
pre_forward_recompute layers.0 IDLE
all_gather layers.0 IDLE
pre_forward_recompute layers.1 IDLE
post_backward layers.1 IDLE
reshard layers.1 POST_BACKWARD
reduce_scatter layers.1 ready
post_backward layers.0 IDLE
reshard layers.0 POST_BACKWARD
reduce_scatter layers.0 ready
reshard grads computed
post_backward PRE_BACKWARD
reduce_scatter ready
final_callback""")
