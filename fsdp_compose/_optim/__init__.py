"""The optimizer step on local tensors, the torch entry points patched, clipping.

Layers: tests/test_architecture.py (docs/architecture.md)."""
