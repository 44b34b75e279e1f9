"""Parameters keep their shape: what optimizer code sees, against DDP.

One launch per world size (1, 2, 4) runs every scenario on a tiny language
model with what real optimizer code looks at: 2-D weights (embedding, head,
MLP matrices), a 3-D convolution weight, 1-D norms and biases, and a 0-d
learnable temperature. Each scenario trains ``fully_shard`` (row or tensor
granularity) next to ``DistributedDataParallel`` over a copy of the same
model, with the same optimizers built by the same code, and compares the
loss every step (relative 1e-5) and the parameters at the end:

* ``shapes``: every parameter keeps its ndim and trailing dims (a 0-d one is
  1-D, docs/design.md "Row-granular shards"); one split over ranks is, as
  under FSDP2, a ``Shard(0)`` DTensor of the global shape whose local tensor
  is this rank's rows; the ranks' rows tile dim 0, and ``param_info`` reports
  rows and per-rank bytes;
* ``ndim_groups``: AdamW with nanoGPT's grouping (weight decay only where
  ``p.ndim >= 2``), both granularities;
* ``muon``: ``torch.optim.Muon`` over the 2-D weights plus AdamW over the
  rest, tensor granularity: each matrix is orthogonalised on exactly one rank
  per step, and ``p.grad`` is set on every rank as under DDP (empty where a
  rank holds none of a parameter; Muon does not see those);
* ``adafactor``: ``torch.optim.Adafactor``, tensor granularity.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_compose import fully_shard, param_info
from fsdp_compose._base._registry import SHARDED as _SHARDED

from ._dist import run_distributed
from ._pieces import local_piece
from ._support import OnFirstUse, rows as local_rows

V, D, H, T, ROWS, STEPS = 17, 12, 20, 6, 8, 4
RTOL = 1e-5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.mix = nn.Conv1d(D, D, 3, padding=1, bias=False)   # a 3-D weight
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D, bias=False)

    def forward(self, h):                                   # (b, t, d)
        x = self.norm(h)
        x = x + self.mix(x.transpose(1, 2)).transpose(1, 2)
        return h + self.down(F.gelu(self.up(x)))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.temp = nn.Parameter(torch.tensor(1.0))          # 0-d

    def forward(self, tok):
        h = self.embed(tok)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h)) * self.temp


def shard(model: TinyLM, granularity: str) -> TinyLM:
    for b in model.blocks:
        fully_shard(b, shard_granularity=granularity)
    fully_shard(model, shard_granularity=granularity)
    return model


def batch(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(500 + step)
    tok = torch.randint(V, (ROWS, T), generator=g)
    tgt = torch.randint(V, (ROWS, T), generator=g)
    k = ROWS // world
    return tok[rank * k:(rank + 1) * k], tgt[rank * k:(rank + 1) * k]


def loss_of(model, tok, tgt):
    return F.cross_entropy(model(tok).reshape(-1, V), tgt.reshape(-1))


# ------------------------------------------------------------- optimizers
# The same code builds the optimizers of both models: it sees only parameters.
def ndim_adamw(params):
    params = list(params)
    return [torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2],
                                "weight_decay": 0.5},
                               {"params": [p for p in params if p.ndim < 2],
                                "weight_decay": 0.0}], lr=2e-2)]


def muon_adamw(params):
    params = list(params)
    return [torch.optim.Muon([p for p in params if p.ndim == 2], lr=2e-2, weight_decay=0.1),
            torch.optim.AdamW([p for p in params if p.ndim != 2], lr=2e-2, weight_decay=0.1)]


def adafactor(params):
    return [torch.optim.Adafactor(params, lr=2e-2, weight_decay=0.1)]


# ------------------------------------------------------------- rank bodies
def _shapes(granularity, rank, world) -> list[str]:
    torch.manual_seed(0)
    ref = TinyLM()
    model = shard(copy.deepcopy(ref), granularity)
    bad = []
    rows, infos = {}, {}
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        info = param_info(p)
        mine = local_rows(p)  # this rank's rows (a split parameter's local tensor)
        want_ndim = max(r.ndim, 1)  # a 0-d parameter's piece is 1-D
        for t, what in ((p, "parameter"), (mine, "rows")):
            if t.ndim != want_ndim or (r.ndim and t.shape[1:] != r.shape[1:]):
                bad.append(f"{name}: {what} {tuple(t.shape)} for {tuple(r.shape)}")
        if r.ndim and mine.shape[0] != info.rows[1] - info.rows[0]:
            bad.append(f"{name}: {mine.shape[0]} rows, param_info says {info.rows}")
        if not torch.equal(mine.detach(), local_piece(r, info.local_range)):
            bad.append(f"{name}: values are not rows {info.rows} of the original")
        if world > 1 and r.ndim:  # split over ranks: as under FSDP2, a DTensor of the
            # global shape, Shard(0), whose full tensor is the original
            if not isinstance(p, DTensor) or p.shape != r.shape \
                    or tuple(p.placements) != (Shard(0),):
                bad.append(f"{name}: {type(p).__name__} {tuple(p.shape)}, want a Shard(0) "
                           f"DTensor of {tuple(r.shape)}")
            elif not torch.equal(p.full_tensor(), r.detach()):
                bad.append(f"{name}: full_tensor() is not the original")
        if info.granularity != granularity:
            bad.append(f"{name}: granularity {info.granularity}")
        if len(info.rank_bytes) != world:
            bad.append(f"{name}: rank_bytes {info.rank_bytes} for {world} ranks")
        e = _SHARDED[p][1]  # the predicates the optimizer checks read
        n_rows = r.shape[0] if r.ndim else 1
        if e.holds_whole() != (world == 1 or info.rows == (0, n_rows)):
            bad.append(f"{name}: holds_whole() {e.holds_whole()} with rows {info.rows}")
        if e.is_empty() != (info.rows[0] == info.rows[1]):
            bad.append(f"{name}: is_empty() {e.is_empty()} with rows {info.rows}")
        rows[name] = info.rows
        infos[name] = info.rank_bytes
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, (rows, infos))
    else:
        every = [(rows, infos)]
    for name, r in ref.named_parameters():
        n = r.shape[0] if r.ndim else 1
        held = [e[0][name] for e in every if e[0][name][1] > e[0][name][0]]
        at = 0
        for a, b in held:  # the rows are tiled, in rank order
            if a != at:
                bad.append(f"{name}: rows {held} do not tile {n}")
            at = b
        if at != n:
            bad.append(f"{name}: rows {held} do not tile {n}")
        if granularity == "tensor" and len(held) != 1:
            bad.append(f"{name}: held by {len(held)} ranks in the tensor layout")
        if any(e[1][name] != every[0][1][name] for e in every):
            bad.append(f"{name}: ranks disagree on rank_bytes")
    # the per-rank bytes of one flat group add up to its parameters' bytes
    block = dict(model.blocks[0].named_parameters())
    got = sum(param_info(block["up.weight"]).rank_bytes)
    want = sum(r.numel() * 4 for r in ref.blocks[0].parameters())
    if got != want:
        bad.append(f"blocks.0 rank_bytes add up to {got}, parameters are {want} bytes")
    return bad


def _train(granularity, make_optims, rank, world, count_ns=False) -> list[str]:
    torch.manual_seed(0)
    base = TinyLM()
    ddp = DDP(copy.deepcopy(base))
    model = shard(copy.deepcopy(base), granularity)
    opts, ref_opts = make_optims(model.parameters()), make_optims(ddp.module.parameters())
    bad = []
    ns_calls = []
    real_ns = torch.optim._muon._zeropower_via_newtonschulz

    def counting_ns(grad, *a, **k):
        ns_calls.append(tuple(grad.shape))
        return real_ns(grad, *a, **k)

    for step in range(STEPS):
        tok, tgt = batch(step, rank, world)
        loss = loss_of(model, tok, tgt)
        loss.backward()
        ref_loss = loss_of(ddp, tok, tgt)
        ref_loss.backward()
        if abs(loss.item() - ref_loss.item()) > RTOL * abs(ref_loss.item()):
            bad.append(f"step {step}: loss {loss.item()!r}, DDP {ref_loss.item()!r}")
        for name, p in model.named_parameters():
            # as under DDP on every rank: set (empty where this rank holds no rows)
            if p.grad is None or p.grad.shape != p.shape \
                    or local_rows(p.grad).shape != local_rows(p).shape:
                bad.append(f"step {step} {name}: p.grad is "
                           f"{'None' if p.grad is None else tuple(local_rows(p.grad).shape)} "
                           f"with rows {param_info(p).rows}")
        torch.optim._muon._zeropower_via_newtonschulz = counting_ns
        try:
            for o in opts:
                o.step()
        finally:
            torch.optim._muon._zeropower_via_newtonschulz = real_ns
        for o in ref_opts:
            o.step()
        for o in opts + ref_opts:
            o.zero_grad()
    for (name, p), r in zip(model.named_parameters(), ddp.module.parameters()):
        want = local_piece(r, param_info(p).local_range)
        mine = local_rows(p).detach()
        if not torch.allclose(mine, want, rtol=1e-4, atol=1e-6):
            bad.append(f"{name}: {(mine - want).abs().max().item():.2e} from DDP at the end")
    if count_ns:
        if any(0 in shape for shape in ns_calls):
            bad.append(f"Newton-Schulz ran on an empty matrix: {ns_calls}")
        n = torch.tensor([len(ns_calls)])
        if world > 1:
            dist.all_reduce(n)
        n_matrices = sum(p.ndim == 2 for p in base.parameters())
        if n.item() != n_matrices * STEPS:
            bad.append(f"{n.item()} Newton-Schulz runs over all ranks in {STEPS} steps, want "
                       f"{n_matrices} matrices x {STEPS} (each on exactly one rank)")
    return bad


def _bad_granularity(rank, world) -> str:
    try:
        fully_shard(TinyLM(), shard_granularity="block")
    except ValueError as e:
        return str(e)
    return "no error"


def _all(rank, world) -> dict:
    out = {}
    for g in ("row", "tensor"):
        out[f"shapes_{g}"] = _shapes(g, rank, world)
        out[f"ndim_groups_{g}"] = _train(g, ndim_adamw, rank, world)
    out["muon"] = _train("tensor", muon_adamw, rank, world, count_ns=True)
    out["adafactor"] = _train("tensor", adafactor, rank, world)
    out["bad_granularity"] = _bad_granularity(rank, world)
    return out


@pytest.fixture(scope="module")
def runs():
    """world size (1, 2 or 4) -> per-rank results: one launch per world size a test uses."""
    return OnFirstUse(lambda ws: run_distributed(_all, ws))


SCENARIOS = ["shapes_row", "shapes_tensor", "ndim_groups_row", "ndim_groups_tensor", "muon",
             "adafactor"]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_against_ddp(runs, scenario, world):
    for rank, r in enumerate(runs[world]):
        assert r[scenario] == [], f"rank {rank}: {r[scenario]}"


def test_bad_granularity_is_a_clear_error(runs):
    msg = runs[2][1]["bad_granularity"]
    for needle in ("[rank 1]", "TinyLM", "shard_granularity", "'block'", '"tensor"'):
        assert needle in msg, msg
