"""Micro-benchmarks: one kernel, copy or layer at a time (``python -m bench.micro.<name>``).

The load tool (``python -m bench``) and the whole-engine benchmarks (offline, http_cost,
hicache_offline, l3, mixed, grammar) stay in ``bench/``.
"""
