"""Run one of hiserve's modules as a plain child process.

A multiprocessing child started with ``spawn`` first runs the parent's main script again
(as ``__mp_main__``): a script that builds an engine without an
``if __name__ == "__main__":`` guard builds a second engine in every such child. The
GGUF conversion and the grammar compile workers hung or multiplied that way. A command
from ``module_command`` runs only the named module: ``python -c`` makes hiserve
importable (its package root goes first on ``sys.path`` only where it is not there
already: in an installed copy that is site-packages, which must not go before the
standard library) and runs the module as ``__main__`` with the given arguments.
"""

from __future__ import annotations

import sys
from pathlib import Path

_BOOT = (
    "import runpy, sys\n"
    "root = {root!r}\n"
    "if root not in sys.path:\n"
    "    sys.path.insert(0, root)\n"
    "runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
)


def module_command(module: str, *args: str) -> list[str]:
    """The command that runs ``module`` (e.g. ``engine.grammar_worker``) as ``__main__``
    in a fresh interpreter, with ``args`` as its ``sys.argv[1:]``."""
    root = str(Path(__file__).resolve().parents[1])
    return [sys.executable, "-c", _BOOT.format(root=root, module=module), *args]
