"""A grammar compile worker: the child process side of engine/grammar_pool.py.

It reads the tokenizer's description (``TokenizerInfo.serialize_json``) from its socket,
then compiles one (kind, text) after another and sends each compiled grammar back
serialized, or the compile's error.

A worker loads xgrammar without torch and transformers (``import_xgrammar``). xgrammar
imports both at load time, but only for APIs a compile never calls: torch for the token
bitmask helpers and dtype constants (``xgrammar.matcher``), transformers for
``TokenizerInfo.from_huggingface`` and its logits processor. Loading them made each
worker 290 MB resident (177 MB of it private) and took 2.6-3.3 s of CPU to start, paid
again by every fresh worker after a compile timed out, on the cores the engine steps on.
Without them a worker holding SmolLM2's vocabulary is 77 MB resident (58 MB
proportional) and starts in 0.5 s.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import types
from multiprocessing.connection import Connection
from typing import Any

from engine.grammar_pool import lower_priority

logger = logging.getLogger("hiserve.grammar")

# What xgrammar imports at load time for APIs that compiles never call.
UNUSED_BY_COMPILES = ("torch", "transformers")


def _stand_in(name: str) -> Any:
    """What a placeholder module, or a placeholder in it, gives for attribute ``name``: a
    new placeholder; dunder names are missing, as Python's machinery expects."""
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(name, (), {})


class _Placeholder(type):
    """Whatever a placeholder module is asked for at import time: a class (usable as a
    base class, an annotation, a default value), and calling or indexing one gives it
    back. Nothing a compile runs touches these."""

    def __getattr__(cls, name: str) -> Any:
        return _stand_in(name)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls

    def __getitem__(cls, item: Any) -> Any:
        return cls


def _placeholder_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name, f"stands in for {name} while xgrammar loads")
    module.__getattr__ = _stand_in  # type: ignore[method-assign]
    return module


def _forget(prefixes: tuple[str, ...]) -> None:
    for name in [n for n in sys.modules if n.split(".")[0] in prefixes]:
        del sys.modules[name]


def import_xgrammar() -> tuple[Any, str]:
    """xgrammar for compiling, and how it was loaded: ``"slim"`` (without torch and
    transformers) or ``"full"`` (already loaded, or the slim load failed: logged).

    NOTE: libraries that import torch only if it is there (tvm_ffi, under xgrammar) load
    first while it is marked missing, so they take their supported no-torch path; only
    xgrammar's own unconditional imports then get placeholder modules, which leave
    ``sys.modules`` once it has loaded.
    """
    if "xgrammar" in sys.modules or any(n in sys.modules for n in UNUSED_BY_COMPILES):
        import xgrammar

        return xgrammar, "full"
    try:
        sys.modules.update(dict.fromkeys(UNUSED_BY_COMPILES))  # type: ignore[arg-type]  # None: missing
        with contextlib.suppress(ImportError):  # xgrammar versions before tvm_ffi
            import tvm_ffi  # noqa: F401
        sys.modules.update({n: _placeholder_module(n) for n in UNUSED_BY_COMPILES})
        import xgrammar
    except Exception as exc:  # a new xgrammar uses torch at load: load it whole
        _forget(UNUSED_BY_COMPILES + ("xgrammar",))
        logger.warning("xgrammar did not load without torch (%s): loading it whole", exc)
        import xgrammar

        return xgrammar, "full"
    _forget(UNUSED_BY_COMPILES)
    return xgrammar, "slim"


def _compile(compiler: Any, kind: str, text: str) -> Any:
    if kind == "json_schema":
        return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
    if kind == "regex":
        return compiler.compile_regex(text)
    return compiler.compile_grammar(text)


def worker_main(conn: Any, niceness: int) -> None:
    """The tokenizer's info (its JSON) first, then (kind, text) in, ("ok", json) or
    ("error", message) out. It runs at ``niceness`` (on Linux it inherits that from its
    slot thread already)."""
    lower_priority(niceness, this_thread=False)
    xgr, _ = import_xgrammar()
    try:
        info = xgr.TokenizerInfo.deserialize_json(conn.recv())
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        conn.send(("ready", ""))
        while True:
            kind, text = conn.recv()
            try:
                reply = ("ok", _compile(compiler, kind, text).serialize_json())
            except Exception as exc:  # the constraint's fault: report it, keep serving
                reply = ("error", str(exc).strip().splitlines()[0] if str(exc).strip() else "")
            conn.send(reply)
    except (EOFError, OSError):  # the server closed the pipe (shutdown, or a kill)
        return


if __name__ == "__main__":
    # A Ctrl-C in the server's terminal reaches its whole process group: the server stops
    # the workers itself (``close``, or the end of their socket), with no traceback here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker_main(Connection(int(sys.argv[1])), int(sys.argv[2]))
