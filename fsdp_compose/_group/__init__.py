"""Parameters and flat groups: the RowParam DTensors over the flat shard, a group's
storage and gradient path, the all-gather extension, the group operations.

Layers: tests/test_architecture.py (docs/architecture.md)."""
