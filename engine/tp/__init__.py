"""Tensor parallelism: rank 0's runtime (runtime.py), the worker processes (worker.py), the
messages they exchange (protocol.py), the KV mirror of the other ranks (mirror.py) and the
process-group plumbing (collectives.py).

Import order, never the reverse: collectives, protocol -> mirror -> worker -> runtime.
"""
