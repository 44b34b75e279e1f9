"""The ``make demo`` run, end to end, and its command line."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from fsdp_compose.cli import main
from fsdp_compose.demo.data import BatchSampler, CharTokenizer, load_text
from fsdp_compose.demo.model import ModelArgs, Transformer

STEPS, LAYERS, DIM, SEQ = 60, 2, 64, 64


def bucketed_calls(steps: int) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) of ``steps`` training steps of the demo
    model (the root and LAYERS blocks, each unit one flat group, the whole
    model within the default 1 MiB buckets): the first step's forward has no
    recorded order and gathers per unit (LAYERS + 1); every other forward
    gathers all units as one bucket; every backward gathers the blocks
    (resharded after forward; the root keeps its parameters) as one bucket
    and reduce-scatters all units as one bucket."""
    return (LAYERS + 1) + 1 + 2 * (steps - 1), steps


@pytest.mark.slow
def test_demo_trains_at_world_size_2():
    cmd = [sys.executable, "-m", "fsdp_compose.cli", "demo", "--world-size", "2", "--no-progress",
           "--steps", str(STEPS), "--layers", str(LAYERS), "--dim", str(DIM), "--seq-len", str(SEQ),
           "--batch-size", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "train:" not in proc.stderr  # --no-progress: no tqdm bar

    assert f"{LAYERS}-layer dim-{DIM} Llama" in out and "2 ranks (gloo, cpu)" in out, out
    start, end = map(float, re.search(r"loss\s+([\d.]+) -> ([\d.]+)", out).groups())
    assert end < start - 0.5, out  # measured 3.48 -> 2.70
    tokens_per_s = re.search(r"throughput\s+([\d,]+) tokens/s", out).group(1)
    assert float(tokens_per_s.replace(",", "")) > 0

    # One row per rank: peak RSS, then bytes/calls all-gathered and reduce-scattered.
    rows = re.findall(r"^\s*(\d+)\s+([\d,.]+) MiB\s+([\d,.]+) MiB / (\d+) calls\s+"
                      r"([\d,.]+) MiB / (\d+) calls$", out, re.M)
    assert [int(r[0]) for r in rows] == [0, 1], out
    n_params = sum(p.numel() for p in _model().parameters())
    assert n_params * 4 < 2**20 * 0.9  # fits one default bucket (with padding)
    every_step_mib = STEPS * n_params * 4 / 2**20  # each step gathers and reduces every fp32 param
    ag_want, rs_want = bucketed_calls(STEPS)  # 122, 60
    for _, rss, ag_mib, ag_calls, rs_mib, rs_calls in rows:
        mib = lambda s: float(s.replace(",", ""))  # noqa: E731
        assert mib(rss) > 50
        assert mib(ag_mib) >= every_step_mib - 0.1 and mib(rs_mib) >= every_step_mib - 0.1, out
        assert (int(ag_calls), int(rs_calls)) == (ag_want, rs_want), out
    assert re.search(r"^sample\s+The ", out, re.M), out


TP_STEPS = 40


@pytest.mark.slow
def test_demo_trains_2d_dp2_tp2_at_world_size_4():
    """``--tp 2`` at 4 ranks: blocks tensor-parallel over mesh["tp"], fully_shard over "dp"."""
    cmd = [sys.executable, "-m", "fsdp_compose.cli", "demo", "--world-size", "4", "--tp", "2",
           "--no-progress", "--steps", str(TP_STEPS), "--layers", str(LAYERS), "--dim", str(DIM),
           "--seq-len", str(SEQ), "--batch-size", "8", "--sample-chars", "16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    n_params = sum(p.numel() for p in _model().parameters())
    assert f"{n_params / 1e6:.2f}M params, 4 ranks (gloo, cpu), dp 2 x tp 2" in out, out
    start, end = map(float, re.search(r"loss\s+([\d.]+) -> ([\d.]+)", out).groups())
    assert end < start - 0.4, out  # measured 3.443 -> 2.853, as at --tp 1 (2 ranks)

    rows = re.findall(r"^\s*(\d+)\s+([\d,.]+) MiB\s+([\d,.]+) MiB / (\d+) calls\s+"
                      r"([\d,.]+) MiB / (\d+) calls$", out, re.M)
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3], out
    # A rank's units hold its TP half of each block's projections, the blocks' (plain)
    # norms and the whole plain root. Per step it all-gathers the blocks twice
    # (forward, backward) and the root once, and reduce-scatters each unit once:
    # bytes here, calls in buckets (bucketed_calls; test_tp checks that TP shards
    # and plain norms share one flat group per unit).
    model = _model()
    n_proj = sum(p.numel() for p in model.layers.parameters() if p.ndim == 2)
    n_blocks = n_proj / 2 + sum(p.numel() for p in model.layers.parameters() if p.ndim < 2)
    n_root = n_params - sum(p.numel() for p in model.layers.parameters())
    ag_want = TP_STEPS * (2 * n_blocks + n_root) * 4 / 2**20
    rs_want = TP_STEPS * (n_blocks + n_root) * 4 / 2**20
    assert (n_blocks + n_root) * 4 < 2**20 * 0.9  # a rank's units fit one default bucket
    calls_want = bucketed_calls(TP_STEPS)  # 82, 40
    for _, _, ag_mib, ag_calls, rs_mib, rs_calls in rows:
        mib = lambda s: float(s.replace(",", ""))  # noqa: E731
        assert ag_want - 0.1 <= mib(ag_mib) <= ag_want * 1.01 + 0.1, (ag_want, out)
        assert rs_want - 0.1 <= mib(rs_mib) <= rs_want * 1.01 + 0.1, (rs_want, out)
        assert (int(ag_calls), int(rs_calls)) == calls_want, out
    assert re.search(r"^sample\s+The ", out, re.M), out


@pytest.mark.parametrize("argv,msg", [
    (["--world-size", "4", "--tp", "3"], "--tp 3 must divide the world size 4"),
    (["--world-size", "4", "--tp", "2", "--batch-size", "3"], "data-parallel size 2"),
    (["--world-size", "4", "--tp", "4", "--dim", "96"], "must divide the 3 heads"),
    (["--world-size", "3", "--tp", "3", "--dim", "96"], "MLP hidden size 256"),
])
@pytest.mark.fast
def test_cli_rejects_bad_tp(capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        main(["demo", *argv])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


@pytest.mark.fast
def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert re.search(r"^\s+demo\s+train a small Llama", capsys.readouterr().out, re.M)

    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fsdp-compose demo")
    for opt in ["--steps", "--world-size", "--tp", "--batch-size", "--seq-len", "--dim", "--layers",
                "--lr", "--seed", "--sample-chars", "--no-progress"]:
        assert opt in out


@pytest.mark.fast
def test_batch_sampler_splits_the_global_batch():
    tokens = torch.arange(1000)
    samplers = [BatchSampler(tokens, global_batch=6, seq_len=16, rank=r, world_size=3, seed=7)
                for r in range(3)]
    x = torch.cat([s.batch(5)[0] for s in samplers])  # (6, 16): the ranks' slices, in rank order
    y = torch.cat([s.batch(5)[1] for s in samplers])
    assert torch.equal(x[:, 0], samplers[0].global_starts(5))
    assert torch.equal(y, x + 1)  # targets are the inputs shifted by one token
    # A function of (seed, step) only.
    assert torch.equal(samplers[1].batch(5)[0], samplers[1].batch(5)[0])
    assert not torch.equal(samplers[1].batch(5)[0], samplers[1].batch(6)[0])
    with pytest.raises(ValueError, match="not divisible"):
        BatchSampler(tokens, global_batch=7, seq_len=16, rank=0, world_size=2, seed=0)


@pytest.mark.fast
def test_model_tied_and_deterministic():
    a, b = _model(), _model()
    assert a.output.weight is a.tok_embeddings.weight
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert "rope_cos" not in a.state_dict()  # rope tables are non-persistent buffers
    tok = CharTokenizer(load_text())
    x = tok.encode("The keeper climbed the tower.")[None]  # (1, s)
    assert tok.decode(x[0]) == "The keeper climbed the tower."
    logits = a(x)
    assert logits.shape == (1, x.shape[1], tok.vocab_size)
    # Causal: changing the last token leaves every earlier position's logits alone.
    x2 = x.clone()
    x2[0, -1] = (x2[0, -1] + 1) % tok.vocab_size
    torch.testing.assert_close(a(x2)[:, :-1], logits[:, :-1])


def _model() -> Transformer:
    torch.manual_seed(0)
    vocab = CharTokenizer(load_text()).vocab_size
    return Transformer(ModelArgs(vocab_size=vocab, dim=DIM, n_layers=LAYERS, n_heads=DIM // 32,
                                 max_seq_len=SEQ))
