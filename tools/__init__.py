"""Offline checkpoint tools: ``python -m tools.dcp_to_torch`` and
``python -m tools.dcp_inspect``."""
