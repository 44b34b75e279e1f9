"""Collectives and the backends that run them: gloo's in-place paths, padded
equal-size collectives, the side-stream and blocking backends, divergence checks.

Layers: tests/test_architecture.py (docs/architecture.md)."""
