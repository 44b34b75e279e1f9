"""Benchmark shapes: plain data, no torch import (the orchestrator reads them)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    dim: int
    hidden: int
    blocks: int
    batch: int      # rows per rank per step
    act: str        # "relu" | "gelu"
    steps: int      # timed steps per launch (default; --steps overrides)
    warmup: int     # untimed steps per launch (default; --warmup overrides)
    what: str

    @property
    def numel(self) -> int:
        per_block = 2 * self.dim * self.hidden + self.hidden + self.dim
        return self.blocks * per_block + 2 * self.dim  # + the root LayerNorm


SHAPES = {
    # Overhead-bound: 64 tiny residual MLP blocks, each its own FSDP unit, so the
    # step is dominated by per-unit hooks, collectives and optimizer calls.
    # 45 timed steps: its peak RSS (~270 MiB, 4 MiB of it training state) is
    # read at steady state: ours levels off by step 6, FSDP1's still grows at
    # step 18 (docs/design.md, "Peak RSS of small units").
    "overhead": Shape("overhead", dim=64, hidden=64, blocks=64, batch=16, act="relu",
                      steps=45, warmup=3,
                      what="64 x [Linear(64,64)+ReLU+Linear(64,64), residual] + LayerNorm"),
    # Memory-bound: ~134M parameters in 8 large blocks (537 MB fp32), small batch,
    # so parameters, gradients, AdamW state and communicated bytes dominate.
    "memory": Shape("memory", dim=2048, hidden=4096, blocks=8, batch=8, act="gelu",
                    steps=3, warmup=1,
                    what="8 x [Linear(2048,4096)+GELU+Linear(4096,2048), residual] + LayerNorm"),
    # Deep: the same ~134M parameters in 16 blocks of ~8.4M (33.6 MB fp32 each),
    # small activations: many mid-sized units, where per-unit buffers (the
    # unsharded flat, its gradient, the gradient shard) and the allocator's
    # reuse of them decide the peak, not the model's size.
    "deep": Shape("deep", dim=1024, hidden=4096, blocks=16, batch=8, act="gelu",
                  steps=3, warmup=1,
                  what="16 x [Linear(1024,4096)+GELU+Linear(4096,1024), residual] + LayerNorm"),
    # Deep and small: 32 blocks of ~2.1M (8.4 MB fp32 each: below glibc's 32 MiB
    # mmap threshold, so every per-unit buffer comes from the heap; each unit
    # still above the 1 MiB buckets).
    "deep-small": Shape("deep-small", dim=512, hidden=2048, blocks=32, batch=8, act="gelu",
                        steps=5, warmup=2,
                        what="32 x [Linear(512,2048)+GELU+Linear(2048,512), residual] + LayerNorm"),
}
