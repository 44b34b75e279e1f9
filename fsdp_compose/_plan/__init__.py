"""Pure values and arithmetic, no collectives: the shard layout, the forward order,
the backward plan and its walker (tools/_planner.py drives them with sizes).

Layers: tests/test_architecture.py (docs/architecture.md)."""
