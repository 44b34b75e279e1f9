"""The base layer: leaves every other layer reads (private torch calls, enums and
settings values, per-job state, the registry of sharded objects, launch helpers).

Layers: tests/test_architecture.py (docs/architecture.md)."""
