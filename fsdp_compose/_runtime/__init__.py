"""The step: units, the root (where every hook enters), its forward order and
backward reductions, fully_shard and FSDPModule.

Layers: tests/test_architecture.py (docs/architecture.md)."""
