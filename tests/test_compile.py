"""torch.compile on sharded models: graph breaks, recompiles, parity with DDP.

fully_shard's forward hooks all-gather and free parameters: they must run
eagerly, outside the compiled region ([Note: torch.compile] in
_fsdp_module.py). Each scenario trains a model 4 steps, compiled with
``backend="aot_eager"`` (dynamo and AOT autograd without inductor's C++
compile), and reads dynamo's counters:

* graph breaks: ``counters["graph_break"]``, summed;
* graphs: ``counters["stats"]["unique_graphs"]``;
* recompiles: ``counters["frames"]["total"]`` (frames dynamo converted; not
  counted under ``fullgraph=True``) and the graphs, after each step; no
  recompile after the second step means both stay put.

Bars: each block compiled (``block.compile()`` after fully_shard, also with
``fullgraph=True``; or torchtitan's recipe: non-reentrant activation
checkpointing, ``torch.compile(block, fullgraph=True)``, then fully_shard):
0 breaks, ONE graph for every block, no recompile after step 2.
``torch.compile(model)``: the demo Llama 0 breaks (as FSDP2); the HF Llama
no more breaks and graphs than FSDP2 compiled the same way, measured in the
same launch. Every scenario: losses and final parameters equal to DDP's
(eager, the same per-rank batches) at 1e-5. Remove the
``torch.compiler.disable`` from the hooks and the break bars fail (23 breaks
for the demo's blocks, 38 for its whole model).

Models: the demo Llama (fsdp_compose/demo/model.py) and, when transformers is
importable, a 2-layer HF ``LlamaForCausalLM``. One launch per world size
runs every scenario (fresh models, ``torch._dynamo.reset()`` between them).
"""
from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from ._pieces import piece_close
from ._support import Scenarios

HAS_HF = importlib.util.find_spec("transformers") is not None
STEPS = 4
VOCAB, SEQ, BATCH = 64, 16, 2
RTOL = ATOL = 1e-5


class Checkpointed(nn.Module):
    """Non-reentrant activation checkpointing around a block (what
    ``checkpoint_wrapper`` does), applied before compile and fully_shard."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def build(model: str):
    """(model, its list of blocks, loss function)."""
    torch.manual_seed(0)
    if model == "demo":
        from fsdp_compose.demo.model import ModelArgs, Transformer
        m = Transformer(ModelArgs(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4,
                                  max_seq_len=SEQ))
        return m, m.layers, lambda net, ids: net(ids).float().pow(2).mean()
    import transformers
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=True, use_cache=False)
    m = transformers.LlamaForCausalLM(cfg)
    return m, m.model.layers, lambda net, ids: net(input_ids=ids, labels=ids).loss


def train(impl: str, model: str, mode: str, rank: int, fullgraph: bool = False,
          ac: bool = False) -> dict:
    """Build, shard with ``impl`` (fsdp_compose or fsdp2), compile as ``mode``
    says, train STEPS steps next to an eager DDP reference; dynamo's counters."""
    from torch._dynamo.utils import counters

    from fsdp_compose import fully_shard, param_info

    net, blocks, loss_fn = build(model)
    if ac:
        for i in range(len(blocks)):
            blocks[i] = Checkpointed(blocks[i])
    ref = DDP(copy.deepcopy(net))
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    compile_kw = dict(backend="aot_eager", fullgraph=fullgraph)
    if mode == "blocks_before":  # torchtitan's recipe: AC, compile, then fully_shard
        for i in range(len(blocks)):
            blocks[i] = torch.compile(blocks[i], **compile_kw)  # an OptimizedModule
    for b in blocks:
        fully_shard(b)
    fully_shard(net)
    if mode == "blocks_after":
        for b in blocks:
            b.compile(**compile_kw)
    run = torch.compile(net, **compile_kw) if mode == "model" else net
    torch._dynamo.reset()
    counters.clear()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    losses, ref_losses, frames = [], [], []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        for m, o, out in ((run, opt, losses), (ref, ref_opt, ref_losses)):
            loss = loss_fn(m, ids)
            loss.backward()
            o.step()
            o.zero_grad()
            out.append(loss.item())
        frames.append((counters["frames"]["total"], counters["stats"]["unique_graphs"]))
    problems = []
    if impl == "fsdp_compose":
        full = dict(ref.module.named_parameters())
        for name, p in net.named_parameters():
            name = name.replace("_orig_mod.", "")  # torch.compile(block)'s wrapper
            info = param_info(p)
            if not piece_close(p.detach(), full[name], info.local_range, rtol=RTOL, atol=ATOL):
                problems.append(f"parameter {name} differs from DDP's after {STEPS} steps")
    return {"losses": losses, "ref_losses": ref_losses, "frames": frames, "problems": problems,
            "breaks": sum(counters["graph_break"].values()),
            "break_reasons": sorted(k.splitlines()[0] for k in counters["graph_break"]),
            "graphs": counters["stats"]["unique_graphs"]}


