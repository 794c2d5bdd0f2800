"""Observability above the guards: what the guards cost (``guard_cost``, opt-in
accounting) and the resource gauges sampled in each scheduler (``resources``). The
counters and gauges every layer writes live in ``engine/metrics.py``."""
