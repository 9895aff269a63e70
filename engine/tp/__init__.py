"""Tensor parallelism: rank 0's runtime (runtime.py), the worker processes (worker.py), the
messages they exchange (protocol.py), the KV mirror of the other ranks (mirror.py), the
process-group plumbing (collectives.py), and knowing that a rank died without asking the
collective backend (liveness.py) and what rank 0 then does (failure.py).

Import order, never the reverse: collectives, protocol, liveness -> failure, mirror ->
worker -> runtime.
"""
