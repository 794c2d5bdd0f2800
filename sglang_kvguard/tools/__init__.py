"""Operator tools: preflight (and, later, the live probe)."""