# name -> (world sizes, train() arguments after rank)
SCENARIOS = {
    "demo/blocks_after": ((1, 2), ("fsdp_compose", "demo", "blocks_after")),
    "demo/blocks_after_fullgraph": ((2,), ("fsdp_compose", "demo", "blocks_after", True)),
    "demo/ac_blocks_before": ((2,), ("fsdp_compose", "demo", "blocks_before", True, True)),
    "demo/model": ((1, 2), ("fsdp_compose", "demo", "model")),
    "hf/blocks_after": ((2,), ("fsdp_compose", "hf", "blocks_after")),
    "hf/model": ((1, 2), ("fsdp_compose", "hf", "model")),
    "hf/model_fsdp2": ((1, 2), ("fsdp2", "hf", "model")),
}


def _names(ws: int) -> list[str]:
    return [n for n, (sizes, _) in SCENARIOS.items()
            if ws in sizes and (HAS_HF or not n.startswith("hf/"))]


def _run_one(name: str, rank: int, ws: int) -> dict:
    args = SCENARIOS[name][1]
    return train(*args[:3], rank, *args[3:])


def _import_hf() -> None:
    if HAS_HF:
        importlib.import_module("transformers")  # once here, inherited by forked ranks


def _wants(item) -> list[tuple[int, str]]:
    """The scenarios a test asks for (a launch runs the selected tests')."""
    params = item.callspec.params
    if item.originalname == "test_compile_hf_model_vs_fsdp2":
        return [(params["ws"], "hf/model"), (params["ws"], "hf/model_fsdp2")]
    return [(params["ws"], params["name"])]


_LAUNCHES = Scenarios(_run_one, timeout=300, before_launch=_import_hf, wants=_wants)


def results(ws: int, name: str) -> list[dict]:
    """Per-rank results of one scenario (one launch per world size)."""
    return _LAUNCHES.results(ws, name, _names(ws))


def check_parity_and_recompiles(per_rank: list[dict]) -> None:
    for r, res in enumerate(per_rank):
        assert not res["problems"], f"rank {r}: {res['problems']}"
        assert res["losses"] == pytest.approx(res["ref_losses"], rel=RTOL, abs=ATOL), \
            f"rank {r}: losses {res['losses']} vs DDP {res['ref_losses']}"
        assert len(set(res["frames"][1:])) == 1, \
            (f"rank {r}: dynamo recompiled after the second step ((frames, graphs) per step "
             f"{res['frames']})")


def _cases(prefix: str, fsdp2: bool = False) -> list:
    return [pytest.param(ws, n, id=f"{n}-ws{ws}") for n, (sizes, args) in SCENARIOS.items()
            for ws in sizes if n.startswith(prefix) and (args[0] == "fsdp2") == fsdp2]


@pytest.mark.parametrize("ws,name", _cases("demo/") + _cases("hf/blocks"))
def test_compile(ws, name):
    if name.startswith("hf/") and not HAS_HF:
        pytest.skip("transformers is not importable")
    per_rank = results(ws, name)
    check_parity_and_recompiles(per_rank)
    for r, res in enumerate(per_rank):
        assert res["breaks"] == 0, f"rank {r}: {res['breaks']} graph breaks: {res['break_reasons']}"
        # one graph for all blocks (their forward), or, for the whole demo
        # model, also one for what the root runs around them (as FSDP2)
        want = 1 if "blocks" in name or ws == 1 else 2
        assert res["graphs"] == want, f"rank {r}: {res['graphs']} graphs, expected {want}"


@pytest.mark.skipif(not HAS_HF, reason="transformers is not importable")
@pytest.mark.parametrize("ws", (1, 2))
def test_compile_hf_model_vs_fsdp2(ws):
    """torch.compile(model) on an HF Llama: HF's own code breaks the graph
    (FSDP2 measures 2 breaks, 5 graphs at 2 ranks): ours must not add any."""
    ours, fsdp2 = results(ws, "hf/model"), results(ws, "hf/model_fsdp2")
    check_parity_and_recompiles(ours)
    for r, (a, b) in enumerate(zip(ours, fsdp2)):
        assert a["graphs"] > 0
        assert a["breaks"] <= b["breaks"] and a["graphs"] <= b["graphs"], (
            f"rank {r}: ours {a['breaks']} breaks / {a['graphs']} "
            f"graphs ({a['break_reasons']}), FSDP2 {b['breaks']} / "
            f"{b['graphs']} ({b['break_reasons']})")
