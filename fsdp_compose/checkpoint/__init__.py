"""State dicts, loading and meta-device materialisation.

Layers: tests/test_architecture.py (docs/architecture.md)."""
